"""The shared task chain: typed hand-offs between its tasks, never Jinja strings of XCom pulls; Params as native values."""

from __future__ import annotations

import airflow  # noqa: F401  (importing Airflow puts its plugins folder on sys.path)
import pytest
from airflow.sdk import DAG
from airflow.sdk.definitions.xcom_arg import PlainXComArg

from kubetrain.pipeline import common_params, training_pipeline

TRAINER = "registry.example/kubetrain/trainer@sha256:" + "a" * 64


def build(**params):
    with DAG(
        "train_x",
        schedule=None,
        params=common_params(dataset_uri="s3://datasets/x/", model="x", **params),
        render_template_as_native_obj=True,
    ) as dag:
        tasks = training_pipeline(
            title="x", cmds=["python"], arguments=["--epochs={{ params.epochs }}", "{{ params.epochs }}"]
        )
    return dag, tasks


def source(value) -> tuple[str, str]:
    assert isinstance(value, PlainXComArg), value
    return value.operator.task_id, value.key


def test_tasks_hand_each_other_typed_xcoms():
    dag, t = build()
    assert source(t.check.dataset_version) == ("stage_dataset", "version")
    assert source(t.train.image) == ("check_new", "image")
    assert source(t.train.dataset_manifest) == ("stage_dataset", "manifest_uri")
    assert source(t.train.dataset_version) == ("stage_dataset", "version")
    assert source(t.train.dataset_bytes) == ("stage_dataset", "total_bytes")
    assert source(t.train.prepared_bytes) == ("stage_dataset", "prepared_bytes")
    assert t.train.data_size == "{{ params.data_size or '' }}"
    assert source(t.report.run_uri) == ("train", "run_uri")
    assert source(t.promote.run_uri) == ("train", "run_uri")
    assert source(t.promote.is_better) == ("report", "better_than_promoted")
    assert source(t.record.fingerprint) == ("check_new", "fingerprint")
    assert source(t.record.image) == ("check_new", "image")
    assert source(t.record.promotion) == ("promote", "return_value")
    # Tasks whose dict results are read key by key push each key as its own XCom.
    assert all(task.multiple_outputs for task in (t.stage, t.check, t.report, t.promote))
    assert [task.task_id for task in dag.topological_sort()] == [
        "stage_dataset",
        "check_new",
        "train",
        "report",
        "promote",
        "record",
    ]


def test_no_template_pulls_xcoms_as_text():
    dag, _ = build()
    for task in dag.tasks:
        for name in task.template_fields:
            value = getattr(task, name, None)
            assert "xcom_pull" not in repr(value), f"{task.task_id}.{name} = {value!r}"


class TaskInstance:
    """The parts of a running task instance that rendering reads: the upstream tasks' XComs."""

    def __init__(self, xcoms: dict[tuple[str, str], object]) -> None:
        self.xcoms = xcoms
        self.dag_id, self.task_id, self.map_index, self.try_number = "train_x", "train", -1, 1

    def xcom_pull(self, task_ids: str, key: str, **_: object) -> object:
        return self.xcoms[(task_ids, key)]

    def xcom_push(self, key: str, value: object) -> None:
        self.xcoms[("train", key)] = value


def test_a_dag_that_renders_text_is_refused_naming_the_setting():
    with (
        pytest.raises(
            ValueError, match=r"DAG 'train_text': training_pipeline passes Params .* native objects"
        ),
        DAG("train_text", schedule=None, params=common_params(dataset_uri="s3://datasets/x/", model="x")),
    ):
        training_pipeline(title="x", cmds=["python"], arguments=[])
    with pytest.raises(
        ValueError, match=r"training_pipeline creates its tasks in the current DAG: call it inside"
    ):
        training_pipeline(title="x", cmds=["python"], arguments=[])


def test_params_reach_the_training_task_as_values_and_names_stay_text():
    from airflow.sdk import Param
    from kubernetes.client import models as k8s

    dag, t = build(epochs=Param(5, type="integer", section="Training"))
    params = dag.params.validate()
    params.update(
        model_name="1.10",  # text that reads as a number: a name, kept as typed
        experiment="2.50",
        gpus=2,
        cpu="2",
        node_selector={"gpu-type": "a100"},
        tolerations=[{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
        image_pull_secrets=["run-cred"],
    )
    xcoms = {
        ("stage_dataset", "version"): "3f2a9c0d1e4b5a69",
        ("stage_dataset", "manifest_uri"): "s3://training/manifests/x/3f2a9c0d1e4b5a69.json",
        ("stage_dataset", "total_bytes"): 1024,
        ("stage_dataset", "prepared_bytes"): 4096,
        ("stage_dataset", "objects"): 1,
        ("check_new", "image"): TRAINER,
        ("train", "run_uri"): "s3://training/runs/train_x/r",
        ("train", "notes"): [],
        ("train", "disruptions"): {"interruptions": [], "queued_s": 0.0},
        ("report", "better_than_promoted"): True,
    }
    ti = TaskInstance(xcoms)
    context = {"ti": ti, "task_instance": ti, "run_id": "r", "dag": dag, "params": params}
    for task in (t.stage, t.check, t.train, t.report, t.promote):
        task.render_template_fields(
            context, dag.get_template_env()
        )  # the DAG's environment, as a worker does
    train = t.train
    assert (train.gpus, train.sync_interval, train.dataset_bytes, train.prepared_bytes) == (2, 30, 1024, 4096)
    assert train.arguments == ["--epochs=5", 5]  # the operator's pod takes them as text
    # the provider's own argument names, with the values as given
    assert train.node_selector == {"gpu-type": "a100"}
    assert train.tolerations == [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]
    assert train.image_pull_secrets == ["run-cred"]
    config = train.pod_config(context, pin=False)
    assert config.args == ["--epochs=5", "5"]
    assert config.labels["kubetrain.io/experiment"] == "2.50"
    assert config.node_selector == {"gpu-type": "a100"} and config.image_pull_secrets == ("run-cred",)
    pod = train.build_pod_request_obj(context, dry_run=True)
    assert pod.spec.node_selector == {"gpu-type": "a100"}
    assert pod.spec.image_pull_secrets == [k8s.V1LocalObjectReference(name="run-cred")]
    assert [t.key for t in pod.spec.tolerations if t.key == "spot"] == ["spot"]
    # the model name is the Param itself, not a rendered text read as a literal (1.10 is not the number 1.1)
    assert (t.report.model, t.promote.model, t.promote.promote) == ("1.10", "1.10", "if_better")
    assert (t.stage.source_uri, t.check.image, t.report.require_metrics) == ("s3://datasets/x/", "", True)
    # the report tells the dataset as staged and that the promote task decides after it
    report = t.report
    assert (report.dataset_uri, report.dataset_bytes, report.dataset_objects) == ("s3://datasets/x/", 1024, 1)
    assert report.promote == "if_better"


@pytest.mark.parametrize(
    ("value", "ok"), [(None, True), ("200Gi", True), ("1.5Ti", True), ("200", False), ("lots", False)]
)
def test_the_data_size_param_takes_a_size_with_its_unit(value, ok):
    from airflow.sdk.exceptions import ParamValidationError

    param = common_params(dataset_uri="s3://datasets/x/", model="x")["data_size"]
    if ok:
        assert param.resolve(value) == value
    else:
        with pytest.raises(ParamValidationError):
            param.resolve(value)
