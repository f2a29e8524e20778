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
    for error in (sdk.value, api.value):  # refused by the format, in words, not by the prefixes' pattern
        assert "Failed validating 'format'" in str(error) and "does not match" not in str(error)
    served.deep_merge({"dataset_uri": "s3://datasets/digits/"}).validate()


def _serialized(param: Param):
    from airflow.serialization.definitions.param import SerializedParam

    return SerializedParam(param.value, param.description, **param.schema)


@pytest.mark.parametrize(
    ("prefixes", "narrowed", "uri", "ok"),
    [
        ("", (), "s3://datasets/digits/", True),
        ("", (), "s3://datasets/", True),
        ("", (), "s3://other/digits/", False),
        ("", (), "s3://datasets-old/digits/", False),
        ("s3://datasets/team-a/", (), "s3://datasets/team-a/digits.zip", True),
        ("s3://datasets/team-a/", (), "s3://datasets/team-a", True),
        ("s3://datasets/team-a/", (), "s3://datasets/team-ab/digits/", False),
        ("s3://datasets/team-a/", (), "s3://datasets/digits/", False),
        ("s3://datasets/team-a/, s3://shared/x.y", (), "s3://shared/x.y/z", True),
        ("s3://datasets/team-a/, s3://shared/x.y", (), "s3://shared/xzy/z", False),
        ("", ("s3://datasets/digits/",), "s3://datasets/digits/v2/", True),
        ("", ("s3://datasets/digits/",), "s3://datasets/mnist/", False),
    ],
)
def test_the_form_refuses_a_dataset_outside_the_environments_prefixes(
    monkeypatch, prefixes, narrowed, uri, ok
):
    """The same rule as the stage task's check (kubetrain.s3_layout.check_dataset_source), at the form."""
    from airflow.sdk.exceptions import ParamValidationError

    from kubetrain.s3_layout import check_dataset_source

    monkeypatch.setenv("KUBETRAIN_DATASET_PREFIXES", prefixes)
    monkeypatch.delenv("KUBETRAIN_DATASETS_BUCKET", raising=False)
    params = common_params(dataset_uri="s3://datasets/digits/", model="m", dataset_prefixes=narrowed)
    allowed = [p.strip() for p in prefixes.split(",") if p.strip()] or ["s3://datasets/"]
    try:
        check_dataset_source(uri, allowed=allowed, training_bucket="training", narrowed=narrowed)
        stage_ok = True
    except ValueError:
        stage_ok = False
    assert stage_ok is ok or narrowed  # narrowed prefixes outside the deployment's are the stage's to refuse
    served = SerializedParamsDict({k: _serialized(v) for k, v in params.items()}).deep_merge(
        {"dataset_uri": uri}
    )
    if ok:
        assert params["dataset_uri"].resolve(uri) == uri
        served.validate()
    else:
        with pytest.raises(ParamValidationError):
            params["dataset_uri"].resolve(uri)
        with pytest.raises(Exception, match="Invalid input for param dataset_uri"):
            served.validate()


def test_the_dataset_param_says_which_prefixes_the_form_knows_and_who_decides(monkeypatch):
    monkeypatch.setenv("KUBETRAIN_DATASET_PREFIXES", "s3://datasets/team-a/,s3://shared/")
    description = common_params(dataset_uri="s3://datasets/team-a/x/", model="m")["dataset_uri"].description
    assert "under s3://datasets/team-a/ or s3://shared/" in description
    assert (
        "KUBETRAIN_DATASET_PREFIXES" in description and "kubetrain_dataset_prefixes Variable" in description
    )
    monkeypatch.delenv("KUBETRAIN_DATASET_PREFIXES")
    monkeypatch.setenv("KUBETRAIN_DATASETS_BUCKET", "corp-data")
    params = common_params(dataset_uri="s3://corp-data/x/", model="m")
    assert "under s3://corp-data/" in params["dataset_uri"].description
    assert params["dataset_uri"].resolve("s3://corp-data/y/") == "s3://corp-data/y/"
