"""Pod networking on one machine: headless Services, an address per pod, names by hostname and subdomain.

Two pods of an Indexed Job listen on the same port and reach each other as
``<hostname>.<subdomain>`` and ``<hostname>.<subdomain>.<namespace>.svc.cluster.local``, as the
workers of a multi-worker training job do on a cluster.
"""

from __future__ import annotations

import json
import threading

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException
from kubernetes.stream import stream

from .support import simple_pod, wait_for

NS = "default"

# Each worker serves its own hostname on port 8000, fetches its peer's by name (retrying while the peer's
# record is not there yet, as workers do), and keeps serving until the peer has fetched its page.
WORKER = r"""
import http.server, os, socket, sys, threading, time, urllib.request
me = socket.gethostname()
index = int(os.environ["JOB_COMPLETION_INDEX"])
peer = f"ring-{1 - index}.ring"
served = threading.Event()

class Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = f"{me} {os.environ['POD_IP']}".encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body); served.set()
    def log_message(self, *args):
        pass

server = http.server.ThreadingHTTPServer(("", 8000), Page)  # all addresses, as servers usually bind
threading.Thread(target=server.serve_forever, daemon=True).start()
deadline = time.monotonic() + 120
while True:
    try:
        got = urllib.request.urlopen(f"http://{peer}:8000/", timeout=5).read().decode()
        break
    except OSError as exc:
        if time.monotonic() > deadline:
            sys.exit(f"{peer} unreachable: {exc}")
        time.sleep(0.2)
fqdn = socket.gethostbyname(f"{peer}.default.svc.cluster.local")
print(f"{me} got '{got}' from {peer} ({fqdn}); bound {server.server_address[0]}:{server.server_address[1]}", flush=True)
if not served.wait(120):
    sys.exit("the peer never fetched this worker's page")
"""


def headless(name: str, selector: dict, **spec) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name},
        "spec": {
            "clusterIP": "None",
            "selector": selector,
            "ports": [{"name": "http", "port": 8000}],
            **spec,
        },
    }


def logs(core, pod: str) -> str:
    return core.read_namespaced_pod_log(pod, NS, _preload_content=False).data.decode()


def test_two_workers_on_one_port_find_each_other_by_name(core, batch):
    core.create_namespaced_service(NS, headless("ring", {"job-name": "ring"}))
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "ring"},
        "spec": {
            "completions": 2,
            "parallelism": 2,
            "completionMode": "Indexed",
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "subdomain": "ring",
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "worker",
                            "image": "python:3.11-slim",
                            "command": ["python", "-c", WORKER],
                            "env": [
                                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
                            ],
                        }
                    ],
                }
            },
        },
    }
    batch.create_namespaced_job(NS, job)

    def finished():
        conds = batch.read_namespaced_job_status("ring", NS).status.conditions or []
        return next((c.type for c in conds if c.type in ("Complete", "Failed") and c.status == "True"), None)

    outcome = wait_for(finished, 150, what="the two workers to reach each other")
    pods = {p.spec.hostname: p for p in core.list_namespaced_pod(NS, label_selector="job-name=ring").items}
    assert outcome == "Complete", {h: logs(core, p.metadata.name) for h, p in pods.items()}
    ip0, ip1 = pods["ring-0"].status.pod_ip, pods["ring-1"].status.pod_ip
    assert ip0 != ip1 and ip0.startswith("127.") and ip1.startswith("127.")
    assert pods["ring-0"].status.pod_ips[0].ip == ip0
    assert (
        logs(core, pods["ring-0"].metadata.name)
        == f"ring-0 got 'ring-1 {ip1}' from ring-1.ring ({ip1}); bound {ip0}:8000\n"
    )
    assert (
        logs(core, pods["ring-1"].metadata.name)
        == f"ring-1 got 'ring-0 {ip0}' from ring-0.ring ({ip0}); bound {ip1}:8000\n"
    )
    batch.delete_namespaced_job("ring", NS, propagation_policy="Background")
    core.delete_namespaced_service("ring", NS)


TF_WORKER = r"""
import json, os
index = int(os.environ["JOB_COMPLETION_INDEX"])
os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": ["tf-0.tf:2222", "tf-1.tf:2222"]},
                                      "task": {"type": "worker", "index": index}})
import tensorflow as tf
strategy = tf.distribute.MultiWorkerMirroredStrategy()
total = strategy.reduce("SUM", strategy.run(lambda: tf.constant(float(index + 1))), axis=None)
print(f"worker {index}: {strategy.num_replicas_in_sync} replicas in sync, sum {float(total)}", flush=True)
"""


