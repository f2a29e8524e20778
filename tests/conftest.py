"""Fixtures shared by both test environments (standard library only).

tests/trainer runs under trainer/.venv, everything else under .venv; this file must
import in both, so it starts servers as subprocesses instead of importing them.

* ``s3_server``: a fresh S3 server (the dev stack's, include/devstack/s3.py) on a free
  loopback port over a temporary directory, with the ``datasets`` and ``training`` buckets
  and a generated key pair that it verifies on every request, for the whole session.
* ``devstack``: the whole dev stack (S3, registry, Kubernetes API). When the environment
  already names a running stack (``KUBETRAIN_STACK_DIR``, as ``make test`` sets it), that
  stack is reused; otherwise one is started under a temporary directory and stopped at
  the end of the session.
* ``moto_server``: moto's S3 server (no buckets, any credentials), for the S3 features the dev
  stack's server lacks (include/devstack/S3.md): folder-marker keys, ``<md5>-<parts>``
  multipart ETags, ``If-Match``, stored checksums.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `include` and `trainer` import from the repository root

from include.devstack.stack import BUCKETS, Stack, free_port, wait_http  # noqa: E402


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    access_key_id: str
    secret_access_key: str
    region: str = "us-east-1"

    def env(self) -> dict[str, str]:
        """Standard AWS variables that boto3 and the AWS CLI read."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
            "AWS_DEFAULT_REGION": self.region,
        }


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> S3Server:
    port = free_port()
    root = tmp_path_factory.mktemp("s3")
    log = root / "s3.log"
    server = S3Server(f"http://127.0.0.1:{port}", "kt" + secrets.token_hex(8), secrets.token_hex(20))
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "include.devstack.s3",
                "--port",
                str(port),
                "--data-dir",
                str(root / "data"),
                "--buckets",
                *BUCKETS,
            ],
            cwd=REPO,
            env={
                **os.environ,
                "KUBETRAIN_S3_ACCESS_KEY_ID": server.access_key_id,
                "KUBETRAIN_S3_SECRET_ACCESS_KEY": server.secret_access_key,
            },
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_http(f"{server.endpoint}/", 60, proc, log)  # the buckets exist before it answers
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="session")
def devstack(tmp_path_factory) -> Stack:
    """A running dev stack; ``devstack.env()`` gives the variables of its ``env`` file."""
    existing = os.environ.get("KUBETRAIN_STACK_DIR")
    if existing and (Path(existing) / "state.json").exists():
        yield Stack(Path(existing))
        return
    # strict, and images of its registry must be in it: the local kubelet refuses what a real one refuses
    stack = Stack(tmp_path_factory.mktemp("stack"))
    stack.up()
    try:
        yield stack
    finally:
        stack.down()


# -- kubetrain's images in the dev stack's registry ------------------------------------------

IMAGE_ROOTFS = REPO / ".tools" / "images" / "bookworm-python.tar"  # `make images-base`


@pytest.fixture(scope="session")
def stack_images(devstack):
    """The CPU trainer and sync images, built from trainer/Dockerfile and trainer/Dockerfile.sync on
    the Debian-made base, checked, and pushed to the dev stack's registry (Airflow side only).

    A dict ``{"trainer": PublishedImage, "sync": PublishedImage}``: ``.reference`` is
    ``registry/repository@sha256:...``, ``.digest``, ``.tags``, ``.local`` the image in the build
    store. Layers and OCI layouts are cached under .tools/, so only the first session of a
    machine pays for the build; later ones push the cached layouts.
    """
    import logging

    from kubetrain.imagebuild.buildah import BuildahBuilder
    from kubetrain.imagebuild.builders import PushTarget
    from kubetrain.imagebuild.products import SYNC, TRAINER_CPU, ImagePublisher

    if not IMAGE_ROOTFS.exists():
        pytest.fail(f"{IMAGE_ROOTFS} is missing: run `make images-base` (make test does)")
    log = logging.getLogger("kubetrain.images")
    registry = devstack.load_state()["registry"]
    builder = BuildahBuilder(REPO / ".tools" / "buildah", storage_driver="auto", log=log.info)
    publisher = ImagePublisher(builder, REPO / "trainer", REPO / ".tools" / "images" / "oci", log=log.info)
    trainer, sync = publisher.publish(
        [TRAINER_CPU, SYNC],
        lambda item: PushTarget(registry, item.repository, insecure=True),
        base="debian",
        rootfs=IMAGE_ROOTFS,
    )
    return {"trainer": trainer, "sync": sync}


@dataclass(frozen=True)
class MotoServer:
    endpoint: str
    access_key_id: str
    secret_access_key: str
    region: str = "us-east-1"

    def env(self) -> dict[str, str]:
        """Standard AWS variables that boto3 and the transfer tool read."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
            "AWS_DEFAULT_REGION": self.region,
        }


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory) -> MotoServer:
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    server = MotoServer(f"http://127.0.0.1:{port}", "kt" + secrets.token_hex(8), secrets.token_hex(20))
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(REPO / ".venv" / "bin" / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_http(f"{server.endpoint}/moto-api/", 60, proc, log)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
