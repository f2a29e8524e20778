"""Pods through the official `kubernetes` client: CRUD, validation, selectors, patches, logs, exec, deletion."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException
from kubernetes.stream import stream

from .support import first_line, simple_pod, wait_for, wait_phase

NS = "default"


def create(core, body: dict) -> client.V1Pod:
    return core.create_namespaced_pod(NS, body)


def logs(core, name: str, **kw) -> str:
    return core.read_namespaced_pod_log(name, NS, _preload_content=False, **kw).data.decode()


def api_error(fn, *args, **kwargs) -> tuple[int, dict]:
    with pytest.raises(ApiException) as err:
        fn(*args, **kwargs)
    return err.value.status, json.loads(err.value.body)


def test_crud_generate_name_and_errors(core):
    pod = create(
        core, simple_pod("", "echo hi", metadata={"generateName": "gen-", "labels": {"suite": "crud"}})
    )
    name = pod.metadata.name
    assert re.fullmatch(r"gen-[a-z0-9]{5}", name)
    assert pod.metadata.uid and pod.metadata.resource_version and pod.status.phase == "Pending"
    got = core.read_namespaced_pod(name, NS)
    assert got.spec.containers[0].image == "busybox:1.36"
    assert got.spec.restart_policy == "Never" and got.spec.service_account_name == "default"  # API defaults
    assert name in [p.metadata.name for p in core.list_pod_for_all_namespaces().items]
    status, body = api_error(create, core, simple_pod(name, "true"))
    assert (status, body["reason"]) == (409, "AlreadyExists") and name in body["message"]
    status, body = api_error(core.read_namespaced_pod, "no-such-pod", NS)
    assert (status, body["reason"], body["details"]["name"]) == (404, "NotFound", "no-such-pod")
    status, body = api_error(core.read_namespaced_pod, "x", "no-such-namespace")
    assert status == 404
    status, body = api_error(
        create, core, {**simple_pod("x", "true"), "metadata": {"name": "x", "namespace": "no-such-ns"}}
    )
    assert status in (400, 404)
    wait_phase(core, name)
    core.delete_namespaced_pod(name, NS)
    wait_for(
        lambda: name not in [p.metadata.name for p in core.list_namespaced_pod(NS).items],
        10,
        what="pod removal",
    )


@pytest.mark.parametrize(
    ("mutate", "field", "reason"),
    [
        (lambda p: p["metadata"].update(name="Bad_Name"), "metadata.name", "FieldValueInvalid"),
        (lambda p: p["spec"].update(containers=[]), "spec.containers", "FieldValueRequired"),
        (
            lambda p: p["spec"]["containers"].append(dict(p["spec"]["containers"][0])),
            "spec.containers[1].name",
            "FieldValueDuplicate",
        ),
        (
            lambda p: p["spec"]["containers"][0].update(name="Not_A_Label"),
            "spec.containers[0].name",
            "FieldValueInvalid",
        ),
        (
            lambda p: p["spec"]["containers"][0].update(image=""),
            "spec.containers[0].image",
            "FieldValueRequired",
        ),
        (
            lambda p: p["spec"]["containers"][0].update(volumeMounts=[{"name": "nope", "mountPath": "/x"}]),
            "spec.containers[0].volumeMounts[0].name",
            "FieldValueNotFound",
        ),
        (
            lambda p: p["spec"].update(volumes=[{"name": "v", "persistentVolumeClaim": {"claimName": "c"}}]),
            "spec.volumes[0].persistentVolumeClaim",
            "FieldValueNotSupported",
        ),
        (
            lambda p: p["spec"].update(restartPolicy="Sometimes"),
            "spec.restartPolicy",
            "FieldValueNotSupported",
        ),
    ],
)
def test_invalid_pods_are_422_with_the_field(core, mutate, field, reason):
    body = simple_pod("invalid-pod", "true")
    mutate(body)
    status, err = api_error(create, core, body)
    assert status == 422 and err["reason"] == "Invalid"
    assert (field, reason) in [(c["field"], c["reason"]) for c in err["details"]["causes"]], err
    assert field in err["message"]


def test_wrong_types_are_400(core):
    body = simple_pod("typed", "true")
    body["spec"]["terminationGracePeriodSeconds"] = "soon"
    status, err = api_error(create, core, body)
    assert status == 400 and "terminationGracePeriodSeconds" in err["message"]


def test_label_and_field_selectors(core):
    specs = {"sel-a": {"app": "a", "tier": "x"}, "sel-b": {"app": "b"}, "sel-c": {"app": "c", "tier": "y"}}
    for name, labels in specs.items():
        create(core, simple_pod(name, "true", metadata={"labels": {**labels, "suite": "sel"}}))
    for name in specs:
        wait_phase(core, name)
    cases = {
        "suite=sel,app=a": {"sel-a"},
        "suite=sel,app==b": {"sel-b"},
        "suite=sel,app!=a": {"sel-b", "sel-c"},
        "suite=sel,app in (a, c)": {"sel-a", "sel-c"},
        "suite=sel,app notin (a,c)": {"sel-b"},
        "suite=sel,tier": {"sel-a", "sel-c"},
        "suite=sel,!tier": {"sel-b"},
    }
    for selector, expected in cases.items():
        got = {p.metadata.name for p in core.list_namespaced_pod(NS, label_selector=selector).items}
        assert got == expected, selector
    fields = {
        "metadata.name=sel-b": {"sel-b"},
        "metadata.namespace=default,status.phase=Succeeded": {"sel-a", "sel-b", "sel-c"},
        "spec.nodeName=kubetrain-dev": {"sel-a", "sel-b", "sel-c"},
        "status.phase=Running": set(),
        "metadata.name!=sel-a": {"sel-b", "sel-c"},
    }
    for selector, expected in fields.items():
        got = {
            p.metadata.name
            for p in core.list_namespaced_pod(NS, label_selector="suite=sel", field_selector=selector).items
        }
        assert got == expected, selector
    everywhere = core.list_pod_for_all_namespaces(
        label_selector="suite=sel", field_selector="status.phase=Succeeded"
    )
    assert {p.metadata.name for p in everywhere.items} == set(specs)
    page = core.list_namespaced_pod(NS, label_selector="suite=sel", limit=2)
    rest = core.list_namespaced_pod(
        NS, label_selector="suite=sel", limit=2, _continue=page.metadata._continue
    )
    assert {p.metadata.name for p in page.items + rest.items} == set(specs) and len(page.items) == 2
    core.delete_collection_namespaced_pod(NS, label_selector="suite=sel")
    wait_for(
        lambda: not core.list_namespaced_pod(NS, label_selector="suite=sel").items,
        10,
        what="collection delete",
    )


def test_patches_and_conflicts(core, kubeapi):
    create(core, simple_pod("patched", "sleep 30", metadata={"labels": {"keep": "1", "drop": "1"}}))
    # strategic merge (the client's default for dict bodies), as the provider's already_checked label
    pod = core.patch_namespaced_pod("patched", NS, {"metadata": {"labels": {"already_checked": "True"}}})
    assert pod.metadata.labels == {"keep": "1", "drop": "1", "already_checked": "True"}
    # JSON patch (list bodies)
    pod = core.patch_namespaced_pod(
        "patched",
        NS,
        [
            {"op": "remove", "path": "/metadata/labels/drop"},
            {"op": "add", "path": "/metadata/annotations", "value": {"a": "b"}},
        ],
    )
    assert pod.metadata.labels == {"keep": "1", "already_checked": "True"} and pod.metadata.annotations == {
        "a": "b"
    }
    # merge patch, explicitly
    req = urllib.request.Request(
        f"{kubeapi.url}/api/v1/namespaces/{NS}/pods/patched",
        method="PATCH",
        data=json.dumps({"metadata": {"annotations": {"a": None, "c": "d"}}}).encode(),
        headers={"Content-Type": "application/merge-patch+json"},
    )
    with kubeapi.urlopen(req) as resp:
        pod_json = json.load(resp)
    assert pod_json["metadata"]["annotations"] == {"c": "d"}
    stale = core.read_namespaced_pod("patched", NS)
    core.patch_namespaced_pod("patched", NS, {"metadata": {"labels": {"bump": "1"}}})
    stale.metadata.labels["other"] = "x"
    status, err = api_error(core.replace_namespaced_pod, "patched", NS, stale)
    assert (status, err["reason"]) == (409, "Conflict")
    status, err = api_error(
        core.patch_namespaced_pod,
        "patched",
        NS,
        {"spec": {"containers": [{"name": "main", "image": "alpine:3"}]}},
    )
    assert status == 422 and err["details"]["causes"][0]["field"] == "spec"
    core.delete_namespaced_pod("patched", NS, grace_period_seconds=0)


def test_logs_options_and_follow(core, kubeapi):
    script = "for i in 1 2 3 4 5; do echo line-$i; sleep 0.3; done; echo err-line >&2"
    create(core, simple_pod("logger", script))
    wait_for(
        lambda: core.read_namespaced_pod("logger", NS).status.phase == "Running", 20, 0.05, "logger to run"
    )
    # follow: the stream yields lines while the container runs and closes when it exits
    resp = core.read_namespaced_pod_log("logger", NS, follow=True, _preload_content=False)
    first_at, lines = None, []
    for raw in resp.stream(amt=None):
        for line in raw.decode().splitlines():
            lines.append(line)
            if first_at is None:
                first_at = time.monotonic()
                phase_then = core.read_namespaced_pod("logger", NS).status.phase
    assert lines == ["line-1", "line-2", "line-3", "line-4", "line-5", "err-line"]
    assert phase_then == "Running"
    pod = wait_phase(core, "logger")
    assert pod.status.phase == "Succeeded"
    assert logs(core, "logger", tail_lines=2) == "line-5\nerr-line\n"
    assert logs(core, "logger", limit_bytes=8) == "line-1\nl"
    stamped = logs(core, "logger", timestamps=True).splitlines()
    assert all(
        re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,9})?Z line-\d|.*Z err-line", s) for s in stamped
    ), stamped
    ts = stamped[2].split(" ")[0]
    # the Python client has no since_time parameter: ask over HTTP, as kubectl --since-time does
    query = urllib.parse.urlencode({"sinceTime": ts})
    with kubeapi.urlopen(f"{kubeapi.url}/api/v1/namespaces/{NS}/pods/logger/log?{query}") as resp:
        assert resp.read().decode().startswith("line-3\n")
    assert logs(core, "logger", since_seconds=3600).count("\n") == 6
    status, err = api_error(core.read_namespaced_pod_log, "logger", NS, container="nope")
    assert status == 400 and "nope" in err["message"]
    status, err = api_error(core.read_namespaced_pod_log, "logger", NS, previous=True)
    assert status == 400 and "previous terminated container" in err["message"]
    core.delete_namespaced_pod("logger", NS)


def test_restart_back_off_previous_logs_and_status(core):
    script = (
        "if [ -f /state/ran ]; then echo second-run; exit 0; fi; touch /state/ran; echo first-run; exit 4"
    )
    body = simple_pod(
        "restarter",
        script,
        restartPolicy="OnFailure",
        volumes=[{"name": "state", "emptyDir": {}}],
        container={"volumeMounts": [{"name": "state", "mountPath": "/state"}]},
    )
    create(core, body)
    pod = wait_phase(core, "restarter", ("Succeeded",), 30)
    cs = pod.status.container_statuses[0]
    assert cs.restart_count == 1
    assert cs.last_state.terminated.exit_code == 4 and cs.last_state.terminated.reason == "Error"
    assert cs.state.terminated.exit_code == 0 and cs.state.terminated.reason == "Completed"
    assert logs(core, "restarter") == "second-run\n"
    assert logs(core, "restarter", previous=True) == "first-run\n"
    events = {
        e.reason: e
        for e in core.list_namespaced_event(NS, field_selector="involvedObject.name=restarter").items
    }
    assert (
        events["BackOff"].type == "Warning"
        and "restarting failed container main" in events["BackOff"].message
    )
    assert events["Started"].count == 2  # identical events are aggregated, as the event recorder does
    core.delete_namespaced_pod("restarter", NS)


def exec_run(core, name: str, command: list[str], container: str | None = None, stdin: str | None = None):
    kwargs = {"container": container} if container else {}
    ws = stream(
        core.connect_get_namespaced_pod_exec,
        name,
        NS,
        command=command,
        stdin=stdin is not None,
        stdout=True,
        stderr=True,
        tty=False,
        _preload_content=False,
        **kwargs,
    )
    if stdin is not None:
        ws.write_stdin(stdin)
        ws.close_channel(0)
    out, err = "", ""
    deadline = time.monotonic() + 20
    while ws.is_open() and time.monotonic() < deadline:
        ws.update(timeout=1)
        out += ws.read_stdout() if ws.peek_stdout() else ""
        err += ws.read_stderr() if ws.peek_stderr() else ""
    code = ws.returncode
    ws.close()
    return out, err, code


def host_init_start() -> str:
    return open("/proc/1/stat").read().split()[21]


def test_exec_channels_exit_codes_and_pid_namespace(core, kubeapi):
    script = 'trap "echo got-int; exit 0" INT; echo ready > /work/ready; while true; do sleep 0.2; done'
    body = simple_pod(
        "execd",
        script,
        volumes=[{"name": "work", "emptyDir": {}}],
        container={"volumeMounts": [{"name": "work", "mountPath": "/work"}]},
    )
    create(core, body)
    wait_for(
        lambda: core.read_namespaced_pod("execd", NS).status.phase == "Running", 20, what="execd running"
    )
    assert exec_run(core, "execd", ["cat", "/work/ready"]) == ("ready\n", "", 0)
    assert exec_run(core, "execd", ["sh", "-c", "echo out; echo err >&2; exit 7"]) == ("out\n", "err\n", 7)
    assert exec_run(core, "execd", ["cat"], stdin="from-stdin") == ("from-stdin", "", 0)
    out, _, code = exec_run(core, "execd", ["sh", "-c", "cat /proc/1/cmdline | tr '\\0' ' '; echo; hostname"])
    assert code == 0 and "while true" in out and out.splitlines()[1] == "execd"
    _, err, code = exec_run(core, "execd", ["no-such-binary"])
    assert code == 127 and 'exec: "no-such-binary": executable file not found in $PATH' in err
    before = host_init_start()
    # the provider's sidecar shutdown: PID 1 is the container's own process, never the host's
    exec_run(core, "execd", ["kill", "-s", "SIGINT", "1"])
    pod = wait_phase(core, "execd", timeout=20)
    assert pod.status.phase == "Succeeded" and logs(core, "execd") == "got-int\n"
    assert host_init_start() == before
    # exec into a container that is no longer running is refused before the upgrade, as the kubelet does
    url = f"{kubeapi.url}/api/v1/namespaces/{NS}/pods/execd/exec?command=true&stdout=true"
    with pytest.raises(urllib.error.HTTPError) as refused:
        kubeapi.urlopen(url)
    assert refused.value.code == 400 and "container not found" in refused.value.read().decode()
    core.delete_namespaced_pod("execd", NS)


def test_watch_events_and_resource_versions(core):
    start_rv = core.list_namespaced_pod(NS).metadata.resource_version
    seen: list[tuple[str, str]] = []
    done = threading.Event()

    def watcher():
        # from start_rv: whenever the watch connects, it sees every change after that version
        w = watch.Watch()
        for ev in w.stream(
            core.list_namespaced_pod,
            NS,
            label_selector="suite=watch",
            resource_version=start_rv,
            timeout_seconds=30,
        ):
            seen.append((ev["type"], ev["object"].status.phase))
            if ev["type"] == "DELETED":
                w.stop()
        done.set()

    t = threading.Thread(target=watcher, daemon=True)
    t.start()
    pod = create(core, simple_pod("watched", "echo hi", metadata={"labels": {"suite": "watch"}}))
    wait_phase(core, "watched")
    core.delete_namespaced_pod("watched", NS)
    assert done.wait(20), seen
    assert seen[0][0] == "ADDED" and seen[-1][0] == "DELETED"
    assert ("MODIFIED", "Succeeded") in seen
    # resuming from a resourceVersion replays what happened since
    replay = [
        (ev["type"], ev["object"].metadata.name)
        for ev in watch.Watch().stream(
            core.list_namespaced_pod,
            NS,
            resource_version=start_rv,
            label_selector="suite=watch",
            timeout_seconds=1,
        )
    ]
    assert replay[0] == ("ADDED", "watched") and replay[-1] == ("DELETED", "watched")
    # events of the pod, by field selector, also as events.k8s.io/v1
    events = core.list_namespaced_event(
        NS,
        field_selector=f"involvedObject.name=watched,involvedObject.kind=Pod,involvedObject.uid={pod.metadata.uid}",
    )
    reasons = [e.reason for e in events.items]
    assert reasons[:1] == ["Scheduled"] and {"Pulled", "Created", "Started"} <= set(reasons)
    assert all(e.involved_object.uid == pod.metadata.uid for e in events.items)
    v1 = client.EventsV1Api(core.api_client).list_namespaced_event(
        NS, field_selector="regarding.name=watched"
    )
    assert {e.reason for e in v1.items} == set(reasons) and all(e.regarding.kind == "Pod" for e in v1.items)
    ev_rv = events.metadata.resource_version
    create(core, simple_pod("watched-2", "true", metadata={"labels": {"suite": "watch"}}))
    later = [
        ev["object"].reason
        for ev in watch.Watch().stream(
            core.list_namespaced_event,
            NS,
            resource_version=ev_rv,
            field_selector="involvedObject.name=watched-2",
            timeout_seconds=2,
        )
    ]
    assert "Scheduled" in later
    wait_phase(core, "watched-2")
    core.delete_namespaced_pod("watched-2", NS)


def test_graceful_deletion_sigterm_then_sigkill(core):
    stubborn = "trap 'echo ignoring-term' TERM; echo trapped; while true; do sleep 0.1; done"
    polite = "trap 'echo bye; exit 0' TERM; echo trapped; while true; do sleep 0.1; done"
    create(core, simple_pod("stubborn", stubborn, terminationGracePeriodSeconds=2))
    create(core, simple_pod("polite", polite, terminationGracePeriodSeconds=30))
    for name in ("stubborn", "polite"):
        wait_for(
            lambda n=name: core.read_namespaced_pod(n, NS).status.phase == "Running",
            20,
            what=f"{name} running",
        )
        assert first_line(core, name) == "trapped"
    finals: dict[str, client.V1Pod] = {}
    rv = core.list_namespaced_pod(NS).metadata.resource_version

    def watcher():
        for ev in watch.Watch().stream(core.list_namespaced_pod, NS, resource_version=rv, timeout_seconds=60):
            if ev["type"] == "DELETED" and ev["object"].metadata.name in ("stubborn", "polite"):
                finals[ev["object"].metadata.name] = ev["object"]
                if len(finals) == 2:
                    return

    t = threading.Thread(target=watcher, daemon=True)
    t.start()
    started = time.monotonic()
    core.delete_namespaced_pod("polite", NS)
    core.delete_namespaced_pod("stubborn", NS)
    marked = core.read_namespaced_pod("stubborn", NS)
    assert (
        marked.metadata.deletion_timestamp is not None and marked.metadata.deletion_grace_period_seconds == 2
    )
    t.join(60)
    elapsed = time.monotonic() - started
    assert set(finals) == {"polite", "stubborn"}
    assert elapsed > 1.5  # the stubborn pod had its 2 s of grace before SIGKILL
    polite_state = finals["polite"].status.container_statuses[0].state.terminated
    stubborn_state = finals["stubborn"].status.container_statuses[0].state.terminated
    assert (polite_state.exit_code, polite_state.reason) == (0, "Completed")
    assert stubborn_state.exit_code == 137 and stubborn_state.reason == "Error"
    status, _ = api_error(core.read_namespaced_pod, "stubborn", NS)
    assert status == 404


@pytest.mark.parametrize("resource", ["secrets", "configmaps"])
def test_watch_list_initial_events_and_bookmarks(kubeapi, core, resource):
    name = f"watched-{resource}"
    body = {"metadata": {"name": name, "labels": {"suite": "bookmarks"}}, "data": {"k": "dmFsdWU="}}
    if resource == "secrets":
        core.create_namespaced_secret(NS, body)
    else:
        core.create_namespaced_config_map(NS, {**body, "data": {"k": "value"}})
    query = urllib.parse.urlencode(
        {
            "watch": "1",
            "sendInitialEvents": "true",
            "allowWatchBookmarks": "true",
            "resourceVersionMatch": "NotOlderThan",
            "labelSelector": "suite=bookmarks",
            "timeoutSeconds": "1",
        }
    )
    with kubeapi.urlopen(f"{kubeapi.url}/api/v1/namespaces/{NS}/{resource}?{query}") as resp:
        assert resp.headers["Content-Type"] == "application/json"
        events = [json.loads(line) for line in resp.read().decode().splitlines()]
    assert [(e["type"], e["object"]["metadata"].get("name")) for e in events] == [
        ("ADDED", name),
        ("BOOKMARK", None),
    ]
    assert events[1]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}
    assert int(events[1]["object"]["metadata"]["resourceVersion"]) >= int(
        events[0]["object"]["metadata"]["resourceVersion"]
    )
    # a resumed watch sees the update and the deletion, in order
    rv = events[0]["object"]["metadata"]["resourceVersion"]
    patch = {"metadata": {"labels": {"touched": "yes"}}}
    if resource == "secrets":
        core.patch_namespaced_secret(name, NS, patch)
        core.delete_namespaced_secret(name, NS)
    else:
        core.patch_namespaced_config_map(name, NS, patch)
        core.delete_namespaced_config_map(name, NS)
    query = urllib.parse.urlencode({"watch": "true", "resourceVersion": rv, "timeoutSeconds": "1"})
    with kubeapi.urlopen(f"{kubeapi.url}/api/v1/namespaces/{NS}/{resource}?{query}") as resp:
        later = [json.loads(line) for line in resp.read().decode().splitlines()]
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in later] == [
        ("MODIFIED", name),
        ("DELETED", name),
    ]
