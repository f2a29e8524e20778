"""Planning image updates: skip, code layer or full build of the trainer; skip, reuse or build of the sync image."""

from __future__ import annotations

import pytest


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


def test_variants_have_their_own_base_and_build_args_count(trainer_src):
    from kubetrain.imagebuild.plan import base_tag, plan_image

    gpu = plan_image(trainer_src, previous=None, base_exists=True, variant="gpu")
    cpu = plan_image(trainer_src, previous=None, base_exists=True, variant="cpu")
    assert cpu.base_tag == gpu.base_tag + "-cpu" and cpu.variant == "cpu"
    published_gpu = {"code_hash": gpu.code_hash, "deps_hash": gpu.deps_hash, "variant": "gpu"}
    # the same code published for the GPU variant is no reason to skip the CPU one
    assert plan_image(trainer_src, previous=published_gpu, base_exists=True, variant="cpu").action == "append"
    other_base = plan_image(
        trainer_src,
        previous=published_gpu,
        base_exists=False,
        build_args={"BASE_IMAGE": "registry.example/tf:2"},
    )
    assert other_base.action == "full" and other_base.base_tag != gpu.base_tag
    assert base_tag(trainer_src, "gpu", {"BASE_IMAGE": "registry.example/tf:2"}) == other_base.base_tag
    with pytest.raises(ValueError, match="invalid variant 'tpu': expected one of gpu, cpu"):
        plan_image(trainer_src, previous=None, base_exists=True, variant="tpu")


def test_sync_files_do_not_rebuild_the_trainer_base(trainer_src):
    from kubetrain.imagebuild.plan import base_tag

    before = base_tag(trainer_src)
    (trainer_src / "Dockerfile.sync").write_text("FROM y\n")
    (trainer_src / "requirements-sync.txt").write_text("botocore==1\n")
    assert base_tag(trainer_src) == before
    (trainer_src / "Dockerfile").write_text("FROM z\n")
    assert base_tag(trainer_src) != before


def test_sync_plan_cases(trainer_src):
    from kubetrain.imagebuild.plan import plan_sync_image, sync_tag

    with pytest.raises(ValueError, match="the sync image is built from trainer/sync"):
        plan_sync_image(trainer_src, previous=None, existing_digest=None)
    (trainer_src / "sync").mkdir()
    (trainer_src / "sync" / "__main__.py").write_text("print('sync')\n")
    (trainer_src / "Dockerfile.sync").write_text("FROM y\n")
    first = plan_sync_image(trainer_src, previous=None, existing_digest=None)
    assert first.action == "build" and first.tag == sync_tag(trainer_src) == f"src-{first.source_hash[:16]}"
    digest = "sha256:" + "c" * 64
    reuse = plan_sync_image(trainer_src, previous=None, existing_digest=digest)
    assert (reuse.action, reuse.digest) == ("reuse", digest)
    previous = {"source_hash": first.source_hash}
    assert plan_sync_image(trainer_src, previous=previous, existing_digest=digest).action == "skip"
    assert (
        plan_sync_image(trainer_src, previous=previous, existing_digest=digest, force=True).action == "build"
    )
    (trainer_src / "train.py").write_text("A = 3\n")  # trainer code outside sync/ does not count
    assert plan_sync_image(trainer_src, previous=previous, existing_digest=None).action == "skip"
    # nor the multi-buffer MD5 `make setup` compiled into the checkout: the image compiles its own
    (trainer_src / "sync" / "_md5many.so").write_bytes(b"\x7fELF")
    assert plan_sync_image(trainer_src, previous=previous, existing_digest=None).action == "skip"
    (trainer_src / "sync" / "native").mkdir()
    for change in (
        lambda: (trainer_src / "sync" / "__main__.py").write_text("print('v2')\n"),
        lambda: (trainer_src / "sync" / "native" / "md5many.c").write_text("int x;\n"),
        lambda: (trainer_src / "requirements-sync.txt").write_text("awscrt==1\n"),
    ):
        change()
        changed = plan_sync_image(trainer_src, previous=previous, existing_digest=None)
        assert changed.action == "build" and changed.source_hash != previous["source_hash"]
        previous = {"source_hash": changed.source_hash}
    args = plan_sync_image(
        trainer_src, previous=previous, existing_digest=None, build_args={"BASE_IMAGE": "b"}
    )
    assert args.action == "build"


def test_a_change_of_the_contract_needs_a_full_build_of_both_images(trainer_src):
    """The images copy kubetrain_contract to /app/kubetrain_contract, outside what a code layer replaces."""
    from kubetrain.imagebuild.plan import base_tag, sync_source_hash

    (trainer_src / "sync").mkdir()
    (trainer_src / "sync" / "__init__.py").write_text("")
    (trainer_src / "kubetrain_contract").mkdir()
    (trainer_src / "kubetrain_contract" / "exit_codes.py").write_text("EXIT_USAGE = 2\n")
    base, sync = base_tag(trainer_src), sync_source_hash(trainer_src)
    (trainer_src / "train.py").write_text("A = 2\n")
    assert base_tag(trainer_src) == base  # the trainer's code: a code layer
    (trainer_src / "kubetrain_contract" / "exit_codes.py").write_text("EXIT_USAGE = 64\n")
    assert base_tag(trainer_src) != base and sync_source_hash(trainer_src) != sync
