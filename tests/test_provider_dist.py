"""kubetrain builds as an Airflow provider distribution, Airflow sees it as one once installed, and the
wheel needs nothing it does not declare.

The wheel is built from a copy of the project (pyproject.toml, README.md, plugins/) with the
Airflow environment's setuptools and no network, the way `pip install .` builds it; it is then
installed into a scratch directory that Airflow's own tools get on their path instead of
plugins/: `airflow providers list`, the ProvidersManager, the connection form's metadata that
the API server serves, and the plugins manager.

It is also installed alone into a fresh virtual environment with only the dependencies it declares,
pinned as requirements.lock pins them (the constraints of a deployment, as Airflow's constraint
files are): every module of it imports there, every optional feature fails naming its extra until
the extra is installed, and then works. deptry checks that every import of the code (lazy ones in
functions included) is covered by a declared dependency.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
UV = REPO / ".tools" / "bin" / "uv"
AIRFLOW = REPO / ".venv" / "bin" / "airflow"

# Run in the scratch environment: what Airflow knows about kubetrain, as JSON.
INSPECT = r"""
import json
import kubetrain
from airflow.providers_manager import ProvidersManager
from airflow.api_fastapi.core_api.services.ui.connections import HookMetaService
from airflow import plugins_manager

pm = ProvidersManager()
provider = pm.providers["kubetrain"]
meta = {m.connection_type: m for m in HookMetaService.hook_meta_data()}["kubetrain_registry"]
plugins = plugins_manager._get_plugins()[0]
print(json.dumps({
    "module": kubetrain.__file__,
    "version": provider.version,
    "info": provider.data,
    "hook_name": meta.hook_name,
    "hook_class_name": meta.hook_class_name,
    "standard_fields": json.loads(meta.standard_fields.model_dump_json()) if meta.standard_fields else None,
    "extra_fields": meta.extra_fields,
    "extra_links": [name for name in pm.extra_links_class_names if name.startswith("kubetrain.")],
    "plugins": [(p.name, str(p.source)) for p in plugins],
    "plugin_errors": plugins_manager.get_import_errors(),
}, default=str))
"""


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """The files a distribution is built from, copied (so the build leaves nothing in the work tree)."""
    src = tmp_path_factory.mktemp("src")
    shutil.copy(REPO / "pyproject.toml", src)
    shutil.copy(REPO / "README.md", src)
    shutil.copytree(REPO / "plugins", src / "plugins", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    # the contract both sides import lives in the images' build context, trainer/ (pyproject.toml's package-dir)
    shutil.copytree(
        REPO / "trainer" / "kubetrain_contract",
        src / "trainer" / "kubetrain_contract",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )
    return src


def uv(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(UV), *args], capture_output=True, text=True, timeout=300, env={**os.environ, "UV_OFFLINE": "1"}
    )
    assert proc.returncode == 0, f"uv {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    uv("build", "--wheel", "--no-build-isolation", "--python", sys.executable, "-o", str(out), str(source))
    wheels = list(out.glob("kubetrain-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def installed(source, tmp_path_factory) -> Path:
    """`pip install .` of the project into a scratch directory (no dependencies: the Airflow environment has them)."""
    target = tmp_path_factory.mktemp("site")
    uv(
        "pip",
        "install",
        "--no-deps",
        "--no-build-isolation",
        "--python",
        sys.executable,
        "--target",
        str(target),
        str(source),
    )
    return target


def airflow_env(site: Path, home: Path) -> dict[str, str]:
    """Airflow with kubetrain from ``site`` only: no plugins folder, no DAGs, nothing from plugins/ on the path."""
    (home / "empty").mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "PYTHONPATH"))}
    return {
        **env,
        "PYTHONPATH": str(site),
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(home / "empty"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(home / "empty"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    }


def test_the_wheel_holds_the_airflow_side_and_its_entry_points(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
        metadata = Parser().parsestr(zf.read(f"{dist_info}/METADATA").decode())
    for module in (
        "kubetrain/__init__.py",
        "kubetrain/operators/training.py",
        "kubetrain/triggers/pod.py",
        "kubetrain/hooks/registry.py",
        "kubetrain/provider_info.py",
        "kubetrain_plugin.py",
    ):
        assert module in names, sorted(names)
    sources = {p.relative_to(REPO / "plugins").as_posix() for p in (REPO / "plugins").rglob("*.py")}
    sources |= {
        p.relative_to(REPO / "trainer").as_posix()
        for p in (REPO / "trainer" / "kubetrain_contract").rglob("*.py")
    }
    assert "kubetrain_contract/exit_codes.py" in sources
    assert {
        n for n in names if n.endswith(".py")
    } == sources  # every module, the contract's too, and nothing else
    assert not [n for n in names if n.startswith(("dags/", "trainer/", "tests/", "include/"))]
    # the files the code reads at run time: the Training page's templates and assets, the schemas
    data = {
        p.relative_to(REPO / "plugins").as_posix()
        for p in (REPO / "plugins").rglob("*")
        if p.is_file() and p.suffix in (".html", ".md", ".css", ".js", ".json")
    }
    data |= {
        p.relative_to(REPO / "trainer").as_posix()
        for p in (REPO / "trainer" / "kubetrain_contract" / "schemas").glob("*.json")
    }
    assert (
        "kubetrain/ui/templates/runs.html" in data and "kubetrain_contract/schemas/early-stop.v1.json" in data
    )
    assert data <= names, sorted(data - names)
    assert (
        "[apache_airflow_provider]\nprovider_info = kubetrain.provider_info:get_provider_info" in entry_points
    )
    assert "[airflow.plugins]\nkubetrain = kubetrain_plugin:KubetrainPlugin" in entry_points
    # the preflight as docs/real-cluster.md names it where the wheel is installed
    assert "[console_scripts]\nkubetrain-preflight = kubetrain.preflight.cli:main" in entry_points
    assert metadata["Name"] == "kubetrain" and metadata["Version"] == "0.1.0"
    requires = metadata.get_all("Requires-Dist")
    assert any(
        r.startswith("apache-airflow<3.4,>=3.3.2") or r.startswith("apache-airflow>=3.3.2") for r in requires
    ), requires
    assert any(r.startswith("apache-airflow-providers-cncf-kubernetes") for r in requires), requires


def test_airflow_sees_the_installed_provider(installed, tmp_path):
    env = airflow_env(installed, tmp_path / "home")
    listed = subprocess.run(
        [str(AIRFLOW), "providers", "list", "-o", "json"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert listed.returncode == 0, listed.stderr[-3000:]
    providers = {p["package_name"]: p for p in json.loads(listed.stdout[listed.stdout.index("[") :])}
    assert providers["kubetrain"]["version"] == "0.1.0"

    out = subprocess.run(
        [sys.executable, "-c", INSPECT], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["module"].startswith(str(installed)), seen["module"]  # the installed copy, not plugins/
    info = seen["info"]
    assert (info["package-name"], info["name"], info["versions"]) == ("kubetrain", "kubetrain", ["0.1.0"])
    assert info["description"]
    # The registry connection type: in the connection form like any provider's, with its fields.
    assert [c["connection-type"] for c in info["connection-types"]] == ["kubetrain_registry"]
    assert seen["hook_class_name"] == "kubetrain.hooks.registry.RegistryHook"
    assert seen["hook_name"] == "Container registry (kubetrain)"
    assert set(seen["extra_fields"]) == {"insecure", "tls_verify", "ca_bundle", "token", "timeout"}
    assert seen["extra_fields"]["token"]["schema"]["format"] == "password"
    standard = seen["standard_fields"]
    assert standard["host"]["title"] == "Registry host" and standard["login"]["title"] == "Username"
    assert standard["url_schema"]["hidden"] is True and standard["port"]["placeholder"] == "443"
    # The report link and the plugin (the reports route on the API server).
    assert seen["extra_links"] == ["kubetrain.links.ReportLink"]
    assert info["plugins"] == [{"name": "kubetrain", "plugin-class": "kubetrain_plugin.KubetrainPlugin"}]
    assert [name for name, _ in seen["plugins"]] == ["kubetrain"]
    assert "airflow.plugins" in seen["plugins"][0][1]  # loaded through the entry point
    assert seen["plugin_errors"] == {}


def test_provider_info_names_what_exists_and_the_hook_reads():
    from kubetrain.hooks.registry import RegistryHook
    from kubetrain.provider_info import REGISTRY_CONN_FIELDS, get_provider_info

    info = get_provider_info()
    # Every class and module the provider names imports.
    from importlib import import_module

    for entry in (*info["extra-links"], *(c["hook-class-name"] for c in info["connection-types"])):
        module, _, name = entry.rpartition(".")
        assert getattr(import_module(module), name)
    for group in ("operators", "hooks", "triggers"):
        for item in info[group]:
            for module in item["python-modules"]:
                import_module(module)
    # The connection form's extras are the ones the hook reads.
    assert set(REGISTRY_CONN_FIELDS) == set(RegistryHook()._explicit)


# Run in the fresh environment: import every module of the distribution, then the declared distributions'
# own modules; print what failed, as JSON.
IMPORT_ALL = r"""
import importlib, importlib.metadata as md, json, pkgutil, re, sys
import kubetrain
failed = {}
names = ["kubetrain_plugin"] + [m.name for m in pkgutil.walk_packages(kubetrain.__path__, "kubetrain.")]
for name in names:
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed[name] = repr(exc)
owners = md.packages_distributions()
extras = set(sys.argv[1:])
declared = []
for req in md.requires("kubetrain") or []:
    marker = re.search(r'extra == "([^"]+)"', req)
    if marker and marker.group(1) not in extras:
        continue
    dist = re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower().replace("_", "-")
    if dist != "kubetrain":
        declared.append(dist)
