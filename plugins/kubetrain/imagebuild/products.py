"""The images kubetrain ships: what each is built from, what it is called, how it is published.

=============  ===================  ==================  ==================================  ================
image          repository           Dockerfile          default ``BASE_IMAGE``              tags
=============  ===================  ==================  ==================================  ================
trainer (GPU)  ``kubetrain/trainer``  ``Dockerfile``    ``tensorflow/tensorflow:2.21.0-gpu``  ``<tag>``, ``<tag>-gpu``
trainer (CPU)  ``kubetrain/trainer``  ``Dockerfile``    ``tensorflow/tensorflow:2.21.0``      ``<tag>-cpu``
sync           ``kubetrain/sync``     ``Dockerfile.sync`` ``python:3.11-slim``                ``<tag>``
=============  ===================  ==================  ==================================  ================

The build context of every image is ``trainer/``. The plain tag of the trainer is its GPU
variant, the image training pods use by default (``<registry>/kubetrain/trainer:<tag>``, the
``image_tag`` setting, ``latest`` unless set); a CPU-only cluster sets the ``trainer_variant``
setting to ``cpu`` (``...:<tag>-cpu``).

Where public images cannot be pulled, bases made from Debian packages stand in for both
official ones (``make images IMAGE_BASE=debian``): Debian bookworm's Python 3.11 and pip for
``python:3.11-slim``, and the same with TensorFlow's CPU wheel from PyPI for
``tensorflow/tensorflow:<version>`` (``trainer/Dockerfile.tensorflow``). Such a build has no GPU
variant. The dev stack's registry mirror serves these stand-ins under the official names.

:class:`ImagePublisher` builds an image with buildah, runs a command in it that proves it
starts, and pushes it. Pushes go through an OCI layout kept per image, so the layers of a
large image are compressed once, not on every push to a new registry.
"""

from __future__ import annotations

import contextlib
import fcntl
import re
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kubetrain.imagebuild.buildah import BuildahBuilder
from kubetrain.imagebuild.builders import BuildRequest, PushTarget
from kubetrain.imagebuild.reference import check_tag

TRAINER_REPOSITORY = "kubetrain/trainer"
SYNC_REPOSITORY = "kubetrain/sync"
TENSORFLOW_VERSION = "2.21.0"
LOCAL_BASE_REPOSITORY = "localhost/kubetrain/base"
# Labels of the Debian-made base: what it is, so `buildah images` tells it apart.
LOCAL_BASE_LABELS = {"org.opencontainers.image.title": "kubetrain base: Debian bookworm, Python 3.11, pip"}
LOCAL_BASE_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
BASES = ("official", "debian")


@dataclass(frozen=True)
class ImageProduct:
    """One image kubetrain ships.

    :param name: ``trainer-gpu``, ``trainer-cpu`` or ``sync``.
    :param repository: the repository in the registry.
    :param dockerfile: the Dockerfile in ``trainer/``.
    :param base_image: the official ``BASE_IMAGE``.
    :param variant: ``gpu`` or ``cpu`` for the trainer, None for the sync image.
    :param check: a command that must succeed in the built image before it is pushed.
    """

    name: str
    repository: str
    dockerfile: str
    base_image: str
    variant: str | None = None
    check: tuple[str, ...] = ()

    def tags(self, tag: str = "latest") -> tuple[str, ...]:
        """The tags this image gets for release ``tag`` (the first one names it)."""
        check_tag(tag)
        if self.variant == "cpu":
            return (f"{tag}-cpu",)
        if self.variant == "gpu":
            return (tag, f"{tag}-gpu")
        return (tag,)

    def reference(self, registry: str, tag: str = "latest") -> str:
        """``<registry>/<repository>:<first tag>``."""
        return f"{registry}/{self.repository}:{self.tags(tag)[0]}"


TRAINER_GPU = ImageProduct(
    "trainer-gpu",
    TRAINER_REPOSITORY,
    "Dockerfile",
    f"tensorflow/tensorflow:{TENSORFLOW_VERSION}-gpu",
    "gpu",
    ("python3", "-m", "trainer.image_classifier", "--help"),
)
TRAINER_CPU = ImageProduct(
    "trainer-cpu",
    TRAINER_REPOSITORY,
    "Dockerfile",
    f"tensorflow/tensorflow:{TENSORFLOW_VERSION}",
    "cpu",
    ("python3", "-m", "trainer.image_classifier", "--help"),
)
SYNC = ImageProduct(
    "sync",
    SYNC_REPOSITORY,
    "Dockerfile.sync",
    "python:3.11-slim",
    None,
    ("python3", "-m", "trainer.sync", "--help"),
)
PRODUCTS: dict[str, ImageProduct] = {p.name: p for p in (TRAINER_GPU, TRAINER_CPU, SYNC)}


