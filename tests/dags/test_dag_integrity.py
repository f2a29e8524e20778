"""DAG integrity: every file in dags/ imports cleanly and follows the project's DAG rules."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import airflow  # noqa: F401  (importing Airflow puts its plugins folder on sys.path)
import pytest

from kubetrain.defaults import DEFAULT_ARGS
from kubetrain.params import SCHEMA_DIALECT

REPO = Path(__file__).resolve().parents[2]
DAG_FILES = sorted(p for p in (REPO / "dags").glob("*.py") if not p.name.startswith("_"))
HEAVY_MODULES = ("tensorflow", "boto3", "botocore", "matplotlib", "pandas", "trainer", "keras")


@pytest.fixture(scope="module")
def dagbag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(REPO / "dags"))


def test_dags_folder_has_dags():
    assert DAG_FILES, "dags/ holds no DAG files"


def test_no_import_errors(dagbag):
    assert dagbag.import_errors == {}, "\n".join(f"{k}: {v}" for k, v in dagbag.import_errors.items())


@pytest.mark.parametrize("path", DAG_FILES, ids=lambda p: p.name)
def test_one_dag_per_file_named_after_it(dagbag, path):
    dags = [d for d in dagbag.dags.values() if Path(d.fileloc).resolve() == path.resolve()]
    assert [d.dag_id for d in dags] == [path.stem]


@pytest.mark.parametrize("path", DAG_FILES, ids=lambda p: p.name)
def test_dag_conventions(dagbag, path):
    dag = dagbag.dags[path.stem]
    assert dag.tags, f"{dag.dag_id} has no tags"
    assert dag.doc_md and len(dag.doc_md.strip()) > 40, f"{dag.dag_id} has no doc_md (the module docstring)"
    assert dag.catchup is False, f"{dag.dag_id} must set catchup=False"
    for task in dag.tasks:
        assert task.retries >= 1, f"{dag.dag_id}.{task.task_id} has no retries"
    # one set of defaults (owner, retries, KUBETRAIN_RETRY_DELAY_SECONDS) for every DAG, and every
    # task gets them: a task may ask for more retries, never for another owner or retry delay
    assert dag.default_args == DEFAULT_ARGS, (
        f"{dag.dag_id} has default_args={dag.default_args}: expected kubetrain.defaults.DEFAULT_ARGS"
    )
    for task in dag.tasks:
        assert (task.owner, task.retry_delay) == (DEFAULT_ARGS["owner"], DEFAULT_ARGS["retry_delay"]), (
            f"{dag.dag_id}.{task.task_id} has owner {task.owner!r} and retry_delay {task.retry_delay}: "
            f"expected kubetrain.defaults.DEFAULT_ARGS' {DEFAULT_ARGS['owner']!r} and {DEFAULT_ARGS['retry_delay']}"
        )
        assert task.retries >= DEFAULT_ARGS["retries"], (
            f"{dag.dag_id}.{task.task_id} has {task.retries} retries, fewer than DEFAULT_ARGS' {DEFAULT_ARGS['retries']}"
        )
    # the training tasks' unschedulable grace is the deployment's (KUBETRAIN_UNSCHEDULABLE_GRACE_SECONDS)
    for task in dag.tasks:
        grace = getattr(task, "unschedulable_grace_seconds", DEFAULT_ARGS["unschedulable_grace_seconds"])
        assert grace == DEFAULT_ARGS["unschedulable_grace_seconds"], (
            f"{dag.dag_id}.{task.task_id} has unschedulable_grace_seconds={grace}: expected DEFAULT_ARGS' "
            f"{DEFAULT_ARGS['unschedulable_grace_seconds']}"
        )
    # topological_sort raises on a cycle
    assert len(dag.topological_sort()) == len(dag.tasks)


@pytest.mark.parametrize("path", DAG_FILES, ids=lambda p: p.name)
def test_every_param_declares_the_draft_07_dialect_and_is_a_valid_schema_of_it(dagbag, path):
    """kubetrain.params.with_dialect: jsonschema checks each schema against draft-07's meta-schema,
    not 2020-12's, each time Airflow resolves a Param (every serialization of the DAG)."""
    from jsonschema import Draft7Validator, FormatChecker, validators

    dag = dagbag.dags[path.stem]
    for owner in [dag, *dag.tasks]:
        for name in owner.params:
            schema = owner.params.get_param(name).schema
            where = f"{dag.dag_id}{'' if owner is dag else '.' + owner.task_id} Param {name!r}"
            assert schema.get("$schema") == SCHEMA_DIALECT, f"{where} declares no draft-07 $schema: {schema}"
            Draft7Validator.check_schema(schema)
            assert validators.validator_for(schema) is Draft7Validator
            value = owner.params.get_param(name).value
            errors = [
                e.message for e in Draft7Validator(schema, format_checker=FormatChecker()).iter_errors(value)
            ]
            assert errors == [], f"{where}'s default {value!r} is refused by its own schema: {errors}"


@pytest.mark.parametrize("path", DAG_FILES, ids=lambda p: p.name)
def test_params_are_typed_and_described(dagbag, path):
    dag = dagbag.dags[path.stem]
    for name in dag.params:
        schema = dag.params.get_param(name).schema
        assert "type" in schema or "enum" in schema, f"{dag.dag_id} Param {name!r} has no JSON-schema type"
        assert schema.get("description") or schema.get("title"), (
            f"{dag.dag_id} Param {name!r} has no description"
        )


@pytest.fixture(scope="module")
def heavy_imports() -> dict[str, list[str]]:
    """Per DAG file, the heavy modules that importing it added, all files in one fresh interpreter.

    One interpreter instead of one per file (about 6 s each, mostly Airflow's own import): the
    files are imported in turn and each is charged with what appeared during its import. A
    heavy module that an earlier file already pulled in is charged to that file only, which
    fails first; its fix then shows the next one.
    """
    code = (
        "import importlib.util, json, sys\n"
        f"heavy = {HEAVY_MODULES!r}\n"
        "def loaded(): return {m for m in sys.modules if m.split('.')[0] in heavy}\n"
        "out = {}\n"
        f"for path in {[str(p) for p in DAG_FILES]!r}:\n"
        "    before = loaded()\n"
        "    spec = importlib.util.spec_from_file_location('dagfile_' + str(len(out)), path)\n"
        "    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        "    out[path] = sorted(loaded() - before)\n"
        "print(json.dumps(out))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO / "plugins")},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("path", DAG_FILES, ids=lambda p: p.name)
def test_dag_file_imports_nothing_heavy(heavy_imports, path):
    """A DAG file parses without TensorFlow, boto3, matplotlib or the trainer package."""
    heavy = heavy_imports[str(path)]
    assert heavy == [], f"{path.name} imports {heavy} at parse time"
