"""The build_trainer_image DAG end to end with dag.test(): both images built, updated and published together."""

from __future__ import annotations

import importlib.util
import json

import pytest

from kubetrain.imagebuild.products import TRAINER_CPU, default_image
from kubetrain.imagebuild.reference import parse_reference
from kubetrain.imagebuild.trainer_image import (
    BUILD_ARGS_VARIABLE,
    IMAGE_VARIABLE,
    SOURCE_VARIABLE,
    SYNC_IMAGE_VARIABLE,
    SYNC_SOURCE_VARIABLE,
)
from tests.plugins.imagebuild.support import REPO, push_busybox_base, skopeo_pull, start_registry, tags

TRAINER_REPOSITORY, SYNC_REPOSITORY = "kubetrain/trainer", "kubetrain/sync"
VARIABLES = (
    IMAGE_VARIABLE,
    SYNC_IMAGE_VARIABLE,
    SOURCE_VARIABLE,
    SYNC_SOURCE_VARIABLE,
    BUILD_ARGS_VARIABLE,
    "kubetrain_trainer_repository",
    "kubetrain_sync_repository",
)
DOCKERFILE = "ARG BASE_IMAGE\nFROM ${BASE_IMAGE}\nWORKDIR /app\nCOPY . /app/trainer/\n"
DOCKERFILE_SYNC = "ARG BASE_IMAGE\nFROM ${BASE_IMAGE}\nWORKDIR /app\nCOPY sync/ /app/trainer/sync/\n"


@pytest.fixture
def registry(tmp_path):
    reg = start_registry(tmp_path / "registry")
    with reg.client() as client:
        push_busybox_base(client, "base/busybox", "1", tmp_path / "base")
    yield reg
    reg.stop()


@pytest.fixture
def variables(registry):
    """The DAG's Variables for this test (bases in the test registry); the shared ones are put back after."""
    # Outside a running task only the metadata-DB model can read and write Variables.
    from airflow.models import variable as variable_model

    Variable = variable_model.Variable
    saved = {name: Variable.get(name, default_var=None) for name in VARIABLES}
    for name in VARIABLES:
        Variable.delete(name)
    base = {"BASE_IMAGE": f"{registry.host}/base/busybox:1"}
    Variable.set(BUILD_ARGS_VARIABLE, json.dumps({"trainer-gpu": base, "trainer-cpu": base, "sync": base}))
    yield Variable
    for name, value in saved.items():
        if value is None:
            Variable.delete(name)
        else:
            Variable.set(name, value)


