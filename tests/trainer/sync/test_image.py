"""The sync image's contents: trainer/Dockerfile.sync against the lock, and the package on its own."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

from sync_support import REPO

from trainer.sync import md5many

DOCKERFILE = REPO / "trainer" / "Dockerfile.sync"


def test_dockerfile_pins_match_the_trainer_lock_and_runs_as_numeric_non_root():
    text = DOCKERFILE.read_text()
    lock = {
        name.lower(): version
        for name, version in re.findall(
            r"^([A-Za-z0-9_.-]+)==([^\s;]+)", (REPO / "trainer" / "requirements.lock").read_text(), re.M
        )
    }
    pins = re.findall(
        r"^([A-Za-z0-9_.-]+)==(\S+)", (REPO / "trainer" / "requirements-sync.txt").read_text(), re.M
    )
    assert {n.lower() for n, _ in pins} >= {"awscrt", "botocore", "s3transfer"}
    for name, version in pins:
        assert lock.get(name.lower()) == version, f"{name}=={version} differs from trainer/requirements.lock"
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text, re.M) and re.search(
        r"^FROM \$\{BASE_IMAGE\}$", text, re.M
    )
    # the build stage compiles the multi-buffer MD5 alone; the image copies its library, not its compiler
    build, final = text.split("\nFROM ${BASE_IMAGE}\n")
    assert re.findall(r"^COPY (.+)$", build, re.M) == ["sync/native/md5many.c /tmp/md5many.c"]
    assert "apt-get" not in final and "gcc" not in final
    assert re.findall(r"^COPY (.+)$", final, re.M) == [
        "requirements-sync.txt /tmp/requirements-sync.txt",
        "sync/ /app/trainer/sync/",
        f"--from=md5many /tmp/{md5many.LIBRARY.name} /app/trainer/sync/{md5many.LIBRARY.name}",
        "kubetrain_contract/ /app/kubetrain_contract/",
    ]
    # the checkout's own build of it stays out of the build context
    assert f"sync/{md5many.LIBRARY.name}" in (REPO / "trainer" / ".dockerignore").read_text().splitlines()
    user = re.findall(r"^USER (\S+)$", text, re.M)
    assert len(user) == 1 and re.fullmatch(r"[1-9]\d*:[1-9]\d*", user[0])


def _pins(path) -> dict[str, str]:
    return {
        name.lower(): version
        for name, version in re.findall(r"^([A-Za-z0-9_.-]+)==([^\s;]+)", path.read_text(), re.M)
    }


def test_sync_requirements_are_the_lock_s_and_closed(tmp_path):
    pins = _pins(REPO / "trainer" / "requirements-sync.txt")
    lock = _pins(REPO / "trainer" / "requirements.lock")
    assert {"awscrt", "botocore", "s3transfer"} <= set(pins)
    assert {n: v for n, v in pins.items() if lock.get(n) != v} == {}
    # every dependency of a pinned package is pinned too (the image installs them --no-deps)
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    for name in pins:
        for spec in requires(name) or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                assert req.name.lower() in pins, (
                    f"{name} needs {req.name}, missing from requirements-sync.txt"
                )
    # and the package's own docstring names them
    import trainer.sync

    assert all(
        p in trainer.sync.__doc__ for p in ("botocore", "awscrt", "s3transfer", "requirements-sync.txt")
    )


def test_package_runs_alone_without_tensorflow(tmp_path):
    # the image holds trainer/sync and the contract only: `trainer` is then a namespace package
    shutil.copytree(REPO / "trainer" / "sync", tmp_path / "trainer" / "sync")
    shutil.copytree(REPO / "trainer" / "kubetrain_contract", tmp_path / "kubetrain_contract")
    probe = (
        "import runpy, sys; sys.argv = ['trainer.sync', 'checkpoint-sync', '--help']\n"
        "try:\n    runpy.run_module('trainer.sync', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "import trainer.sync.stagein, trainer.sync.sidecar, trainer.sync.restore\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'numpy', 'keras', 'botocore'))\n"
        "print('HEAVY', heavy)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr
    assert "KUBETRAIN_SYNC_INTERVAL" in result.stdout
    assert "HEAVY []" in result.stdout