for module, dists in owners.items():
    if any(d.lower().replace("_", "-") in declared for d in dists) and module.isidentifier() and not module.startswith("_"):
        try:
            importlib.import_module(module)
        except Exception as exc:
            failed[module] = repr(exc)
print(json.dumps({"modules": len(names), "declared": sorted(declared), "failed": failed}))
"""

# Run in the fresh environment: the optional features, each called for real.
OPTIONAL = r"""
import json
from kubernetes.client import models as k8s
from kubetrain import pod_spec
from kubetrain.distributed.builders import trainjob
from kubetrain.distributed.spec import DistributedSpec
from kubetrain.sweep.space import parse_space
from kubetrain.sweep.tpe import tpe_points

out = {}
try:
    space = parse_space({"lr": {"low": 0.001, "high": 0.1, "log": True}})
    out["tpe"] = tpe_points(space, [], count=2, seed=1, mode="max", startup_trials=1)
except ModuleNotFoundError as exc:
    out["tpe"] = str(exc)
try:
    config = pod_spec.TrainingPodConfig(image="r.example/kubetrain/trainer@sha256:" + "a" * 64,
                                        sync_image="r.example/kubetrain/sync@sha256:" + "b" * 64,
                                        run_uri="s3://training/runs/d/r", dataset_manifest="s3://training/manifests/d/1.json")
    submission = trainjob(config, DistributedSpec(workers=2), name="j", namespace="ns", labels={})
    out["trainjob"] = [r.kind for r in submission.resources]
