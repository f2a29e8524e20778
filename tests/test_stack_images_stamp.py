"""`make stack-images` builds and pushes the dev stack's images again only when their inputs changed or the
registry lost them (include/stack_images.py), against a real registry (Debian's docker-registry)."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import tarfile

import pytest

from include import stack_images


def push(port: int, repository: str, tag: str, text: bytes) -> str:
    """A one-file image under ``repository:tag``; its manifest digest."""
    from kubetrain.imagebuild.oci import OCI_LAYER_GZIP, Blob, RegistryClient, push_image

    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        info = tarfile.TarInfo("hello.txt")
        info.size = len(text)
        tar.addfile(info, io.BytesIO(text))
    layer = Blob.from_bytes(
        gzip.compress(raw.getvalue()), OCI_LAYER_GZIP, "sha256:" + hashlib.sha256(raw.getvalue()).hexdigest()
    )
    with RegistryClient(f"127.0.0.1:{port}", insecure=True, timeout=30) as client:
        return push_image(client, repository, tag, [layer], {"architecture": "amd64", "os": "linux"})


@pytest.fixture
def registry(tmp_path, monkeypatch):
    from tests.plugins.imagebuild.support import start_registry

    reg = start_registry(tmp_path / "registry")
    monkeypatch.setenv("KUBETRAIN_REGISTRY", f"127.0.0.1:{reg.port}")
    monkeypatch.setenv("KUBETRAIN_STACK_DIR", str(tmp_path))
    yield reg
    reg.stop()


def test_images_of_unchanged_inputs_are_not_built_again(registry, tmp_path, capsys):
    from kubetrain.imagebuild.products import product

    rootfs = tmp_path / "bookworm-python.tar"
    rootfs.write_bytes(b"base")
    args = ["--images", "trainer-cpu,sync", "--tag", "latest", "--base", "debian", "--rootfs", str(rootfs)]
    args += ["--revision", "5f1c0ad9"]
    assert stack_images.main(["current", *args]) == 1  # never built
    assert stack_images.main(["record", *args]) == 1  # nothing pushed: nothing to remember
    assert "lacks kubetrain/" in capsys.readouterr().err
    tags = [(product(n).repository, t) for n in ("trainer-cpu", "sync") for t in product(n).tags("latest")]
    for repository, tag in tags:
        push(registry.port, repository, tag, repository.encode())
    assert stack_images.main(["record", *args]) == 0
    assert stack_images.main(["current", *args]) == 0
    assert "not built or pushed again" in capsys.readouterr().out

    # another revision, another base: built again
    assert stack_images.main(["current", *args[:-1], "0a1b2c3d"]) == 1
    os.utime(rootfs, ns=(rootfs.stat().st_atime_ns, rootfs.stat().st_mtime_ns + 10**9))
    assert stack_images.main(["current", *args]) == 1
    assert stack_images.main(["record", *args]) == 0
    assert stack_images.main(["current", *args]) == 0
    # the registry serves another image under one of the tags (a push from elsewhere): built again
    push(registry.port, *tags[-1], b"another")
    assert stack_images.main(["current", *args]) == 1
