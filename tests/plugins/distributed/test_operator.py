"""DistributedTrainingOperator's own logic: replica counts from Params, job names, the trigger's round trip."""

from __future__ import annotations

import re
from pathlib import Path

import airflow  # noqa: F401  (puts the plugins folder on sys.path)
import pytest

from kubetrain.operators.distributed import DistributedTrainingOperator, job_name
from kubetrain.triggers.distributed import DistributedJobTrigger


def test_job_names_are_dns_labels_with_room_for_role_and_index():
    name = job_name("train_image_classifier_distributed", "manual__2026-11-23T09:29:18.477510+00:00", 3)
    assert re.fullmatch(r"kt-train-image-classi-[0-9a-f]{8}-3", name)
    assert len(f"{name}-worker-0-63") <= 63
    assert job_name("d", "run-a", 1) != job_name("d", "run-b", 1) != job_name("d", "run-a", 2)


def test_params_become_the_replica_spec_and_the_single_pod_resources_are_the_workers():
    op = DistributedTrainingOperator(
        task_id="t", workers="3", ps_replicas="0", gpus="2", cpu="4", memory="8Gi"
    )
    spec = op.distributed_spec()
    assert spec.replicas() == {"chief": 1, "worker": 2}
    assert spec.resources("worker").gpus == 2 and spec.resources("chief").cpu == "4"
    ps = DistributedTrainingOperator(
        task_id="t", workers=2, ps_replicas=1, gpus=1, gpus_per_ps="0"
    ).distributed_spec()
    assert ps.replicas() == {"chief": 1, "worker": 2, "ps": 1}
    assert ps.resources("ps").gpus == 0 and ps.resources("chief").gpus == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"workers": "0"}, "workers='0' is not valid: expected an integer from 1 to 64"),
        ({"ps_replicas": 20}, "ps_replicas=20 is not valid: expected an integer from 0 to 16"),
    ],
)
def test_a_bad_replica_count_fails_before_anything_is_created(kwargs, message):
    with pytest.raises(ValueError) as err:
        DistributedTrainingOperator(task_id="t", **kwargs).distributed_spec()
    assert message in str(err.value)


def test_the_trigger_serializes_to_plain_arguments():
    trigger = DistributedJobTrigger(
        backend="indexed_job",
        name="kt-x-1",
        namespace="kubetrain",
        resources=[["v1", "Service", "services", "kt-x-1"], ["batch/v1", "Job", "jobs", "kt-x-1-chief"]],
        roles=["chief", "worker"],
        container="base",
        pod_selector="kubetrain.io/distributed-job=kt-x-1",
        deadline=123.0,
        startup={
            "schedule_timeout": 900,
            "unschedulable_grace": 60,
            "startup_timeout": 600,
            "stage_in_timeout": 3600,
            "stage_in_container": "stage-in",
        },
        kubernetes_conn_id="kubernetes_default",
    )
    path, kwargs = trigger.serialize()
    assert path == "kubetrain.triggers.distributed.DistributedJobTrigger"
    again = DistributedJobTrigger(**kwargs)
    assert again.serialize() == (path, kwargs)


def test_the_chief_of_a_parameter_server_job_gets_its_own_resources_from_the_dags_params():
    from airflow.models.dagbag import DagBag

    from kubetrain.operators.training import TrainingPodOperator

    dag_id = "train_image_classifier_distributed"
    dag = DagBag(dag_folder=str(Path(__file__).resolve().parents[3] / "dags" / f"{dag_id}.py")).dags[dag_id]
    (task,) = [t for t in dag.tasks if isinstance(t, DistributedTrainingOperator)]
    assert isinstance(task, TrainingPodOperator)
    defaults = {name: dag.params[name] for name in dag.params}

    names = (
        "workers",
        "ps_replicas",
        "ps_cpu",
        "ps_memory",
        "chief_cpu",
        "chief_memory",
        "cpu",
        "memory",
        "gpus",
        "gpus_per_worker",
        "gpus_per_ps",
        "worker_cpu",
        "worker_memory",
    )
    templates = {name: getattr(task, name) for name in names}

    def spec(**params):
        context = {
            "params": {**defaults, "ps_replicas": 1, "workers": 2, "cpu": "2", "memory": "4Gi", **params}
        }
        for name, template in templates.items():
            setattr(task, name, task.render_template(template, context))
        return task.distributed_spec()

    coordinator = spec(chief_cpu="500m", chief_memory="1Gi").resources("chief")
    assert (coordinator.cpu, coordinator.memory, coordinator.gpus) == ("500m", "1Gi", 0)
    assert spec(chief_cpu="500m").resources("worker").cpu == "2"
    # empty: the chief gets the workers' CPU and memory
    default = spec(chief_cpu=None, chief_memory=None).resources("chief")
    assert (default.cpu, default.memory) == ("2", "4Gi")
    assert dag.params.get_param("chief_cpu").resolve(None) is None
    with pytest.raises(Exception, match="chief_cpu|does not match"):
        dag.params.get_param("chief_cpu").resolve("lots")


# -- a queued job that Kueue would not hold is refused before it runs unqueued --------------------------
# The dev stack serves no TFJob or TrainJob (include/devstack/KUBEAPI.md), so the API's answer to the dry run
# is stood in for here; the Indexed Job's is the dev stack's own (tests/e2e/test_kueue_training.py).


class _DryRunAnswers:
    """What a cluster's API returns for a dry-run creation: the object after its mutating webhooks."""

    def __init__(self, suspended: bool) -> None:
        self.suspended = suspended
        self.calls: list[dict] = []

    def create_namespaced_custom_object(self, group, version, namespace, plural, body, dry_run=None):
        self.calls.append({"plural": plural, "dry_run": dry_run})
        spec = dict(body.get("spec") or {})
        if self.suspended:
            spec["runPolicy"] = {**(spec.get("runPolicy") or {}), "suspend": True}
        return {**body, "spec": spec}


@pytest.mark.parametrize("suspended", [True, False])
def test_a_queued_tfjob_is_refused_when_kueue_would_not_suspend_it(monkeypatch, suspended):
    from airflow.sdk.exceptions import AirflowFailException

    from kubetrain.distributed import builders

    api = _DryRunAnswers(suspended)
    monkeypatch.setattr("kubernetes.client.CustomObjectsApi", lambda client: api)
    op = DistributedTrainingOperator(task_id="train", image="img", workers=2)
    monkeypatch.setattr(type(op), "hook", property(lambda self: type("Hook", (), {"api_client": None})()))
    resource = builders.Resource(
        api_version="kubeflow.org/v1",
        kind="TFJob",
        plural="tfjobs",
        name="run-1",
        body={"metadata": {"name": "run-1", "labels": {"kueue.x-k8s.io/queue-name": "training"}}, "spec": {}},
    )
    if suspended:
        op._check_queued("kubetrain", resource)
    else:
        with pytest.raises(AirflowFailException, match=r"'kubeflow.org/tfjob' integration is not enabled"):
            op._check_queued("kubetrain", resource)
    assert api.calls == [{"plural": "tfjobs", "dry_run": "All"}]