def product(name: str) -> ImageProduct:
    """The product called ``name``; ``ValueError`` naming the known ones otherwise."""
    try:
        return PRODUCTS[name]
    except KeyError:
        raise ValueError(f"unknown image {name!r}: expected one of {', '.join(PRODUCTS)}") from None


# What training pods run when no image is configured: the one definition of the default names,
# used by pod_spec.resolve_image, the preflight, the build DAG and `make images`.
DEFAULT_PRODUCTS: dict[str, ImageProduct] = {"trainer": TRAINER_GPU, "sync": SYNC}
TRAINER_VARIANTS: dict[str, ImageProduct] = {"gpu": TRAINER_GPU, "cpu": TRAINER_CPU}


def default_image(kind: str, registry: str, tag: str = "latest", variant: str = "gpu") -> str:
    """The reference pods use for image ``kind`` (``trainer`` or ``sync``) when none is configured: the first
    tag of release ``tag`` of that image (of trainer ``variant``), as `make images IMAGE_TAG=<tag>` pushes it.

    :raises ValueError: for another kind or variant, naming the known ones.
    """
    if kind not in DEFAULT_PRODUCTS:
        raise ValueError(f"unknown image kind {kind!r}: expected one of {', '.join(DEFAULT_PRODUCTS)}")
    if variant not in TRAINER_VARIANTS:
        raise ValueError(
            f"unknown trainer variant {variant!r}: expected one of {', '.join(TRAINER_VARIANTS)}"
        )
    item = TRAINER_VARIANTS[variant] if kind == "trainer" else DEFAULT_PRODUCTS[kind]
    return item.reference(registry, tag)


def default_images(registry: str, tag: str = "latest", variant: str = "gpu") -> dict[str, str]:
    """The references training pods use by default: ``{"trainer": ..., "sync": ...}``."""
    return {kind: default_image(kind, registry, tag, variant) for kind in DEFAULT_PRODUCTS}


def tensorflow_requirement(trainer_dir: Path) -> str:
    """The TensorFlow pin of ``trainer/requirements.txt`` (``tensorflow-cpu==...``), for bases without it."""
    text = (Path(trainer_dir) / "requirements.txt").read_text()
    match = re.search(r"^(tensorflow(?:-cpu)?==\S+)", text, re.M)
    if not match:
        raise ValueError(f"{trainer_dir}/requirements.txt pins no tensorflow or tensorflow-cpu")
    return match.group(1)


@dataclass(frozen=True)
class PublishedImage:
    """An image in a registry: ``reference`` is ``registry/repository@digest``."""

    name: str
    repository: str
    registry: str
    digest: str
    tags: tuple[str, ...]
    local: str = ""
    user: str = ""

    @property
    def reference(self) -> str:
        return f"{self.registry}/{self.repository}@{self.digest}"

    def tagged(self, tag: str | None = None) -> str:
        """``registry/repository:tag`` (the first tag by default)."""
        return f"{self.registry}/{self.repository}:{tag or self.tags[0]}"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "reference": self.reference}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@dataclass
