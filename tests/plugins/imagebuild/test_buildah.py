"""BuildImageOperator with the buildah builder: real builds, pushed to a real registry, read back by skopeo."""

from __future__ import annotations

import pytest

from include.devstack.stack import free_port
from kubetrain.imagebuild.builders import BuildError
from kubetrain.imagebuild.registry_errors import RegistryAuthError, RegistryUnreachable
from kubetrain.operators.build import BuildImageOperator
from tests.plugins.imagebuild.support import push_busybox_base, skopeo_pull, start_registry, tags

DOCKERFILE = """\
ARG BASE
FROM ${BASE} AS deps
RUN mkdir -p /opt/deps && echo "resolved" > /opt/deps/lock.txt

FROM ${BASE} AS runtime
ARG FLAVOUR=plain
ENV TRAINER_HOME=/app FLAVOUR=${FLAVOUR}
COPY --from=deps /opt/deps/lock.txt /opt/deps/lock.txt
COPY app/ /app/
RUN echo "built $FLAVOUR" > /app/built.txt && ls /app > /app/listing.txt

FROM runtime AS debug
RUN echo debug > /app/debug.txt
"""


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    reg = start_registry(tmp_path_factory.mktemp("registry"))
    with reg.client() as client:
        push_busybox_base(client, "base/busybox", "1", tmp_path_factory.mktemp("base"))
    yield reg
    reg.stop()


@pytest.fixture(scope="module")
def buildah_root(tmp_path_factory):
    return tmp_path_factory.mktemp("buildah")


@pytest.fixture
def conn(registry, monkeypatch):
    for key, value in registry.conn_env("registry_build").items():
        monkeypatch.setenv(key, value)
    return "registry_build"


def make_context(root, dockerfile: str = DOCKERFILE):
    (root / "app").mkdir(parents=True)
    (root / "app" / "main.py").write_text("print('hello')\n")
    (root / "Dockerfile").write_text(dockerfile)
    return root


def build(conn, buildah_root, context, registry, **kwargs):
    kwargs.setdefault("repository", "kubetrain/trainer")
    kwargs.setdefault("build_args", {"BASE": f"{registry.host}/base/busybox:1"})
    op = BuildImageOperator(
        task_id="build", context=str(context), registry_conn_id=conn, buildah_root=str(buildah_root), **kwargs
    )
    return op.execute({})


def test_build_push_and_read_back(registry, conn, buildah_root, tmp_path, capfd):
    context = make_context(tmp_path / "ctx")
    out = build(
        conn,
        buildah_root,
        context,
        registry,
        tags=["v1", "stable"],
        target="runtime",
        build_args={"BASE": f"{registry.host}/base/busybox:1", "FLAVOUR": "gpu"},
        labels={"team": "ml"},
        revision="0123abc",
    )
    assert out["reference"] == f"{registry.host}/kubetrain/trainer@{out['digest']}"
    repo_tags = tags(registry, "kubetrain/trainer")
    assert {"v1", "stable"} <= set(repo_tags)
    assert all(t in ("v1", "stable") or t.startswith("kubetrain-staging-") for t in repo_tags)
    with registry.client() as client:
        assert client.manifest_digest("kubetrain/trainer", "v1") == out["digest"]
        assert client.manifest_digest("kubetrain/trainer", "stable") == out["digest"]

    pulled = skopeo_pull(f"{registry.host}/kubetrain/trainer:v1", tmp_path / "oci")
    fs = pulled.filesystem()
    assert fs["app/main.py"] == b"print('hello')\n"  # COPY
    assert fs["app/built.txt"] == b"built gpu\n"  # RUN with a build arg, in the busybox base
    assert fs["opt/deps/lock.txt"] == b"resolved\n"  # COPY --from another stage
    assert "app/debug.txt" not in fs  # the target stopped before the debug stage
    assert fs["bin/busybox"] == open("/bin/busybox", "rb").read()
    assert pulled.env["TRAINER_HOME"] == "/app" and pulled.env["FLAVOUR"] == "gpu"  # ENV
    assert pulled.labels["org.opencontainers.image.revision"] == "0123abc"
    assert pulled.labels["org.opencontainers.image.created"].endswith("Z")
    assert pulled.labels["team"] == "ml"
    # buildah's own output reached the task log line by line
    logged = capfd.readouterr().out
    assert "STEP" in logged and "COMMIT" in logged


