"""A TrainJob created right after its TrainingRuntime: the Trainer webhook's "must be created before" refusal
is retried with a bounded backoff, every other refusal fails at once; and the rendered TrainJob carries its
node count where Trainer reads it (``spec.trainer.numNodes``, applied to the trainer-ancestor job)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import airflow  # noqa: F401  (puts the plugins folder on sys.path)
import pytest
from distributed_schemas import validate_trainer
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kubetrain import pod_spec
from kubetrain.distributed import builders
from kubetrain.distributed.spec import DistributedSpec
from kubetrain.distributed.submit import RUNTIME_NOT_SEEN, create_retrying

NS = "kubetrain"
# The API server's answer when the Trainer's validating webhook refuses a TrainJob whose runtime its cache
# has not seen (controller-runtime's admission.Denied of pkg/runtime/core/trainingruntime.go's error).
NOT_SEEN = (
    'admission webhook "validator.trainjob.trainer.kubeflow.org" denied the request: spec.runtimeRef: '
    'Invalid value: {"name":"kt-x","apiGroup":"trainer.kubeflow.org","kind":"TrainingRuntime"}: '
    'trainingruntimes.trainer.kubeflow.org "kt-x" not found: '
    "specified trainingRuntime must be created before the TrainJob is created"
)
OTHER = (
    'admission webhook "validator.trainjob.trainer.kubeflow.org" denied the request: '
    "spec.trainer.numNodes: Invalid value: 0: must be greater than or equal to 1"
)


class FakeTrainerApi(BaseHTTPRequestHandler):
    """An API server whose Trainer webhook refuses the first ``refusals`` TrainJob creations with ``message``."""

    refusals = 0
    message = NOT_SEEN
    posts: list[dict] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).posts.append(body)
        if len(type(self).posts) <= type(self).refusals:
            status = {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": type(self).message,
                "reason": "Forbidden",
                "code": 403,
            }
            self.answer(403, status)
        else:
            self.answer(201, {**body, "metadata": {**body["metadata"], "uid": "u-1", "resourceVersion": "7"}})

    def answer(self, code: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def trainer_api():
    FakeTrainerApi.posts = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeTrainerApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    configuration = client.Configuration()
    configuration.host = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield client.ApiClient(configuration)
    finally:
        server.shutdown()
        server.server_close()


def submission(spec: DistributedSpec | None = None) -> builders.Submission:
    config = pod_spec.TrainingPodConfig(
        image="r.example/kubetrain/trainer@sha256:" + "a" * 64,
        sync_image="r.example/kubetrain/sync@sha256:" + "b" * 64,
        run_uri="s3://training/runs/train_x/manual__1",
        command=["python", "-m", "trainer.image_classifier"],
    )
    return builders.build(
        "trainjob", config, spec or DistributedSpec(workers=3), name="kt-x", namespace=NS, labels={}
    )


def creator(api_client: client.ApiClient):
    def create(namespace: str, resource: builders.Resource) -> dict:
        return client.CustomObjectsApi(api_client).create_namespaced_custom_object(
            resource.group, resource.version, namespace, resource.plural, resource.body
        )

    return create


def test_the_not_yet_seen_runtime_refusal_is_retried_until_the_trainjob_is_created(trainer_api, caplog):
    FakeTrainerApi.refusals, FakeTrainerApi.message = 2, NOT_SEEN
    _, trainjob = submission().resources
    created = create_retrying(creator(trainer_api), NS, trainjob, wait_s=0.01, max_wait_s=0.05)
    assert created["metadata"]["uid"] == "u-1" and created["kind"] == "TrainJob"
    assert len(FakeTrainerApi.posts) == 3
    assert caplog.text.count("has not seen its runtime yet") == 2


def test_other_refusals_fail_at_once(trainer_api):
    FakeTrainerApi.refusals, FakeTrainerApi.message = 5, OTHER
    _, trainjob = submission().resources
    with pytest.raises(ApiException) as refused:
        create_retrying(creator(trainer_api), NS, trainjob, wait_s=0.01)
    assert refused.value.status == 403 and "numNodes" in refused.value.body
    assert len(FakeTrainerApi.posts) == 1


def test_the_retries_are_bounded(trainer_api):
    FakeTrainerApi.refusals, FakeTrainerApi.message = 100, NOT_SEEN
    _, trainjob = submission().resources
    with pytest.raises(ApiException) as refused:
        create_retrying(creator(trainer_api), NS, trainjob, attempts=4, wait_s=0.01, max_wait_s=0.02)
    assert RUNTIME_NOT_SEEN in refused.value.body
    assert len(FakeTrainerApi.posts) == 4


def trainer_sizes(runtime: dict, trainjob: dict) -> dict[str, int]:
    """Each replicated job's pod count once Kubeflow Trainer (v2.3, the PlainML policy) has applied the
    TrainJob: the trainer-ancestor job's parallelism and completions become ``spec.trainer.numNodes``
    (else the runtime's ``mlPolicy.numNodes``); the other jobs keep their own
    (pkg/runtime/core/trainingruntime.go, plugins/plainml/plainml.go, plugins/jobset/jobset.go)."""
    num_nodes = (trainjob["spec"].get("trainer") or {}).get("numNodes") or (
        runtime["spec"].get("mlPolicy") or {}
    ).get("numNodes")
    sizes = {}
    for job in runtime["spec"]["template"]["spec"]["replicatedJobs"]:
        labels = job["template"].get("metadata", {}).get("labels") or {}
        count = job["template"]["spec"].get("parallelism", 1)
        if labels.get(builders.TRAINJOB_ANCESTOR_LABEL) == "trainer" and num_nodes:
            count = num_nodes
        sizes[job["name"]] = count
    return sizes


@pytest.mark.parametrize(
    "spec",
    [
        DistributedSpec(workers=3),  # chief + 2 workers
        DistributedSpec(workers=2, ps_replicas=1),  # chief + 2 workers + 1 ps
        DistributedSpec(workers=1),  # the chief alone
    ],
    ids=["mirrored", "ps", "chief-only"],
)
def test_the_trainjob_carries_the_node_count_where_trainer_reads_it(spec):
    runtime, trainjob = (r.body for r in submission(spec).resources)
    validate_trainer(runtime)
    validate_trainer(trainjob)
    jobs = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    ancestors = [
        j["name"]
        for j in jobs
        if (j["template"].get("metadata", {}).get("labels") or {}).get(builders.TRAINJOB_ANCESTOR_LABEL)
        == "trainer"
    ]
    expected_ancestor = "worker" if "worker" in spec.replicas() else "chief"
    assert ancestors == [expected_ancestor]  # one job that Trainer sizes
    assert trainjob["spec"]["trainer"]["numNodes"] == spec.replicas()[expected_ancestor]
    assert runtime["spec"]["mlPolicy"]["numNodes"] == spec.replicas()[expected_ancestor]
    # what Trainer makes of it is the cluster kubetrain's TF_CONFIG describes
    assert trainer_sizes(runtime, trainjob) == spec.replicas()
    # the TrainingRuntime webhook requires the container "node" in the trainer-ancestor job
    for job in jobs:
        names = [c["name"] for c in job["template"]["spec"]["template"]["spec"]["containers"]]
        assert names == [builders.TRAINJOB_CONTAINER]
    assert submission(spec).container == "node"
