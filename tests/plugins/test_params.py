"""The trigger form's Params: their order, and a dataset URI refused in words wherever Airflow checks it."""

from __future__ import annotations

from pathlib import Path

import pytest
from airflow.sdk import Param
from airflow.serialization.definitions.param import SerializedParamsDict
from airflow.serialization.serialized_objects import DagSerialization

from kubetrain.params import S3_URI, form_order, is_s3_uri
from kubetrain.pipeline import common_params

REPO = Path(__file__).resolve().parents[2]
TRAINING_DAGS = ("train_image_classifier", "train_dialogue_transformer", "train_custom_container")


def sections(params) -> list[str | None]:
    """The form's groups in order (None: the open "Run Parameters" group), as the UI groups them."""
    seen: list[str | None] = []
    for param in params.values():
        section = param.schema.get("section")
        if section not in seen:
            seen.append(section)
    return seen


def test_form_order_opens_training_and_model_first_and_folds_the_rest():
    params = {
        "promote": Param("always", type="string", section="Promotion"),
        "dataset_uri": Param("s3://d/x/", type="string", section="Data"),
        "workers": Param(1, type="integer", section="Distributed"),
        "cpu": Param("1", type="string", section="Resources"),
        "architecture": Param("cnn", type="string", section="Model"),
        "tolerations": Param(None, type=["null", "array"], section="Cluster"),
        "epochs": Param(5, type="integer", description="Passes.", section="Training"),
    }
    ordered = form_order(params)
    assert list(ordered) == [
        "epochs",
        "architecture",
        "dataset_uri",
        "cpu",
        "workers",
        "tolerations",
        "promote",
    ]
    assert sections(ordered) == [None, "Data", "Resources", "Distributed", "Cluster", "Promotion"]
    # The open Params keep everything but their section.
    assert ordered["epochs"].schema == {"type": "integer"} and ordered["epochs"].description == "Passes."
    assert ordered["epochs"].value == 5
    assert ordered["promote"] is params["promote"]


def test_common_params_take_the_dags_own_and_replace_by_name():
    params = common_params(
        dataset_uri="s3://datasets/x/",
        model="x",
        epochs=Param(3, type="integer", title="Epochs", section="Training"),
        promote=Param(
            "always", type="string", enum=["always", "never"], title="Promote", section="Promotion"
        ),
    )
    assert list(params)[:2] == ["epochs", "model_name"]
    assert params["promote"].value == "always"
    assert sections(params) == [None, "Data", "Resources", "Cluster", "Promotion"]


@pytest.mark.parametrize("dag_id", TRAINING_DAGS)
def test_training_dags_show_their_own_params_first(dag_id):
    from airflow.dag_processing.dagbag import DagBag

    dag = DagBag(dag_folder=str(REPO / "dags" / f"{dag_id}.py")).dags[dag_id]
    # What the API server serves the form: the serialized DAG's Params, in order.
    served = DagSerialization.from_dict(DagSerialization.to_dict(dag)).params
    names = list(served)
    groups = sections({n: served.get_param(n) for n in names})
    assert groups[0] is None, groups  # the open group comes first
    assert groups[1:] == [s for s in ("Data", "Resources", "Cluster", "Promotion") if s in groups[1:]], groups
    open_names = [n for n in names if served.get_param(n).schema.get("section") is None]
    assert "model_name" in open_names and "dataset_uri" not in open_names
    if dag_id != "train_custom_container":
        assert open_names[0] == "epochs", open_names


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("s3://datasets/digits/", True),
        ("s3://datasets/digits.zip", True),
        ("s3://my.bucket-1/a/b/c", True),
        ("s3://datasets", False),  # no prefix or file
        ("datasets/digits/", False),
        ("S3://datasets/digits/", False),
        ("s3://Datasets/digits/", False),
        ("https://datasets.s3.amazonaws.com/digits/", False),
        ("", False),
    ],
)
def test_s3_uri(value, ok):
    assert is_s3_uri(value) is ok


def test_a_bad_dataset_uri_is_refused_in_words_where_the_api_server_checks_it():
    params = common_params(dataset_uri="s3://datasets/digits/", model="m")
    assert params["dataset_uri"].schema["format"] == S3_URI
    # The SDK's check (the worker and `airflow dags test`).
    with pytest.raises(
        Exception, match=r"'datasets/digits' is not a 'S3 URI: s3://<bucket>/<prefix>/"
    ) as sdk:
        params["dataset_uri"].resolve("datasets/digits")
    # The API server's check of a submitted trigger form: the serialized Params, validated.
    served = SerializedParamsDict({k: _serialized(v) for k, v in params.items()}).deep_merge(
        {"dataset_uri": "datasets/digits"}
    )
    with pytest.raises(
        Exception, match=r"Invalid input for param dataset_uri: 'datasets/digits' is not a 'S3 URI"
    ) as api:
        served.validate()
    for error in (sdk.value, api.value):
        assert "^s3://" not in str(error) and "pattern" not in str(error)
    served.deep_merge({"dataset_uri": "s3://datasets/digits/"}).validate()


def _serialized(param: Param):
    from airflow.serialization.definitions.param import SerializedParam

    return SerializedParam(param.value, param.description, **param.schema)