class ImagePublisher:
    """Build, check and push kubetrain's images.

    :param builder: the buildah builder (its storage holds the layer cache).
    :param trainer_dir: the ``trainer/`` directory (build context of every image).
    :param layouts: where the OCI layout of each image is kept between pushes.
    :param log: receives progress lines.
    :param local_suffix: appended to the local tag (``localhost/<repository>:<name><suffix>``), so
        that builds of other contexts do not move the tags of these.
    """

    builder: BuildahBuilder
    trainer_dir: Path
    layouts: Path
    log: Callable[[str], None] = print
    local_suffix: str = ""
    _bases: dict[str, str] = field(default_factory=dict)

    def local_base(self, rootfs: Path) -> str:
        """The Debian-made base in the builder's store, imported from ``rootfs`` when it is new."""
        rootfs = Path(rootfs)
        if not rootfs.is_file():
            raise ValueError(f"base root file system {str(rootfs)!r} does not exist: run `make images-base`")
        stat = rootfs.stat()
        name = f"{LOCAL_BASE_REPOSITORY}:bookworm-{stat.st_size:x}-{stat.st_mtime_ns:x}"
        if name not in self._bases:
            with _locked(self.builder.storage_root / "base.lock"):
                if self.builder.image_id(name) is None:
                    self.builder.import_rootfs(
                        rootfs, name, env=LOCAL_BASE_ENV, cmd=["python3"], labels=LOCAL_BASE_LABELS
                    )
            self._bases[name] = name
        return name

    def local_tensorflow(self, rootfs: Path) -> str:
        """TensorFlow's CPU wheel on the Debian-made base, in the builder's store (built once, then cached)."""
        base = self.local_base(rootfs)
        requirement = tensorflow_requirement(self.trainer_dir)
        tag = f"{requirement.partition('==')[2]}-{base.rpartition(':')[2]}"
        name = f"{LOCAL_BASE_REPOSITORY}-tensorflow:{tag}"
        if name not in self._bases:
            with _locked(self.builder.storage_root / "base.lock"):
                if self.builder.image_id(name) is None:
                    request = BuildRequest(
                        context=Path(self.trainer_dir),
                        repository=LOCAL_BASE_REPOSITORY + "-tensorflow",
                        tags=(tag,),
                        dockerfile="Dockerfile.tensorflow",
                        build_args={"BASE_IMAGE": base, "TENSORFLOW_PACKAGE": requirement},
                    )
                    self.builder.build(request, local_tag=tag, local_name=name)
            self._bases[name] = name
        return name

    def request(
        self,
        item: ImageProduct,
        *,
        base: str = "official",
        rootfs: Path | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> BuildRequest:
        """The build request of ``item`` on the official base or on the Debian-made one."""
        if base not in BASES:
            raise ValueError(f"invalid base {base!r}: expected one of {', '.join(BASES)}")
        args = {"BASE_IMAGE": item.base_image}
        if base == "debian":
            if item.variant == "gpu":
                raise ValueError(
                    "the GPU trainer needs a CUDA base image, which the Debian-made base is not: "
                    "build trainer-cpu and sync with the Debian base, trainer-gpu with the official one"
                )
            if rootfs is None:
                raise ValueError("base 'debian' needs the root file system made by `make images-base`")
            tensorflow = item.repository == TRAINER_REPOSITORY
            args["BASE_IMAGE"] = self.local_tensorflow(rootfs) if tensorflow else self.local_base(rootfs)
        return BuildRequest(
            context=Path(self.trainer_dir),
            repository=item.repository,
            tags=item.tags(),
            dockerfile=item.dockerfile,
            build_args=args,
            labels=dict(labels or {}),
        )

    def build(self, item: ImageProduct, request: BuildRequest, target: PushTarget | None = None) -> str:
        """Build ``request`` into the local store and run the image's check command in it."""
        local = self.builder.build(request, target, local_tag=item.name + self.local_suffix)
        if item.check:
            self.log(f"checking {local}: {' '.join(item.check)}")
            # the check's output (a --help page) tells nothing when it passes; a failure carries its last lines
            self.builder.run_in_image(local, item.check, what=f"the check of {item.name}", quiet=True)
        return local

    def layout(self, item: ImageProduct, local: str) -> tuple[Path, str]:
        """The OCI layout holding ``local``, written when the local image changed since the last export."""
        image_id = self.builder.image_id(local)
        if image_id is None:
            raise ValueError(f"no local image {local!r}: build it first")
        layout = self.layouts / (item.name + self.local_suffix)
        with _locked(self.layouts / f"{item.name}{self.local_suffix}.lock"):
            stamp = layout / "kubetrain-image-id"
            if not (stamp.exists() and stamp.read_text().strip() == image_id):
                shutil.rmtree(layout, ignore_errors=True)
                self.builder.export_layout(local, layout, item.name)
                stamp.write_text(image_id + "\n")
        return layout, item.name

    def push(self, item: ImageProduct, local: str, target: PushTarget, tag: str = "latest") -> PublishedImage:
        """Push ``local`` with every tag of release ``tag``; the digest is the same for each."""
        layout, ref = self.layout(item, local)
        tags = item.tags(tag)
        digests = {self.builder.push_layout(layout, ref, target, t) for t in tags}
        if len(digests) != 1:
            raise RuntimeError(
                f"the tags {', '.join(tags)} of {target.name} got different digests: {sorted(digests)}"
            )
        user = str(self.builder.image_config(local).get("config", {}).get("User", ""))
        return PublishedImage(item.name, item.repository, target.registry, digests.pop(), tags, local, user)

    def publish(
        self,
        items: Sequence[ImageProduct],
        target_for: Callable[[ImageProduct], PushTarget],
        *,
        tag: str = "latest",
        base: str = "official",
        rootfs: Path | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> list[PublishedImage]:
        """Build and check every image first, then push them: a broken image stops the release whole."""
        built = []
        for item in items:
            target = target_for(item)
            built.append(
                (
                    item,
                    target,
                    self.build(item, self.request(item, base=base, rootfs=rootfs, labels=labels), target),
                )
            )
        return [self.push(item, local, target, tag) for item, target, local in built]
