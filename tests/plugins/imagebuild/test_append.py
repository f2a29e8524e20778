"""AppendLayerOperator against a real registry, checked with skopeo and the registry's own log."""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil

import pytest

from kubetrain.imagebuild.layer import write_layer
from kubetrain.imagebuild.oci import DOCKER_CONFIG, DOCKER_LAYER_GZIP, DOCKER_MANIFEST, canonical_json
from kubetrain.imagebuild.registry_errors import RegistryError
from kubetrain.operators.build import AppendLayerOperator
from tests.plugins.imagebuild.support import (
    push_busybox_base,
    skopeo_pull,
    skopeo_raw_manifest,
    start_registry,
    tags,
)

UPLOADS = ("POST", "PUT", "PATCH")


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    reg = start_registry(tmp_path_factory.mktemp("registry"))
    with reg.client() as client:
        push_busybox_base(client, "kubetrain/trainer", "base", tmp_path_factory.mktemp("base"))
        push_busybox_base(client, "shared/busybox", "1", tmp_path_factory.mktemp("shared"))
    yield reg
    reg.stop()


@pytest.fixture
def conn(registry, monkeypatch):
    for key, value in registry.conn_env("registry_test").items():
        monkeypatch.setenv(key, value)
    return "registry_test"


def make_code(root, version: str = "1"):
    """A small trainer package, plus what must stay out of the layer."""
    (root / "models").mkdir(parents=True)
    (root / "__init__.py").write_text('"""trainer"""\n')
    (root / "train.py").write_text(f"VERSION = {version!r}\n")
    (root / "models" / "cnn.py").write_text("LAYERS = 3\n")
    (root / "run.sh").write_text("#!/bin/sh\necho run\n")
    (root / "run.sh").chmod(0o755)
    for junk in (
        ".venv/lib/site.py",
        "__pycache__/train.cpython-311.pyc",
        "tests/test_train.py",
        "models/x.pyc",
    ):
        (root / junk).parent.mkdir(parents=True, exist_ok=True)
        (root / junk).write_text("junk")
    return root


def append(conn, source, **kwargs):
    kwargs.setdefault("base_image", "kubetrain/trainer:base")
    kwargs.setdefault("repository", "kubetrain/trainer")
    op = AppendLayerOperator(task_id="append", source=str(source), registry_conn_id=conn, **kwargs)
    return op.execute({})


def test_append_pushes_one_layer_and_config(registry, conn, tmp_path):
    code = make_code(tmp_path / "trainer")
    mark = registry.mark()
    out = append(
        conn,
        code,
        env={"PYTHONPATH": "/app"},
        workdir="/app",
        cmd=["python", "-m", "trainer.train"],
        labels={"org.opencontainers.image.revision": "abc123"},
    )
    pushed = registry.requests(mark)
    assert out["pushed"] is True
    assert out["reference"] == f"{registry.host}/kubetrain/trainer@{out['digest']}"
    assert out["tag"].startswith("code-") and out["tag"] in tags(registry, "kubetrain/trainer")

    pulled = skopeo_pull(f"{registry.host}/kubetrain/trainer:{out['tag']}", tmp_path / "oci")
    assert len(pulled.layers) == 2
    code_layer = pulled.layers[-1]
    assert sorted(code_layer) == [
        "app",
        "app/trainer",
        "app/trainer/.wh..wh..opq",
        "app/trainer/__init__.py",
        "app/trainer/models",
        "app/trainer/models/cnn.py",
        "app/trainer/run.sh",
        "app/trainer/train.py",
    ]
    info, data = code_layer["app/trainer/train.py"]
    assert data == b"VERSION = '1'\n" and (info.uid, info.gid, info.mtime, info.mode) == (0, 0, 0, 0o644)
    assert code_layer["app/trainer/run.sh"][0].mode == 0o755
    fs = pulled.filesystem()
    assert fs["bin/busybox"] == open("/bin/busybox", "rb").read()  # the base is still there
    assert pulled.env == {"PATH": "/bin", "BASE_ONLY": "1", "PYTHONPATH": "/app"}
    assert pulled.config["config"]["Cmd"] == ["python", "-m", "trainer.train"]
    assert pulled.config["config"]["WorkingDir"] == "/app"
    assert pulled.labels["base.label"] == "busybox"
    assert pulled.labels["org.opencontainers.image.revision"] == "abc123"
    assert pulled.labels["org.opencontainers.image.base.digest"] == out["base_digest"]
    assert pulled.labels["io.kubetrain.code.sha256"] == out["code_hash"]
    assert len(pulled.config["history"]) == 2 and "append-layer" in pulled.config["history"][-1]["created_by"]
    raw_layer = (
        tmp_path / "oci" / "blobs" / "sha256" / pulled.manifest["layers"][-1]["digest"][7:]
    ).read_bytes()
    assert (
        pulled.config["rootfs"]["diff_ids"][-1]
        == "sha256:" + hashlib.sha256(gzip.decompress(raw_layer)).hexdigest()
    )

    # Only the code layer and the config went up, and no base layer came down.
    assert len([r for r in pushed if r.method == "PUT" and "/blobs/uploads/" in r.path]) == 2
    with registry.client() as client:
        base_config = client.get_manifest("kubetrain/trainer", out["base_digest"]).data["config"]["digest"]
    assert [r.path.rsplit("/", 1)[-1] for r in pushed if r.method == "GET" and "/blobs/" in r.path] == [
        base_config
    ]


