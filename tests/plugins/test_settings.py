"""Every setting and environment switch is declared in kubetrain.settings and read there alone; README,
.env.example and compose agree with the declarations."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import airflow  # noqa: F401  (importing Airflow puts its plugins folder on sys.path)
import pytest
import yaml

from kubetrain import settings
from kubetrain.pipeline import common_params

REPO = Path(__file__).resolve().parents[2]
ENV_LINE = re.compile(r"^#?\s*(KUBETRAIN_[A-Z0-9_]+)=(.*)$")


def env_example() -> dict[str, str]:
    """``KUBETRAIN_*`` names of .env.example (commented out or not) and their values."""
    found = {}
    for line in (REPO / ".env.example").read_text().splitlines():
        if match := ENV_LINE.match(line.strip()):
            found[match.group(1)] = match.group(2).strip().strip('"')
    return found


def declared() -> set[str]:
    """Every ``KUBETRAIN_*`` variable the Airflow side may read: the settings' and the environment switches'."""
    return {s.env for s in settings.SETTINGS.values()} | set(settings.ENVIRONMENT)


def test_readme_table_is_generated_from_the_settings():
    readme = (REPO / "README.md").read_text()
    block = re.search(r"<!-- settings-table:[^>]*-->\n(.*?)\n<!-- /settings-table -->", readme, re.S)
    assert block, "README.md lacks the settings table markers"
    assert block.group(1).strip() == settings.markdown_table(), (
        "README's settings table is stale: replace it with the output of "
        "`python -c 'from kubetrain.settings import markdown_table; print(markdown_table())'`"
    )


def test_env_example_lists_every_setting_with_its_default():
    listed = env_example()
    for setting in settings.SETTINGS.values():
        assert setting.env in listed, f".env.example lacks {setting.env}"
        assert listed[setting.env] == setting.default, (
            f".env.example gives {setting.env}={listed[setting.env]!r}, the code's default is {setting.default!r}"
        )


# Run in a fresh interpreter: every DAG file parsed as the DAG processor does, every setting read as a
# task does, with an environment that records each KUBETRAIN_* name asked for and the module asking.
_RECORD_READS = """
import json, os, sys

class Recording(os._Environ):
    __slots__ = ()
    reads = {}

    def __getitem__(self, key):
        if isinstance(key, str) and key.startswith("KUBETRAIN_"):
            frame = sys._getframe(1)
            while frame.f_globals.get("__name__") in ("os", "_collections_abc", "collections.abc", __name__):
                frame = frame.f_back
            Recording.reads.setdefault(key, set()).add(frame.f_globals.get("__name__"))
        return super().__getitem__(key)

os.environ.__class__ = Recording
from airflow.dag_processing.dagbag import DagBag
from kubetrain import settings

bag = DagBag(dag_folder=sys.argv[1])
assert not bag.import_errors, bag.import_errors
for name in settings.SETTINGS:
    settings.get(name)
