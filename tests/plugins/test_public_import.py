"""kubetrain's public API imports first thing in a fresh interpreter, with kubetrain installed as a provider.

Installed (``pip install .``), kubetrain is an Airflow provider: Airflow calls its
``get_provider_info`` entry point while it starts, and it starts inside the first import of
anything that imports Airflow, such as ``from kubetrain import RegistryHook``. If
``get_provider_info`` imported the hook, that import would find the hook's module half
initialized (a circular import). The project is installed here as ``pip install .`` installs it:
built in place from a copy of the checkout, which leaves setuptools' metadata in the copy's
plugins/, as it would in a checkout; the Makefile's ``build-leftovers`` (part of ``make setup``)
removes it before Airflow runs from the checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv" / "bin" / "python"
UV = REPO / ".tools" / "bin" / "uv"

# Run in a fresh interpreter: where Airflow stands after an import, and what kubetrain's provider entry point gives.
WHAT_IS_LOADED = r"""
import importlib.metadata as md, json, sys
(entry,) = [e for e in md.entry_points(group="apache_airflow_provider") if e.value.startswith("kubetrain.")]
info = entry.load()()
print(json.dumps({
    "airflow": sorted(m for m in sys.modules if m == "airflow" or m.startswith("airflow.")),
    "hook_imported": "kubetrain.hooks.registry" in sys.modules,
    "connection_types": info["connection-types"],
}))
"""


def _copy_checkout(dest: Path) -> Path:
    """The files `pip install .` builds from, laid out as in the checkout (the contract at the root too)."""
    dest.mkdir(parents=True)
    shutil.copy(REPO / "pyproject.toml", dest)
    shutil.copy(REPO / "README.md", dest)
    shutil.copytree(REPO / "plugins", dest / "plugins", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copytree(
        REPO / "trainer" / "kubetrain_contract",
        dest / "trainer" / "kubetrain_contract",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )
    (dest / "kubetrain_contract").symlink_to("trainer/kubetrain_contract")
    shutil.copy(REPO / "Makefile", dest)
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """``(checkout, site)``: a copy of the checkout, and kubetrain as `pip install .` of it installs it."""
    root = tmp_path_factory.mktemp("public-import")
    checkout = _copy_checkout(root / "checkout")
    site = root / "site"
    proc = subprocess.run(
        [str(UV), "pip", "install", "--no-deps", "--no-build-isolation", "--python", str(PYTHON)]
        + ["--target", str(site), str(checkout)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "UV_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return checkout, site


def _fresh(code: str, path: str, home: Path, plugins: Path | None = None) -> subprocess.CompletedProcess:
    """``python -c code`` with the project's .venv in a new interpreter, ``path`` its PYTHONPATH.

    :param code: the program.
    :param path: where kubetrain is imported from.
    :param home: the AIRFLOW_HOME, created if need be.
    :param plugins: Airflow's plugins folder; default an empty one.
    """
    (home / "empty").mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "PYTHON", "KUBETRAIN"))}
    env |= {
        "PYTHONPATH": path,
        "PYTHONDONTWRITEBYTECODE": "1",
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(plugins or home / "empty"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(home / "empty"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    }
    return subprocess.run(
        [str(PYTHON), "-c", code], cwd=home, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    "statement",
    [
        "from kubetrain import RegistryHook",
        "from kubetrain.hooks.registry import RegistryHook",
        "from kubetrain import ReportLink",
        "from kubetrain import *",
    ],
)
def test_the_public_api_imports_before_airflow(installed, tmp_path, statement):
    _, site = installed
    code = (
        f"{statement}\n"
        "import kubetrain\n"
        f"assert kubetrain.__file__.startswith({str(site)!r}), kubetrain.__file__\n"
        "from kubetrain import RegistryHook\n"
        "print(RegistryHook.conn_type, RegistryHook.hook_name)"
    )
    out = _fresh(code, str(site), tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "kubetrain_registry Container registry (kubetrain)"


def test_the_provider_entry_point_imports_neither_airflow_nor_the_hook(installed, tmp_path):
    _, site = installed
    out = _fresh(WHAT_IS_LOADED, str(site), tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["airflow"] == [] and seen["hook_imported"] is False, seen
    # What Airflow shows of the connection type without importing the hook is what the hook declares.
    from kubetrain.hooks.registry import RegistryHook

    (conn,) = seen["connection_types"]
    assert conn["hook-class-name"] == f"{RegistryHook.__module__}.{RegistryHook.__qualname__}"
    assert (conn["connection-type"], conn["hook-name"]) == (RegistryHook.conn_type, RegistryHook.hook_name)
    behaviour = RegistryHook.get_ui_field_behaviour()
    assert conn["ui-field-behaviour"]["relabeling"] == behaviour["relabeling"]
    assert conn["ui-field-behaviour"]["hidden-fields"] == behaviour["hidden_fields"]


def test_the_checkout_after_pip_install_runs_airflow_with_the_plugin_once(installed, tmp_path):
    """After `pip install .`, the checkout (its plugins/ on the path, as Airflow puts it) still imports the
    hook first, and once ``make setup`` has removed the build's leftover, Airflow loads the plugin once."""
    checkout, _ = installed
    plugins = checkout / "plugins"
    assert list(plugins.glob("*.egg-info")), "an in-place build leaves its metadata in plugins/"
    probe = (
        "from kubetrain import RegistryHook\n"
        "import json\n"
        "from airflow import plugins_manager\n"
        "plugins = plugins_manager._get_plugins()[0]\n"
        "print(json.dumps({'plugins': [p.name for p in plugins], 'errors': plugins_manager.get_import_errors()}))"
    )
    before = _fresh(probe, f"{plugins}{os.pathsep}{checkout}", tmp_path / "before", plugins)
    assert before.returncode == 0, before.stderr[-3000:]

    make = subprocess.run(
        ["make", "--no-print-directory", "-s", "build-leftovers"],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert make.returncode == 0, make.stdout + make.stderr
    assert not list(plugins.glob("*.egg-info"))
    after = _fresh(probe, f"{plugins}{os.pathsep}{checkout}", tmp_path / "after", plugins)
    assert after.returncode == 0, after.stderr[-3000:]
    seen = json.loads(after.stdout.strip().splitlines()[-1])
    assert seen == {"plugins": ["kubetrain"], "errors": {}}, seen
