"""kubetrain's images, built from their Dockerfiles on the Debian-made base: they start, the
trainer trains a step as the image's non-root user, and the registry holds what was pushed.
Their names are defined once (products.py) and every place that names them agrees."""

from __future__ import annotations

import json
import re
import shlex
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from kubetrain import pod_spec, settings
from kubetrain.imagebuild import release
from kubetrain.imagebuild.builders import BuildError, PushTarget
from kubetrain.imagebuild.oci import RegistryClient
from kubetrain.imagebuild.products import (
    SYNC,
    TRAINER_CPU,
    TRAINER_GPU,
    ImagePublisher,
    default_image,
    default_images,
)
from kubetrain.preflight import Preflight
from kubetrain.settings import Deployment

REPO = Path(__file__).resolve().parents[3]
NON_ROOT = re.compile(r"^[1-9]\d*:[1-9]\d*$")


def png(pixels: list[list[int]]) -> bytes:
    """A grayscale PNG of ``pixels`` (rows of 0-255)."""
    raw = b"".join(b"\x00" + bytes(row) for row in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", len(pixels[0]), len(pixels), 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


def tiny_dataset(root: Path) -> Path:
    """Two classes of 16x16 images: bright left half or bright right half."""
    for label, left in (("left", True), ("right", False)):
        folder = root / label
        folder.mkdir(parents=True)
        for i in range(10):
            rows = [[(200 + i if (x < 8) == left else 10 + i) for x in range(16)] for _ in range(16)]
            (folder / f"{i}.png").write_bytes(png(rows))
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return root


def test_both_images_are_pushed_by_digest_under_their_names(stack_images, devstack):
    registry = devstack.load_state()["registry"]
    trainer, sync = stack_images["trainer"], stack_images["sync"]
    assert trainer.reference == f"{registry}/kubetrain/trainer@{trainer.digest}"
    assert sync.reference == f"{registry}/kubetrain/sync@{sync.digest}"
    assert trainer.tags == ("latest-cpu",) and sync.tags == ("latest",)
    with RegistryClient(registry, insecure=True) as client:
        assert client.manifest_digest("kubetrain/trainer", "latest-cpu") == trainer.digest
        assert client.manifest_digest("kubetrain/sync", "latest") == sync.digest
        for image in (trainer, sync):
            manifest = client.get_manifest(image.repository, image.digest).data
            config = json.loads(client.get_blob(image.repository, manifest["config"]["digest"]))
            assert NON_ROOT.match(config["config"]["User"]), config["config"]
            assert image.user == config["config"]["User"]
    assert json.loads(json.dumps(trainer.as_dict()))["reference"] == trainer.reference


def test_sync_image_runs_the_transfer_tool(stack_images, image_builder):
    lines = image_builder.run_in_image(
        stack_images["sync"].local, ["python3", "-m", "trainer.sync", "stage-in", "--help"]
    )
    assert any("--verify {auto,md5,size}" in line for line in lines), (
        lines
    )  # the last lines of stage-in --help
    # botocore and the CRT import inside the image: the package's engine is there, not only its CLI
    probe = "import awscrt, botocore, s3transfer, os; print('engine', botocore.__version__, os.getuid())"
    lines = image_builder.run_in_image(stack_images["sync"].local, ["python3", "-c", probe])
    assert lines[-1] == "engine 1.44.5 10001"
    # the multi-buffer MD5 the image compiled for itself (Dockerfile.sync's first stage), in use on
    # this CPU, and agreeing with hashlib
    flags = set(re.findall(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M)[0].split())
    cpu_lanes = 16 if "avx512f" in flags else 8 if "avx2" in flags else 0
    probe = (
        "import hashlib; from trainer.sync import md5many as m; b = [bytes([i]) * i * 9 for i in range(40)]; "
        "assert m.md5_many(b) == [hashlib.md5(x).digest() for x in b]; "
        "print('md5', m.LIBRARY, m.lanes(), repr(m.unavailable()))"
    )
    lines = image_builder.run_in_image(stack_images["sync"].local, ["python3", "-c", probe])
    why = "" if cpu_lanes else "this CPU has neither AVX-512 nor AVX2"
    assert lines[-1] == f"md5 /app/trainer/sync/_md5many.so {cpu_lanes} {why!r}", lines


def test_trainer_image_trains_one_step_as_its_user(stack_images, image_builder, tmp_path):
    data = tiny_dataset(tmp_path / "data")
    out, ckpt = tmp_path / "output", tmp_path / "checkpoints"
    for path in (out, ckpt):
        path.mkdir()
        path.chmod(0o777)  # the image's user (10001) writes here, as into an emptyDir
    lines = image_builder.run_in_image(
        stack_images["trainer"].local,
        [
            "python3",
            "-m",
            "trainer.image_classifier",
            "--image-size",
            "16",
            "--channels",
            "1",
            "--batch-size",
            "4",
            "--filters",
            "4",
            "--epochs",
            "1",
            "--max-steps",
            "1",
            "--verify-workers",
            "1",
        ],
        volumes={str(data): "/data:ro", str(out): "/output", str(ckpt): "/checkpoints"},
        env={"KUBETRAIN_IMAGE": stack_images["trainer"].reference},
    )
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 1 and metrics["train_examples"] + metrics["val_examples"] == 20, lines
    assert json.loads((out / "params.json").read_text())["image"] == stack_images["trainer"].reference
    assert any((out / "saved_model").glob("*/saved_model.pb"))
    assert {p.stat().st_uid for p in out.iterdir()} == {10001}  # written by the image's numeric user


def test_a_broken_dockerfile_fails_before_anything_is_pushed(stack_images, image_builder, devstack, tmp_path):
    """The check command runs in the built image: an image that cannot start is never pushed."""
    context = tmp_path / "trainer"
    context.mkdir()
    for name in ("requirements-sync.txt", ".dockerignore"):
        (context / name).write_bytes((REPO / "trainer" / name).read_bytes())
    (context / "sync" / "native").mkdir(parents=True)
    (context / "sync" / "__init__.py").write_text("")  # the package without its __main__
    native = REPO / "trainer" / "sync" / "native" / "md5many.c"
    (context / "sync" / "native" / "md5many.c").write_bytes(native.read_bytes())
    import shutil

    shutil.copytree(
        REPO / "trainer" / "kubetrain_contract",
        context / "kubetrain_contract",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    (context / "Dockerfile.sync").write_text((REPO / "trainer" / "Dockerfile.sync").read_text())
    registry = devstack.load_state()["registry"]
    publisher = ImagePublisher(image_builder, context, tmp_path / "layouts", local_suffix="-broken")
    with pytest.raises(
        BuildError,
        match=r"the check of sync failed with exit code 1(.|\n)*No module named trainer.sync.__main__",
    ):
        publisher.publish(
            [SYNC],
            lambda item: PushTarget(registry, "broken/sync", insecure=True),
            tag="broken",
            base="debian",
            rootfs=REPO / ".tools" / "images" / "bookworm-python.tar",
        )
    with RegistryClient(registry, insecure=True) as client:
        assert client.manifest_digest("broken/sync", "broken") is None


# -- one definition of the default names ---------------------------------------------------------------------

REGISTRY = "registry.example:5000"


@pytest.fixture
def no_configured_images(monkeypatch):
    monkeypatch.setenv("KUBETRAIN_REGISTRY", REGISTRY)
    for name in ("trainer_image", "sync_image", "image_tag", "trainer_variant"):
        monkeypatch.delenv(settings.SETTINGS[name].env, raising=False)
        monkeypatch.delenv(f"AIRFLOW_VAR_{settings.SETTINGS[name].variable.upper()}", raising=False)
    monkeypatch.setattr(settings, "_variable", lambda name: None)  # no Variable of the local metadata DB


def test_the_default_names(no_configured_images):
    assert default_images(REGISTRY) == {
        "trainer": f"{REGISTRY}/kubetrain/trainer:latest",
        "sync": f"{REGISTRY}/kubetrain/sync:latest",
    }
    assert TRAINER_CPU.reference(REGISTRY) == f"{REGISTRY}/kubetrain/trainer:latest-cpu"
    assert TRAINER_GPU.tags("v1") == ("v1", "v1-gpu") and SYNC.tags("v1") == ("v1",)
    for kind in ("trainer", "sync"):
        assert pod_spec.resolve_image(None, kind) == default_image(kind, REGISTRY)
    with pytest.raises(ValueError, match="unknown image kind 'builder': expected one of trainer, sync"):
        default_image("builder", REGISTRY)


def test_settings_and_readme_describe_the_default_names():
    readme = (REPO / "README.md").read_text()
    for kind in ("trainer", "sync"):
        name = default_image(kind, "<registry>", "TAG").replace(":TAG", ":<image_tag>")
        assert name in settings.SETTINGS[f"{kind}_image"].description
        assert name.replace("<", "&lt;").replace(">", "&gt;") in readme  # README's generated settings table


def test_real_cluster_doc_names_the_images_as_built():
    doc = (REPO / "docs" / "real-cluster.md").read_text()
    table = {}
    for repository, what, tags in re.findall(r"^\| `<registry>/([a-z/]+)`\s*([^|]*)\| (.*) \|$", doc, re.M):
        table[(repository, what.strip())] = tuple(t.strip("` ") for t in tags.split(","))

    def tags(product) -> tuple[str, ...]:
        return tuple(t.replace("TAG", "<tag>") for t in product.tags("TAG"))

    assert table == {
        (TRAINER_GPU.repository, "(GPU, the default of training pods)"): tags(TRAINER_GPU),
        (TRAINER_CPU.repository, "(CPU)"): tags(TRAINER_CPU),
        (SYNC.repository, "(stage-in and checkpoint-sync)"): tags(SYNC),
    }
    assert "KUBETRAIN_TRAINER_VARIANT=cpu" in doc and "KUBETRAIN_IMAGE_TAG=v1" in doc


@pytest.mark.parametrize("tag", ["latest", "v1"])
def test_make_images_pushes_the_names_pods_use_by_default(capsys, no_configured_images, monkeypatch, tag):
    """`make images IMAGE_TAG=<tag>` (as make would run it) pushes what pods and the preflight take by default once
    KUBETRAIN_IMAGE_TAG says the same tag, for either trainer variant."""
    out = subprocess.run(
        ["make", "-n", "--no-print-directory", "images", "IMAGE_BASE=official", f"IMAGE_TAG={tag}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = next(cmd for cmd in out.replace("\\\n", " ").splitlines() if "kubetrain.imagebuild.release" in cmd)
    argv = shlex.split(line)
    args = argv[argv.index("kubetrain.imagebuild.release") + 1 :]
    assert release.main([*args, "--registry", REGISTRY, "--list"]) == 0
    pushed = {
        item["name"]: item["references"] for item in map(json.loads, capsys.readouterr().out.splitlines())
    }
    assert set(pushed) == {"trainer-gpu", "trainer-cpu", "sync"}
    monkeypatch.setenv("KUBETRAIN_IMAGE_TAG", tag)
    for variant, name in (("gpu", "trainer-gpu"), ("cpu", "trainer-cpu")):
        monkeypatch.setenv("KUBETRAIN_TRAINER_VARIANT", variant)
        assert pod_spec.resolve_image(None, "trainer") in pushed[name]
        assert Preflight(Deployment.from_environment()).registry_checks.images()["trainer"] in pushed[name]
    assert pod_spec.resolve_image(None, "sync") in pushed["sync"]


def test_dev_stack_runs_the_cpu_trainer_it_pushes(devstack, monkeypatch):
    """The dev stack names no image: its pods take the default names, of the CPU variant it pushes."""
    env = devstack.env()
    assert "KUBETRAIN_TRAINER_IMAGE" not in env and env["KUBETRAIN_TRAINER_VARIANT"] == "cpu"
    for name in ("trainer_image", "sync_image", "image_tag"):
        monkeypatch.delenv(settings.SETTINGS[name].env, raising=False)
    monkeypatch.setattr(settings, "_variable", lambda name: None)
    monkeypatch.setenv("KUBETRAIN_REGISTRY", env["KUBETRAIN_REGISTRY"])
    monkeypatch.setenv("KUBETRAIN_TRAINER_VARIANT", env["KUBETRAIN_TRAINER_VARIANT"])
    assert pod_spec.resolve_image(None, "trainer") == TRAINER_CPU.reference(env["KUBETRAIN_REGISTRY"])