print(json.dumps({key: sorted(modules) for key, modules in Recording.reads.items()}))
"""


@pytest.fixture(scope="module")
def reads() -> dict[str, list[str]]:
    """``KUBETRAIN_*`` names the Airflow side read while parsing dags/ and reading every setting, and the modules that read each."""
    out = subprocess.run(
        [sys.executable, "-c", _RECORD_READS, str(REPO / "dags")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def names_compose_interpolates() -> set[str]:
    return set(re.findall(r"\$\{(KUBETRAIN_[A-Z0-9_]+)", (REPO / "docker-compose.yaml").read_text()))


def test_every_variable_the_airflow_side_reads_is_in_env_example(reads):
    read = declared() | set(reads) | names_compose_interpolates()
    assert {"KUBETRAIN_RETRY_DELAY_SECONDS", "KUBETRAIN_TRAINER_DIR", "KUBETRAIN_KERAS_EXAMPLE_CRON"} <= read
    missing = sorted(read - set(env_example()))
    assert missing == [], f".env.example lacks {', '.join(missing)}, which the code or compose reads"


def test_every_kubetrain_variable_of_env_example_is_read_by_the_code_and_documented():
    readme = (REPO / "README.md").read_text()
    read = declared() | names_compose_interpolates()
    for name in env_example():
        assert name in read, f".env.example documents {name}, which no code reads"
        assert name in readme, f".env.example documents {name}, which README does not mention"


def test_settings_are_read_in_one_place(reads):
    """Parsing the DAGs and reading the settings, the Airflow side reads only declared variables, and only
    through kubetrain.settings (``settings.get`` and ``settings.environ``)."""
    assert {"KUBETRAIN_RETRY_DELAY_SECONDS", "KUBETRAIN_WATCH_CRON", "KUBETRAIN_NAMESPACE"} <= set(reads)
    assert sorted(set(reads) - declared()) == [], (
        "undeclared variables read: declare them in kubetrain.settings"
    )
    elsewhere = {name: modules for name, modules in reads.items() if modules != ["kubetrain.settings"]}
    assert elsewhere == {}, "variables read outside kubetrain.settings"


def test_an_undeclared_environment_variable_is_refused(monkeypatch):
    monkeypatch.setenv("KUBETRAIN_WATCH_CRONS", "@daily")
    with pytest.raises(KeyError, match="undeclared kubetrain environment variable 'KUBETRAIN_WATCH_CRONS'"):
        settings.environ("KUBETRAIN_WATCH_CRONS")
    monkeypatch.setenv("KUBETRAIN_WATCH_CRON", "@daily")
    assert settings.environ("KUBETRAIN_WATCH_CRON", "*/10 * * * *") == "@daily"
    # a deployment's own DAG names its own variables (docs/extending.md): those are read as they are
    monkeypatch.setenv("TEAM_A_RETRAIN_CRON", "0 4 * * 1")
    assert settings.environ("TEAM_A_RETRAIN_CRON") == "0 4 * * 1"


def test_params_named_by_settings_exist():
    params = common_params(dataset_uri="s3://datasets/x/", model="x")
    for setting in settings.SETTINGS.values():
        if setting.param:
            assert setting.param in params, (
                f"setting {setting.name} names Param {setting.param!r}, which the DAGs lack"
            )
            assert params[setting.param].value is None or setting.param == "image", (
                f"Param {setting.param} must default to empty, so that the deployment's setting applies"
            )


def test_compose_agrees_on_the_namespace():
    compose = yaml.safe_load((REPO / "docker-compose.yaml").read_text())
    env = compose["x-airflow-common"]["environment"]
    default = settings.SETTINGS["namespace"].default
    assert env["KUBETRAIN_NAMESPACE"] == f"${{KUBETRAIN_NAMESPACE:-{default}}}"
    assert f'"namespace": "${{KUBETRAIN_NAMESPACE:-{default}}}"' in env["AIRFLOW_CONN_KUBERNETES_DEFAULT"]
    for name in env:
        if name.startswith("KUBETRAIN_"):
            assert name in declared(), name


@pytest.mark.parametrize("name", list(settings.SETTINGS))
def test_precedence_variable_then_environment_then_default(monkeypatch, name):
    setting = settings.SETTINGS[name]
    monkeypatch.delenv(setting.env, raising=False)
    monkeypatch.delenv(f"AIRFLOW_VAR_{setting.variable.upper()}", raising=False)
    assert settings.get(name) == setting.default
    monkeypatch.setenv(setting.env, "from-env")
    assert settings.get(name) == "from-env"
    monkeypatch.setenv(f"AIRFLOW_VAR_{setting.variable.upper()}", "from-variable")
    assert settings.get(name) == "from-variable"


def test_unknown_setting_is_named():
    with pytest.raises(KeyError, match="unknown kubetrain setting 'namespaces'"):
        settings.get("namespaces")


def test_seconds_from_the_environment_are_whole_and_not_negative(monkeypatch):
    from kubetrain.defaults import seconds_from_env

    monkeypatch.delenv("KUBETRAIN_UNSCHEDULABLE_GRACE_SECONDS", raising=False)
    assert seconds_from_env("KUBETRAIN_UNSCHEDULABLE_GRACE_SECONDS", 60) == 60
    monkeypatch.setenv("KUBETRAIN_UNSCHEDULABLE_GRACE_SECONDS", "0")
    assert seconds_from_env("KUBETRAIN_UNSCHEDULABLE_GRACE_SECONDS", 60) == 0
    for bad in ("-5", "1.5", "soon"):
        monkeypatch.setenv("KUBETRAIN_UNSCHEDULABLE_GRACE_SECONDS", bad)
        with pytest.raises(ValueError) as err:
            seconds_from_env("KUBETRAIN_UNSCHEDULABLE_GRACE_SECONDS", 60)
        assert str(err.value) == (
            f"KUBETRAIN_UNSCHEDULABLE_GRACE_SECONDS={bad!r}: expected a whole number of seconds >= 0"
        )


def test_the_unschedulable_grace_reaches_every_training_task_of_a_parsed_dag():
    """Set in the environment, the grace is every training task's, in a fresh interpreter that parses
    the DAGs as the scheduler does; the tasks that start no pod do not take it."""
    code = (
        "import json, airflow\n"
        "from airflow.dag_processing.dagbag import DagBag\n"
        f"bag = DagBag(dag_folder={str(REPO / 'dags')!r})\n"
        "assert not bag.import_errors, bag.import_errors\n"
        "print(json.dumps({d.dag_id + '.' + t.task_id: t.unschedulable_grace_seconds for d in bag.dags.values()"
        " for t in d.tasks if hasattr(t, 'unschedulable_grace_seconds')}))\n"
    )
    env = {**os.environ, "KUBETRAIN_UNSCHEDULABLE_GRACE_SECONDS": "7"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    graces = json.loads(out.stdout.strip().splitlines()[-1])
    assert "train_image_classifier.train" in graces and "train_image_classifier_distributed.train" in graces
    assert set(graces.values()) == {7}, graces
