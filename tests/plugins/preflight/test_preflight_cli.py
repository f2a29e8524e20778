"""The command line: its options reach the preflight, each line and the count are printed, a failure or a
setting that does not parse exits 1; ``python -m kubetrain.preflight`` and the ``kubetrain-preflight`` script
both reach it."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from kubetrain.preflight import Check, cli

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def ran(monkeypatch):
    """Stand in for the preflight: records the options, emits ``lines`` and returns them."""
    seen = {}
    lines = [Check("api", "PASS", "API answers"), Check("registry", "FAIL", "does not answer", "define it")]

    def run_preflight(emit, **kwargs):
        seen.update(kwargs)
        for check in lines:
            emit(check)
        return SimpleNamespace(results=lines, failed=[c for c in lines if c.status == "FAIL"])

    monkeypatch.setattr(cli, "run_preflight", run_preflight)
    monkeypatch.setattr(cli, "configured_api_url", lambda: "http://base-url:8080")
    return seen


def test_the_options_reach_the_preflight_and_each_line_is_printed(ran, capsys):
    code = cli.main(["--pool", "gpu-a100", "--pod-timeout", "90", "--airflow-api-url", "http://api:8080"])
    assert code == 1
    assert capsys.readouterr().out.splitlines() == [
        "PASS  api: API answers",
        "FAIL  registry: does not answer -> fix: define it",
        "1 passed or noted, 1 failed",
    ]
    assert ran == {
        "kubernetes_conn_id": "kubernetes_default",
        "registry_conn_id": "kubetrain_registry_default",
        "pool": "gpu-a100",
        "pod_timeout": 90.0,
        "airflow_api_conn_id": "airflow_api",
        "airflow_api_url": "http://api:8080",
        "airflow_api_default_url": "http://base-url:8080",
    }


def test_a_setting_that_does_not_parse_is_one_fail_line(monkeypatch, capsys):
    def run_preflight(emit, **kwargs):
        raise ValueError("namespace 'Team' is not a valid namespace name: expected a DNS-1123 label")

    monkeypatch.setattr(cli, "run_preflight", run_preflight)
    monkeypatch.setattr(cli, "configured_api_url", lambda: "")
    assert cli.main([]) == 1
    assert capsys.readouterr().out == (
        "FAIL  settings: namespace 'Team' is not a valid namespace name: expected a DNS-1123 label\n"
    )


def test_python_dash_m_runs_the_command_line():
    proc = subprocess.run(
        [sys.executable, "-m", "kubetrain.preflight", "--help"],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "plugins"), str(REPO)])},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m kubetrain.preflight [-h]")
    assert "Preflight: check that a cluster, its S3 store and registry are ready" in proc.stdout
    assert "--airflow-api-url" in proc.stdout


def test_the_console_script_is_the_command_line():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, name = scripts["kubetrain-preflight"].partition(":")
    assert getattr(importlib.import_module(module), name) is cli.main


def test_airflows_plugin_manager_importing_the_main_module_runs_nothing(capsys):
    """Airflow imports every file of the plugins folder as a top-level module named by its stem: this one as
    ``__main__``, without a package (airflow/_shared/plugins_manager); the command line must not run there."""
    path = REPO / "plugins" / "kubetrain" / "preflight" / "__main__.py"
    loader = importlib.machinery.SourceFileLoader("__main__", str(path))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("__main__", loader))
    loader.exec_module(module)  # no SystemExit: main() did not run
    assert module.__name__ == "__main__" and capsys.readouterr().out == ""