except ModuleNotFoundError as exc:
    out["trainjob"] = str(exc)
print(json.dumps(out, default=str))
"""


@pytest.fixture(scope="module")
def fresh(wheel, tmp_path_factory) -> Path:
    """A new virtual environment holding the wheel and the dependencies it declares, nothing else."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    uv("venv", "--quiet", "--python", sys.executable, str(venv))
    uv(
        "pip",
        "install",
        "--quiet",
        "--python",
        str(venv / "bin" / "python"),
        "--constraint",
        str(REPO / "requirements.lock"),
        str(wheel),
    )
    return venv


def run_in(venv: Path, script: str, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "PYTHON", "VIRTUAL_ENV"))}
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", script, *args],
        env=env,
        cwd=venv,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_wheel_alone_imports_and_its_extras_are_named_until_installed(fresh, wheel):
    listed = uv("pip", "list", "--python", str(fresh / "bin" / "python"), "--format", "json").stdout
    present = {p["name"].lower() for p in json.loads(listed)}
    # the environment holds what kubetrain declares, not the test tools or optional parts of the lock
    assert "apache-airflow-providers-cncf-kubernetes" in present and "kubetrain" in present
    assert not present & {
        "pytest",
        "moto",
        "deptry",
        "playwright",
        "kubernetes-validate",
        "optuna",
        "kubeflow-trainer-api",
    }
    seen = run_in(fresh, IMPORT_ALL)
    assert seen["failed"] == {} and seen["modules"] > 60, seen
    optional = run_in(fresh, OPTIONAL)
    assert "pip install 'kubetrain[tpe]'" in optional["tpe"], optional
    assert "pip install 'kubetrain[trainjob]'" in optional["trainjob"], optional

    uv(
        "pip",
        "install",
        "--quiet",
        "--python",
        str(fresh / "bin" / "python"),
        "--constraint",
        str(REPO / "requirements.lock"),
        f"{wheel}[all]",
    )
    seen = run_in(fresh, IMPORT_ALL, "tpe", "trainjob", "all")
    assert seen["failed"] == {} and {"optuna", "kubeflow-trainer-api"} <= set(seen["declared"]), seen
    optional = run_in(fresh, OPTIONAL)
    assert len(optional["tpe"]) == 2 and all(0.001 <= p["lr"] <= 0.1 for p in optional["tpe"]), optional
    assert optional["trainjob"] == ["TrainingRuntime", "TrainJob"], optional


def test_pyproject_declares_every_distribution_the_code_imports():
    """deptry: an import (at module level or inside a function) that no dependency or extra covers fails here."""
    out = subprocess.run(
        [str(REPO / ".venv" / "bin" / "deptry"), "plugins"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_COLOR": "1"},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
