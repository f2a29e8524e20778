"""The build_trainer_image DAG end to end with dag.test(): full build, code-only append, short-circuit."""

from __future__ import annotations

import importlib.util
import json

import pytest

from kubetrain.imagebuild.trainer_image import IMAGE_VARIABLE, SOURCE_VARIABLE
from tests.plugins.imagebuild.support import REPO, push_busybox_base, skopeo_pull, start_registry, tags

REPOSITORY = "dagtest/trainer"


@pytest.fixture
def registry(tmp_path):
    reg = start_registry(tmp_path / "registry")
    with reg.client() as client:
        push_busybox_base(client, "base/busybox", "1", tmp_path / "base")
    yield reg
    reg.stop()


@pytest.fixture
def variables():
    """Set the repository Variable; put back the shared Variables this test overwrites."""
    # Outside a running task only the metadata-DB model can read and write Variables.
    from airflow.models import variable as variable_model

    Variable = variable_model.Variable
    names = (IMAGE_VARIABLE, SOURCE_VARIABLE, "kubetrain_trainer_repository")
    saved = {name: Variable.get(name, default_var=None) for name in names}
    Variable.set("kubetrain_trainer_repository", REPOSITORY)
    Variable.delete(SOURCE_VARIABLE)
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
    spec = importlib.util.spec_from_file_location("build_trainer_image_under_test", REPO / "dags" / "build_trainer_image.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_trainer_image()


def states(run) -> dict[str, str]:
    from airflow.models import DagRun
    from airflow.utils.session import create_session

    with create_session() as session:
        dr = session.query(DagRun).filter_by(dag_id=run.dag_id, run_id=run.run_id).one()
        return {ti.task_id: str(ti.state) for ti in dr.get_task_instances(session=session)}


@pytest.mark.slow
def test_full_then_append_then_nothing(registry, variables, tmp_path, monkeypatch):
    trainer = tmp_path / "trainer"
    trainer.mkdir()
    (trainer / "Dockerfile").write_text(f"FROM {registry.host}/base/busybox:1\nWORKDIR /app\nCOPY . /app/trainer/\n")
    (trainer / ".dockerignore").write_text("tests\n")
    (trainer / "requirements.txt").write_text("numpy==2.3.0\n")
    (trainer / "__init__.py").write_text("")
    (trainer / "train.py").write_text("VERSION = 1\n")
    (trainer / "old.py").write_text("removed later\n")
    dag = load_dag(monkeypatch, trainer, registry, tmp_path / "buildah")

    first = dag.test()
    assert states(first) == {"plan": "success", "choose": "success", "build_full": "success",
                             "append_code": "skipped", "publish": "success"}  # fmt: skip
    image1 = variables.get(IMAGE_VARIABLE)
    assert image1.startswith(f"{registry.host}/{REPOSITORY}@sha256:")
    record = json.loads(variables.get(SOURCE_VARIABLE))
    assert record["action"] == "full" and record["reference"] == image1
    assert {f"deps-{record['deps_hash'][:16]}", "latest"} <= set(tags(registry, REPOSITORY))

    (trainer / "train.py").write_text("VERSION = 2\n")
    (trainer / "old.py").unlink()
    second = dag.test()
    assert states(second) == {"plan": "success", "choose": "success", "build_full": "skipped",
                              "append_code": "success", "publish": "success"}  # fmt: skip
    image2 = variables.get(IMAGE_VARIABLE)
    assert image2 != image1 and json.loads(variables.get(SOURCE_VARIABLE))["action"] == "append"
    fs = skopeo_pull(image2, tmp_path / "oci").filesystem()
    assert fs["app/trainer/train.py"] == b"VERSION = 2\n"
    assert "app/trainer/old.py" not in fs  # the code layer replaces the old code, it does not merge
    with registry.client() as client:
        assert client.manifest_digest(REPOSITORY, "latest") == image2.rsplit("@", 1)[1]

    third = dag.test()
    assert states(third) == {"plan": "success", "choose": "skipped", "build_full": "skipped",
                             "append_code": "skipped", "publish": "skipped"}  # fmt: skip
    assert variables.get(IMAGE_VARIABLE) == image2


@pytest.fixture
def trainer_src(tmp_path):
    root = tmp_path / "trainer"
    (root / "tests").mkdir(parents=True)
    (root / "Dockerfile").write_text("FROM x\n")
    (root / "requirements.lock").write_text("numpy==2.3.0\n")
    (root / "train.py").write_text("A = 1\n")
    (root / "tests" / "test_train.py").write_text("pass\n")
    return root


def test_plan_cases(trainer_src):
    from kubetrain.imagebuild.plan import plan_image

    first = plan_image(trainer_src, previous=None, base_exists=False)
    assert first.action == "full" and first.base_tag == f"deps-{first.deps_hash[:16]}"
    previous = {"code_hash": first.code_hash, "deps_hash": first.deps_hash}
    assert plan_image(trainer_src, previous=previous, base_exists=True).action == "skip"
    assert plan_image(trainer_src, previous=previous, base_exists=True, force=True).action == "append"
    (trainer_src / "tests" / "test_train.py").write_text("changed tests do not count\n")
    assert plan_image(trainer_src, previous=previous, base_exists=True).action == "skip"
    (trainer_src / "train.py").write_text("A = 2\n")
    code_change = plan_image(trainer_src, previous=previous, base_exists=True)
    assert code_change.action == "append" and code_change.base_tag == first.base_tag
    (trainer_src / "requirements.lock").write_text("numpy==2.3.1\n")
    deps_change = plan_image(trainer_src, previous=previous, base_exists=False)
    assert deps_change.action == "full" and deps_change.base_tag != first.base_tag


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "rebuild"}, "invalid mode 'rebuild': expected one of auto, full, append"),
        ({"mode": "append", "base_exists": False}, "mode 'append' needs the base image tagged deps-"),
    ],
)
def test_plan_refuses(trainer_src, kwargs, message):
    from kubetrain.imagebuild.plan import plan_image

    kwargs.setdefault("base_exists", True)
    with pytest.raises(ValueError, match=message):
        plan_image(trainer_src, previous=None, **kwargs)