def test_two_tensorflow_workers_all_reduce_over_their_names(core, batch):
    """MultiWorkerMirroredStrategy's gRPC servers both bind port 2222 (on all addresses) and meet by name."""
    core.create_namespaced_service(NS, headless("tf", {"job-name": "tf"}, ports=[{"port": 2222}]))
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "tf"},
        "spec": {
            "completions": 2,
            "parallelism": 2,
            "completionMode": "Indexed",
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "subdomain": "tf",
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "worker",
                            "image": "tensorflow/tensorflow:2.21.0",
                            "command": ["python", "-c", TF_WORKER],
                            "env": [{"name": "TF_CPP_MIN_LOG_LEVEL", "value": "2"}],
                        }
                    ],
                }
            },
        },
    }
    batch.create_namespaced_job(NS, job)

    def finished():
        conds = batch.read_namespaced_job_status("tf", NS).status.conditions or []
        return next((c.type for c in conds if c.type in ("Complete", "Failed") and c.status == "True"), None)

    outcome = wait_for(finished, 240, what="two TensorFlow workers to all-reduce")
    pods = {
        p.spec.hostname: p.metadata.name
        for p in core.list_namespaced_pod(NS, label_selector="job-name=tf").items
    }
    out = {host: logs(core, name) for host, name in pods.items()}
    assert outcome == "Complete", out
    for index in (0, 1):
        assert f"worker {index}: 2 replicas in sync, sum 3.0\n" in out[f"tf-{index}"]
    batch.delete_namespaced_job("tf", NS, propagation_policy="Background")
    core.delete_namespaced_service("tf", NS)


def exec_out(core, pod: str, command: list[str]) -> str:
    return stream(
        core.connect_get_namespaced_pod_exec,
        pod,
        NS,
        command=command,
        stdout=True,
        stderr=True,
        stdin=False,
        tty=False,
    )


def running(core, name: str) -> client.V1Pod:
    return wait_for(
        lambda: (p := core.read_namespaced_pod(name, NS)).status.phase == "Running" and p,
        60,
        what=f"{name} running",
    )


def test_hosts_file_follows_pods_and_services(core):
    def pod(name: str, labels: dict) -> dict:
        return simple_pod(
            name,
            "echo started; sleep 300",
            metadata={"labels": labels},
            hostname=name,
            subdomain="team",
            terminationGracePeriodSeconds=0,
        )

    core.create_namespaced_pod(NS, pod("alpha", {"app": "team"}))
    core.create_namespaced_pod(NS, pod("beta", {"app": "team"}))
    core.create_namespaced_pod(NS, pod("gamma", {"app": "other"}))  # the Service does not select it
    alpha, beta = running(core, "alpha"), running(core, "beta")
    running(core, "gamma")
    hosts = exec_out(core, "alpha", ["cat", "/etc/hosts"])
    assert (
        f"{alpha.status.pod_ip}\talpha.team.default.svc.cluster.local\talpha" in hosts
    )  # the kubelet's own line
    assert "beta.team" not in hosts  # no Service named like the subdomain yet: no records
    assert exec_out(core, "alpha", ["cat", "/etc/hostname"]) == "alpha\n"

    def alpha_hosts_has(text: str, present: bool) -> str:
        return wait_for(
            lambda: (h := exec_out(core, "alpha", ["cat", "/etc/hosts"])) and ((text in h) == present) and h,
            30,
            what=f"alpha's /etc/hosts {'with' if present else 'without'} {text!r}",
        )

    core.create_namespaced_service(NS, headless("team", {"app": "team"}))
    hosts = alpha_hosts_has("beta.team.default.svc.cluster.local", True)
    assert (
        f"{beta.status.pod_ip}\tbeta.team.default.svc.cluster.local beta.team.default.svc beta.team.default beta.team\n"
        in hosts
    )
    assert "gamma" not in hosts
    core.patch_namespaced_pod(
        "gamma", NS, {"metadata": {"labels": {"app": "team"}}}
    )  # now the Service selects it
    alpha_hosts_has("gamma.team.default.svc.cluster.local", True)
    core.delete_namespaced_pod("beta", NS, grace_period_seconds=0)
    alpha_hosts_has("beta.team", False)
    core.delete_namespaced_service("team", NS)
    alpha_hosts_has("alpha.team.default.svc ", False)
    for name in ("alpha", "gamma"):
        core.delete_namespaced_pod(name, NS, grace_period_seconds=0)