def test_same_code_pushes_nothing_and_gives_the_same_digest(registry, conn, tmp_path):
    first = append(conn, make_code(tmp_path / "a", version="same"))
    # The same code elsewhere, with other mtimes and permissions on directories: same bytes in the image.
    copy = make_code(tmp_path / "b", version="same")
    os.utime(copy / "train.py", (1, 1))
    (copy / "models").chmod(0o700)
    mark = registry.mark()
    second = append(conn, copy)
    assert second["pushed"] is False
    assert second["digest"] == first["digest"] and second["tag"] == first["tag"]
    assert [r for r in registry.requests(mark) if r.method in UPLOADS] == []
    assert second["stats"]["bytes_sent"] == 0


def test_new_code_replaces_old_code(registry, conn, tmp_path):
    old = make_code(tmp_path / "old", version="old")
    (old / "legacy.py").write_text("gone\n")
    first = append(conn, old, tag="with-legacy")
    new = make_code(tmp_path / "new", version="new")
    second = append(conn, new, base_image=f"kubetrain/trainer@{first['digest']}", tag="without-legacy")
    fs = skopeo_pull(f"{registry.host}/kubetrain/trainer:without-legacy", tmp_path / "oci").filesystem()
    assert "app/trainer/legacy.py" not in fs
    assert fs["app/trainer/train.py"] == b"VERSION = 'new'\n"
    assert second["base_digest"] == first["digest"]


def test_base_in_another_repository_is_mounted_not_uploaded(registry, conn, tmp_path):
    mark = registry.mark()
    out = append(conn, make_code(tmp_path / "c"), base_image="shared/busybox:1", repository="team/trainer")
    reqs = registry.requests(mark)
    mounts = [r for r in reqs if r.method == "POST" and "mount=" in r.path]
    assert mounts and all(r.status == 201 for r in mounts)
    assert len([r for r in reqs if r.method == "PUT" and "/blobs/uploads/" in r.path]) == 2  # layer + config
    assert out["tag"] in tags(registry, "team/trainer")


