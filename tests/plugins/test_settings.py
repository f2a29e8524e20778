"""Every documented setting is read, once, in kubetrain.settings; README, .env.example and compose agree with it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import airflow  # noqa: F401  (importing Airflow puts its plugins folder on sys.path)
import pytest
import yaml

from kubetrain import settings
from kubetrain.pipeline import common_params

REPO = Path(__file__).resolve().parents[2]
ENV_LINE = re.compile(r"^#?\s*(KUBETRAIN_[A-Z0-9_]+)=(.*)$")
CODE_DIRS = ("plugins", "dags", "include")


def env_example() -> dict[str, str]:
    """``KUBETRAIN_*`` names of .env.example (commented out or not) and their values."""
    found = {}
    for line in (REPO / ".env.example").read_text().splitlines():
        if match := ENV_LINE.match(line.strip()):
            found[match.group(1)] = match.group(2).strip().strip('"')
    return found


def names_read_by_code() -> set[str]:
    """String constants ``KUBETRAIN_*`` in the Airflow side's code (the names it reads from the environment)."""
    names = set()
    for folder in CODE_DIRS:
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    names.update(re.findall(r"\bKUBETRAIN_[A-Z0-9_]+\b", node.value))
    return names


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


def names_read_from_the_environment() -> set[str]:
    """``KUBETRAIN_*`` names that dags/ and plugins/ read from their environment.

    ``os.environ.get(NAME)``, ``os.getenv(NAME)``, ``os.environ[NAME]`` and the DAGs'
    ``schedule(asset, NAME, default)``: what a deployment may set.
    """
    names = set()
    for folder in ("dags", "plugins"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                args = []
                if isinstance(node, ast.Call):
                    callee = ast.unparse(node.func)
                    if callee in ("os.environ.get", "os.getenv", "environ.get", "getenv"):
                        args = node.args[:1]
                    elif callee == "schedule":
                        args = node.args[1:2]
                elif isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("os.environ", "environ"):
                    args = [node.slice]
                names.update(
                    a.value
                    for a in args
                    if isinstance(a, ast.Constant) and str(a.value).startswith("KUBETRAIN_")
                )
    return names


def names_compose_interpolates() -> set[str]:
    return set(re.findall(r"\$\{(KUBETRAIN_[A-Z0-9_]+)", (REPO / "docker-compose.yaml").read_text()))


def test_every_variable_the_airflow_side_reads_is_in_env_example():
    read = names_read_from_the_environment() | names_compose_interpolates()
    assert {"KUBETRAIN_RETRY_DELAY_SECONDS", "KUBETRAIN_TRAINER_DIR", "KUBETRAIN_KERAS_EXAMPLE_CRON"} <= read
    missing = sorted(read - set(env_example()))
    assert missing == [], f".env.example lacks {', '.join(missing)}, which the code or compose reads"


def test_every_kubetrain_variable_of_env_example_is_read_by_the_code_and_documented():
    readme = (REPO / "README.md").read_text()
    read = names_read_by_code() | {s.env for s in settings.SETTINGS.values()} | names_compose_interpolates()
    for name in env_example():
        assert name in read, f".env.example documents {name}, which no code reads"
        assert name in readme, f".env.example documents {name}, which README does not mention"


def test_settings_are_read_in_one_place():
    """No other module of the Airflow side reads a setting's environment variable itself."""
    offenders = []
    envs = {s.env for s in settings.SETTINGS.values()}
    for folder in ("plugins/kubetrain", "dags"):
        for path in (REPO / folder).rglob("*.py"):
            if path.name == "settings.py" or "imagebuild" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and node.value in envs:
                    offenders.append(f"{path.relative_to(REPO)}: {node.value}")
    assert offenders == []


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
            assert name in names_read_by_code() | {s.env for s in settings.SETTINGS.values()}, name


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