def test_services_crud_watch_and_validation(core):
    events: list[tuple[str, str]] = []
    start_rv = core.list_namespaced_service(NS).metadata.resource_version
    done = threading.Event()

    def watcher():
        w = watch.Watch()
        for ev in w.stream(core.list_namespaced_service, NS, resource_version=start_rv, timeout_seconds=30):
            events.append((ev["type"], ev["object"].metadata.name))
            if ev["type"] == "DELETED":
                done.set()
                w.stop()

    thread = threading.Thread(target=watcher, daemon=True)
    thread.start()
    created = core.create_namespaced_service(NS, headless("workers", {"app": "w"}))
    assert (
        created.spec.cluster_ip == "None"
        and created.spec.cluster_ips == ["None"]
        and created.spec.type == "ClusterIP"
    )
    assert created.spec.ports[0].protocol == "TCP" and created.spec.ports[0].target_port == 8000
    assert [s.metadata.name for s in core.list_namespaced_service(NS, label_selector="").items] == ["workers"]
    core.patch_namespaced_service("workers", NS, {"metadata": {"labels": {"team": "ml"}}})
    assert core.read_namespaced_service("workers", NS).metadata.labels == {"team": "ml"}
    core.delete_namespaced_service("workers", NS)
    assert done.wait(30)
    assert events == [("ADDED", "workers"), ("MODIFIED", "workers"), ("DELETED", "workers")]

    with pytest.raises(ApiException) as err:
        core.create_namespaced_service(NS, {"metadata": {"name": "web"}, "spec": {"ports": [{"port": 80}]}})
    body = json.loads(err.value.body)
    assert err.value.status == 422 and body["details"]["causes"][0]["field"] == "spec.clusterIP"
    assert "serves headless Services only (clusterIP: None)" in body["message"]
    with pytest.raises(ApiException) as err:
        core.create_namespaced_service(NS, headless("Bad_Name", {}, ports=[{"port": 70000}, {"port": 1}]))
    fields = {c["field"] for c in json.loads(err.value.body)["details"]["causes"]}
    assert err.value.status == 422 and fields == {
        "metadata.name",
        "spec.ports[0].port",
        "spec.ports[0].targetPort",
        "spec.ports[0].name",
        "spec.ports[1].name",
    }


def test_discovery_says_which_custom_resources_exist(kubeapi):
    api = kubeapi.api_client()
    groups = {
        g.name: g.preferred_version.group_version for g in client.ApisApi(api).get_api_versions().groups
    }
    assert groups["apiextensions.k8s.io"] == "apiextensions.k8s.io/v1"
    assert "kubeflow.org" not in groups and "trainer.kubeflow.org" not in groups
    resources = client.ApiextensionsV1Api(api).get_api_resources().resources
    assert [r.name for r in resources if "/" not in r.name] == ["customresourcedefinitions"]
    assert client.ApiextensionsV1Api(api).list_custom_resource_definition().items == []
    with pytest.raises(ApiException) as err:
        client.ApiextensionsV1Api(api).read_custom_resource_definition("tfjobs.kubeflow.org")
    assert err.value.status == 404
    message = json.loads(err.value.body)["message"]
    assert message == 'customresourcedefinitions.apiextensions.k8s.io "tfjobs.kubeflow.org" not found'
    for group, version, plural in (
        ("kubeflow.org", "v1", "tfjobs"),
        ("trainer.kubeflow.org", "v1alpha1", "trainjobs"),
    ):
        with pytest.raises(ApiException) as err:
            client.CustomObjectsApi(api).list_namespaced_custom_object(group, version, NS, plural)
        assert err.value.status == 404 and f"does not serve {group}/{version}" in err.value.body


def test_host_network_pods_keep_the_machines_address(core):
    core.create_namespaced_pod(
        NS,
        simple_pod(
            "on-host",
            "echo $POD_IP; cat /etc/hosts",
            hostNetwork=True,
            container={"env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]},
        ),
    )
    pod = wait_for(
        lambda: (p := core.read_namespaced_pod("on-host", NS)).status.phase == "Succeeded" and p,
        60,
        what="the hostNetwork pod",
    )
    assert pod.status.pod_ip == "127.0.0.1"
    with open("/etc/hosts") as f:
        machine_hosts = f.read()
    assert (
        logs(core, "on-host") == f"127.0.0.1\n{machine_hosts}"
    )  # the machine's own /etc/hosts, not a managed one
    core.delete_namespaced_pod("on-host", NS)
