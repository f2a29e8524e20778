"""The trigger form marks as required (a red asterisk) only the Params that need a value.

Airflow 3's form marks a Param required when its schema's ``type`` does not allow ``null``
(:func:`kubetrain.params.marked_required` says which, as the form decides). A boolean is a
switch, which always has a value, and an optional Param (default empty) needs none: neither
is marked. The rule is read from the UI that Airflow ships, so that a new Airflow that decides
otherwise fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import airflow  # noqa: F401  (importing Airflow puts its plugins folder on sys.path)
import pytest

from kubetrain.params import form_order, marked_required

REPO = Path(__file__).resolve().parents[2]
# The form's rule in the UI bundle (minified): required = the schema has a type, and the type is not a
# list that holds "null".
FORM_RULE = re.compile(
    r"(\w+)=>!!\1\.schema\.type&&\(!Array\.isArray\(\1\.schema\.type\)\|\|!\1\.schema\.type\.includes\(`null`\)\)"
)


@pytest.fixture(scope="module")
def dagbag():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags"))
    assert bag.import_errors == {}, bag.import_errors
    return bag


def _form_params(dag) -> dict[str, tuple[object, dict]]:
    """``{name: (default, schema)}`` as the API server serves them to the trigger form: from the serialized DAG."""
    from airflow.serialization.serialized_objects import DagSerialization

    served = DagSerialization.from_dict(DagSerialization.to_dict(dag))
    return {name: (param.dump()["value"], param.dump()["schema"]) for name, param in served.params.items()}


def test_the_form_decides_required_as_kubetrain_reads_it():
    bundle = Path(airflow.__file__).parent / "ui" / "dist" / "assets"
    sources = [p.read_text(errors="replace") for p in bundle.glob("*.js")]
    assert any(FORM_RULE.search(text) for text in sources), (
        f"the trigger form's required rule moved in {bundle}"
    )
    table = [
        ({"type": "boolean"}, True),
        ({"type": ["boolean", "null"]}, False),
        ({"type": ["null", "string"]}, False),
        ({"type": "integer", "minimum": 1}, True),
        ({"enum": ["a", "b"]}, False),
    ]
    assert [marked_required(schema) for schema, _ in table] == [required for _, required in table]


def test_no_dag_marks_a_switch_or_an_optional_param_required(dagbag):
    seen_switches = 0
    for dag in dagbag.dags.values():
        for name, (default, schema) in _form_params(dag).items():
            kind = schema.get("type")
            kinds = kind if isinstance(kind, list) else [kind]
            if "boolean" in kinds:
                seen_switches += 1
                assert not marked_required(schema), (
                    f"{dag.dag_id}: switch {name!r} is marked required: {schema}"
                )
                assert isinstance(default, bool), (dag.dag_id, name, default)
            if default is None:
                assert not marked_required(schema), (
                    f"{dag.dag_id}: optional {name!r} is marked required: {schema}"
                )
    assert seen_switches >= 5  # force, augment, metrics_required, the image build's force


def test_the_training_form_marks_the_params_that_need_a_value(dagbag):
    params = _form_params(dagbag.dags["train_image_classifier"])
    required = {name for name, (_, schema) in params.items() if marked_required(schema)}
    assert {"dataset_uri", "model_name", "epochs", "batch_size", "gpus", "cpu", "memory"} <= required
    assert not required & {"force", "augment", "image", "node_selector", "experiment"}


def test_a_switch_still_takes_only_true_or_false():
    from airflow.sdk import Param
    from airflow.sdk.exceptions import ParamValidationError

    force = form_order({"force": Param(False, type="boolean", title="Force", section="Promotion")})["force"]
    assert force.schema["type"] == ["boolean", "null"] and force.schema["section"] == "Promotion"
    assert force.resolve(True) is True and force.resolve(False) is False
    with pytest.raises(ParamValidationError):
        force.resolve("yes")