def test_docker_schema2_base_stays_docker(registry, conn, tmp_path):
    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    (rootfs / "etc" / "os-release").write_text("ID=test\n")
    layer = write_layer(rootfs, tmp_path / "l.tgz", excludes=())
    with registry.client() as client:
        client.ensure_blob("docker/base", layer.blob(DOCKER_LAYER_GZIP))
        config = canonical_json(
            {
                "architecture": "amd64",
                "os": "linux",
                "config": {"Env": ["A=1"]},
                "rootfs": {"type": "layers", "diff_ids": [layer.diff_id]},
            }
        )
        from kubetrain.imagebuild.oci import Blob

        cblob = Blob.from_bytes(config, DOCKER_CONFIG)
        client.ensure_blob("docker/base", cblob)
        manifest = canonical_json(
            {
                "schemaVersion": 2,
                "mediaType": DOCKER_MANIFEST,
                "config": cblob.descriptor(),
                "layers": [layer.blob(DOCKER_LAYER_GZIP).descriptor()],
            }
        )
        client.put_manifest("docker/base", "v1", manifest, DOCKER_MANIFEST)
    out = append(conn, make_code(tmp_path / "d"), base_image="docker/base:v1", repository="docker/base")
    raw = skopeo_raw_manifest(f"{registry.host}/docker/base@{out['digest']}")
    assert raw["mediaType"] == DOCKER_MANIFEST and raw["config"]["mediaType"] == DOCKER_CONFIG
    assert [entry["mediaType"] for entry in raw["layers"]] == [DOCKER_LAYER_GZIP] * 2
    pulled = skopeo_pull(f"{registry.host}/docker/base@{out['digest']}", tmp_path / "oci")
    assert pulled.env["A"] == "1"
    assert pulled.filesystem()["app/trainer/train.py"] == b"VERSION = '1'\n"


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"base_image": "kubetrain/trainer:missing"}, RegistryError, r"kubetrain/trainer:missing: not found"),
        ({"base_image": "nowhere/else:1"}, RegistryError, r"image .*/nowhere/else:1: not found in registry"),
        (
            {"base_image": "other.example.com/kubetrain/trainer:base"},
            RegistryError,
            "is on registry other.example.com, but the image goes to",
        ),
        ({"tag": "bad tag!"}, ValueError, "invalid image tag 'bad tag!'"),
        ({"repository": "Bad/Repo"}, ValueError, "invalid repository name 'Bad/Repo'"),
        (
            {"platform": "linux/arm64"},
            RegistryError,
            r"is built for linux/amd64, not for the platform linux/arm64",
        ),
        ({"dest": "relative/dir"}, ValueError, "invalid destination 'relative/dir'"),
        ({"cmd": "python -m trainer"}, ValueError, "invalid cmd 'python -m trainer': expected a list"),
    ],
)
def test_bad_input_is_refused_and_nothing_is_tagged(registry, conn, tmp_path, kwargs, error, message):
    code = make_code(tmp_path / "e")
    kwargs.setdefault("tag", "must-not-exist")
    repository = kwargs.get("repository", "kubetrain/trainer")
    mark = registry.mark()
    with pytest.raises(error, match=message):
        append(conn, code, **kwargs)
    assert "must-not-exist" not in tags(registry, "kubetrain/trainer")
    assert [r for r in registry.requests(mark) if r.method in UPLOADS] == []
    if repository != "kubetrain/trainer":
        assert tags(registry, "kubetrain/trainer")  # untouched


def test_missing_source_directory(registry, conn, tmp_path):
    with pytest.raises(ValueError, match="code directory '.*/absent' does not exist"):
        append(conn, tmp_path / "absent")


def test_bad_credentials_push_nothing(tmp_path, monkeypatch):
    reg = start_registry(tmp_path / "auth", users={"ci": "right-password"})
    try:
        with reg.client("ci", "right-password") as client:
            push_busybox_base(client, "kubetrain/trainer", "base", tmp_path / "base")
        for key, value in reg.conn_env("auth_test", "ci", "wrong-password").items():
            monkeypatch.setenv(key, value)
        with pytest.raises(RegistryError, match=r"refused the credentials of user 'ci'"):
            append("auth_test", make_code(tmp_path / "code"), tag="must-not-exist")
        assert tags(reg, "kubetrain/trainer") == ["base"]
        for key, value in reg.conn_env("auth_test", "ci", "right-password").items():
            monkeypatch.setenv(key, value)
        out = append("auth_test", make_code(tmp_path / "code2"), tag="ok")
        assert sorted(tags(reg, "kubetrain/trainer")) == ["base", "ok"] and out["pushed"]
    finally:
        reg.stop()
        shutil.rmtree(tmp_path / "auth", ignore_errors=True)


def test_multi_platform_base_picks_the_platform(registry, conn, tmp_path):
    from kubetrain.imagebuild.oci import OCI_INDEX

    with registry.client() as client:
        single = client.get_manifest("kubetrain/trainer", "base")
        entry = {"mediaType": single.media_type, "digest": single.digest, "size": len(single.raw)}
        index = {
            "schemaVersion": 2,
            "mediaType": OCI_INDEX,
            "manifests": [
                {**entry, "platform": {"os": "linux", "architecture": "amd64"}},
                {**entry, "platform": {"os": "linux", "architecture": "arm64", "variant": "v8"}},
            ],
        }
        client.put_manifest("kubetrain/trainer", "multi", canonical_json(index), OCI_INDEX)
    out = append(conn, make_code(tmp_path / "m"), base_image="kubetrain/trainer:multi")
    assert out["base_digest"] == single.digest
    assert skopeo_raw_manifest(f"{registry.host}/kubetrain/trainer@{out['digest']}")["mediaType"].endswith(
        "manifest.v1+json"
    )
    with pytest.raises(
        RegistryError, match=r"without 'windows/amd64'; platforms available: linux/amd64, linux/arm64/v8"
    ):
        append(
            conn,
            make_code(tmp_path / "w"),
            base_image="kubetrain/trainer:multi",
            platform="windows/amd64",
            tag="must-not-exist",
        )
    assert "must-not-exist" not in tags(registry, "kubetrain/trainer")
