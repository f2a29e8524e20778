"""The shared task chain: typed hand-offs between its tasks, never Jinja strings of XCom pulls."""

from __future__ import annotations

import airflow  # noqa: F401  (importing Airflow puts its plugins folder on sys.path)
import pytest
from airflow.sdk import DAG
from airflow.sdk.definitions.xcom_arg import PlainXComArg

from kubetrain.pipeline import common_params, training_pipeline


def build():
    with DAG(
        "train_x", schedule=None, params=common_params(dataset_uri="s3://datasets/x/", model="x")
    ) as dag:
        tasks = training_pipeline(title="x", cmds=["python"], arguments=["--epochs=1"])
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