def test_failing_build_reports_exit_code_and_tags_nothing(registry, conn, buildah_root, tmp_path):
    context = make_context(
        tmp_path / "ctx", 'ARG BASE\nFROM ${BASE}\nRUN echo "compiling wheels" && exit 3\n'
    )
    with pytest.raises(
        BuildError, match=r"buildah bud failed with exit code \d+; last lines:\n(.|\n)*exit status 3"
    ) as err:
        build(conn, buildah_root, context, registry, tags=["broken"])
    assert "compiling wheels" in str(err.value)
    assert "broken" not in tags(registry, "kubetrain/trainer")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"dockerfile": "docker/Dockerfile.gpu"},
            ValueError,
            r"Dockerfile '.*/docker/Dockerfile.gpu' does not exist",
        ),
        ({"tags": ["ok", "not a tag"]}, ValueError, "invalid image tag 'not a tag'"),
        ({"tags": []}, ValueError, "no tags given"),
        ({"build_args": {"BAD-NAME": "1"}}, ValueError, "invalid build argument name 'BAD-NAME'"),
        ({"target": "-x"}, ValueError, "invalid build target '-x'"),
        ({"image_format": "v1"}, ValueError, "invalid image format 'v1'"),
        ({"repository": "UPPER/case"}, ValueError, "invalid repository name 'UPPER/case'"),
    ],
)
def test_bad_input_fails_before_building(registry, conn, buildah_root, tmp_path, kwargs, error, message):
    context = make_context(tmp_path / "ctx")
    kwargs.setdefault("tags", ["must-not-exist"])
    mark = registry.mark()
    with pytest.raises(error, match=message):
        build(conn, buildah_root, context, registry, **kwargs)
    assert registry.requests(mark) == []


def test_unknown_builder_is_refused():
    with pytest.raises(ValueError, match="invalid builder 'docker': expected one of buildah, in-cluster"):
        BuildImageOperator(task_id="b", context=".", repository="a/b", builder="docker")


def test_unreachable_registry_fails_before_building(buildah_root, tmp_path, monkeypatch):
    port = free_port()
    monkeypatch.setenv(
        "AIRFLOW_CONN_NOWHERE",
        f'{{"conn_type": "kubetrain_registry", "host": "127.0.0.1", '
        f'"port": {port}, "extra": {{"insecure": true, "timeout": 5}}}}',
    )
    context = make_context(tmp_path / "ctx")
    op = BuildImageOperator(
        task_id="b",
        context=str(context),
        repository="a/b",
        tags=["x"],
        registry_conn_id="nowhere",
        buildah_root=str(buildah_root),
    )
    with pytest.raises(RegistryUnreachable, match=rf"registry http://127.0.0.1:{port} is unreachable"):
        op.execute({})


def test_auth_registry_bad_then_good_credentials(tmp_path, buildah_root, monkeypatch):
    reg = start_registry(tmp_path / "auth", users={"ci": "build-pass"})
    try:
        with reg.client("ci", "build-pass") as client:
            push_busybox_base(client, "base/busybox", "1", tmp_path / "base")
        context = make_context(tmp_path / "ctx", "ARG BASE\nFROM ${BASE}\nCOPY app/ /app/\n")
        for key, value in reg.conn_env("auth_build", "ci", "nope").items():
            monkeypatch.setenv(key, value)
        with pytest.raises(RegistryAuthError, match="refused the credentials of user 'ci'"):
            build("auth_build", buildah_root, context, reg, tags=["v1"])
        assert tags(reg, "kubetrain/trainer") == []
        for key, value in reg.conn_env("auth_build", "ci", "build-pass").items():
            monkeypatch.setenv(key, value)
        out = build("auth_build", buildah_root, context, reg, tags=["v1"])  # pulls FROM and pushes with auth
        assert "v1" in tags(reg, "kubetrain/trainer")
        fs = skopeo_pull(
            f"{reg.host}/kubetrain/trainer@{out['digest']}", tmp_path / "oci", creds="ci:build-pass"
        ).filesystem()
        assert fs["app/main.py"] == b"print('hello')\n"
    finally:
        reg.stop()


def test_storage_root_is_absolute(tmp_path, monkeypatch):
    """buildah runs steps from other working directories: a relative root would not resolve there."""
    from pathlib import Path

    from kubetrain.imagebuild.buildah import BuildahBuilder

    monkeypatch.chdir(tmp_path)
    builder = BuildahBuilder(Path(".tools/buildah"), storage_driver="vfs")
    assert builder.storage_root == tmp_path / ".tools" / "buildah"
    assert str(tmp_path) in builder._env()["TMPDIR"]