def load_dag(monkeypatch, trainer, registry, buildah_root):
    monkeypatch.setenv("KUBETRAIN_TRAINER_DIR", str(trainer))
    monkeypatch.setenv("KUBETRAIN_REGISTRY_CONN_ID", "dagtest_registry")
    monkeypatch.setenv("KUBETRAIN_BUILDAH_ROOT", str(buildah_root))
    for key, value in registry.conn_env("dagtest_registry").items():
        monkeypatch.setenv(key, value)
    spec = importlib.util.spec_from_file_location(
        "build_trainer_image_under_test", REPO / "dags" / "build_trainer_image.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_trainer_image()


def states(run) -> dict[str, str]:
    from airflow.models import DagRun
    from airflow.utils.session import create_session

    with create_session() as session:
        dr = session.query(DagRun).filter_by(dag_id=run.dag_id, run_id=run.run_id).one()
        return {ti.task_id: str(ti.state) for ti in dr.get_task_instances(session=session)}


def ran(run) -> set[str]:
    return {task for task, state in states(run).items() if state == "success"}


def digest_of(reference: str) -> str:
    return reference.rsplit("@", 1)[1]


def trainer_tree(root):
    root.mkdir()
    (root / "Dockerfile").write_text(DOCKERFILE)
    (root / "Dockerfile.sync").write_text(DOCKERFILE_SYNC)
    (root / ".dockerignore").write_text("tests\n")
    (root / "requirements.txt").write_text("numpy==2.3.0\n")
    (root / "requirements-sync.txt").write_text("botocore==1.44.5\n")
    (root / "__init__.py").write_text("")
    (root / "train.py").write_text("VERSION = 1\n")
    (root / "old.py").write_text("removed later\n")
    (root / "sync").mkdir()
    (root / "sync" / "__main__.py").write_text("SYNC = 1\n")
    return root


@pytest.mark.slow
def test_both_images_built_updated_and_published_together(registry, variables, tmp_path, monkeypatch):
    trainer = trainer_tree(tmp_path / "trainer")
    dag = load_dag(monkeypatch, trainer, registry, tmp_path / "buildah")

    # 1. first run: the trainer (GPU variant) in full and the sync image, then both published by digest
    first = dag.test()
    assert ran(first) == {"plan", "choose", "build_full", "build_sync", "publish"}
    image1, sync1 = variables.get(IMAGE_VARIABLE), variables.get(SYNC_IMAGE_VARIABLE)
    assert image1.startswith(f"{registry.host}/{TRAINER_REPOSITORY}@sha256:")
    assert sync1.startswith(f"{registry.host}/{SYNC_REPOSITORY}@sha256:")
    record = json.loads(variables.get(SOURCE_VARIABLE))
    assert (record["action"], record["variant"], record["reference"]) == ("full", "gpu", image1)
    assert json.loads(variables.get(SYNC_SOURCE_VARIABLE))["reference"] == sync1
    assert {f"deps-{record['deps_hash'][:16]}", "latest", "latest-gpu"} <= set(
        tags(registry, TRAINER_REPOSITORY)
    )
    # the names pods use by default (pod_spec.resolve_image -> products.default_image) are what was published
    with registry.client() as client:
        for kind, published in (("trainer", image1), ("sync", sync1)):
            ref = parse_reference(default_image(kind, registry.host))
            assert client.manifest_digest(ref.repository, ref.tag) == digest_of(published), kind
    sync_fs = skopeo_pull(sync1, tmp_path / "oci-sync1").filesystem()
    assert sync_fs["app/trainer/sync/__main__.py"] == b"SYNC = 1\n" and "app/trainer/train.py" not in sync_fs

    # 2. trainer code only: a code layer on the GPU base; the sync image stays as it was
    (trainer / "train.py").write_text("VERSION = 2\n")
    (trainer / "old.py").unlink()
    second = dag.test()
    assert ran(second) == {"plan", "choose", "append_code", "publish"}
    image2 = variables.get(IMAGE_VARIABLE)
    assert image2 != image1 and variables.get(SYNC_IMAGE_VARIABLE) == sync1
    fs = skopeo_pull(image2, tmp_path / "oci").filesystem()
    assert fs["app/trainer/train.py"] == b"VERSION = 2\n"
    assert "app/trainer/old.py" not in fs  # the code layer replaces the old code, it does not merge

    # 3. the sync package changed and the CPU variant is asked for: the CPU trainer in full, the sync image
    (trainer / "sync" / "__main__.py").write_text("SYNC = 2\n")
    third = dag.test(run_conf={"variant": "cpu"})
    assert ran(third) == {"plan", "choose", "build_full", "build_sync", "publish"}
    image3, sync3 = variables.get(IMAGE_VARIABLE), variables.get(SYNC_IMAGE_VARIABLE)
    assert sync3 != sync1 and json.loads(variables.get(SOURCE_VARIABLE))["variant"] == "cpu"
    assert (
        skopeo_pull(sync3, tmp_path / "oci-sync3").filesystem()["app/trainer/sync/__main__.py"]
        == b"SYNC = 2\n"
    )
    with registry.client() as client:
        cpu = parse_reference(TRAINER_CPU.reference(registry.host))
        assert client.manifest_digest(cpu.repository, cpu.tag) == digest_of(image3)  # latest-cpu
        assert client.manifest_digest(TRAINER_REPOSITORY, "latest") == digest_of(image2)  # the GPU one stays

    # 4. nothing changed: nothing runs
    fourth = dag.test(run_conf={"variant": "cpu"})
    assert ran(fourth) == {"plan"} and states(fourth)["publish"] == "skipped"

    # 5. a broken sync build publishes nothing, though the trainer's code layer was pushed
    (trainer / "train.py").write_text("VERSION = 3\n")
    (trainer / "Dockerfile.sync").write_text(DOCKERFILE_SYNC.replace("COPY sync/", "COPY missing/"))
    dag.get_task("build_sync").retries = 0
    fifth = dag.test(run_conf={"variant": "cpu"})
    assert states(fifth)["append_code"] == "success" and states(fifth)["build_sync"] == "failed"
    assert states(fifth)["publish"] == "upstream_failed"
    assert (variables.get(IMAGE_VARIABLE), variables.get(SYNC_IMAGE_VARIABLE)) == (image3, sync3)
    with registry.client() as client:
        assert client.manifest_digest(TRAINER_REPOSITORY, "latest-cpu") == digest_of(image3)
