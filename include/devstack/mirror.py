"""The dev stack's registry mirror: public images, built here from Debian packages, served under their public names.

This machine reaches no public registry, so the images that pods name by their public names
(busybox for tests and ``kubectl run``, alpine for the provider's xcom sidecar, python, and
TensorFlow for docs/extending.md's example) are made from Debian packages and PyPI, and a
read-only registry serves them as a node's ``registries.conf`` mirror for docker.io and quay.io
would. The local kubelet pulls from it like from any registry (include/devstack/KUBEAPI.md).

=================================  ==========================================================
public name                        stand-in
=================================  ==========================================================
``busybox:1.36``, ``1.37.0``,       Debian's busybox-static: ``/bin/busybox`` and its applets,
``latest``                          ``/etc/passwd`` and ``/etc/group``, CMD ``sh``
``alpine:3.24.2``, ``3``,           the same tree, CMD ``/bin/sh`` (the provider's xcom sidecar
``latest``                          needs only ``sh``, ``sleep``, ``kill`` and ``cat``)
``python:3.11``, ``3.11-slim``      Debian bookworm's Python 3.11 and pip (``make images-base``)
``tensorflow/tensorflow:2.21.0``    the same with TensorFlow's CPU wheel (trainer/Dockerfile.tensorflow)
``quay.io/buildah/stable:v1.41``    the same with Debian's buildah, set up for rootless builds as the
                                    official image is (mirror_images/buildah.Dockerfile)
=================================  ==========================================================

    python -m include.devstack.mirror build    # `make mirror`: build the stand-ins, fill .tools/mirror
    python -m include.devstack.mirror build --only busybox,alpine,python   # what the demos' stack needs
    python -m include.devstack.mirror base     # only TensorFlow on the image base, in the builder's store
    python -m include.devstack.mirror list     # the public names it serves

The demos run none of the public images, but the stack starts only with a mirror, and busybox is
what README's first pod runs: `make demo` and `make airflow` build the cheap stand-ins (``DEMO``);
the test suite and `make stack-up` (docs/extending.md builds FROM tensorflow) all of them (the
buildah stand-in alone is minutes of apt inside a build). ``base`` builds the TensorFlow
stand-in's image without pushing it: the CPU trainer image is built on it, so the demos build it
beside the rest of their set-up.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MIRROR_DIR = REPO / ".tools" / "mirror"
BUSYBOX = Path("/bin/busybox")
ROOTFS = REPO / ".tools" / "images" / "bookworm-python.tar"
TITLE = {"org.opencontainers.image.title": "kubetrain dev stack stand-in, built from Debian packages"}
# public name -> which stand-in
IMAGES = {
    "docker.io/library/busybox:latest": "busybox",
    "docker.io/library/busybox:1.36": "busybox",
    "docker.io/library/busybox:1.37.0": "busybox",
    "docker.io/library/alpine:latest": "alpine",
    "docker.io/library/alpine:3": "alpine",
    "docker.io/library/alpine:3.24.2": "alpine",
    "docker.io/library/python:3.11": "python",
    "docker.io/library/python:3.11-slim": "python",
    "docker.io/tensorflow/tensorflow:2.21.0": "tensorflow",
    "quay.io/buildah/stable:v1.41": "buildah",
}
STANDINS = ("busybox", "alpine", "python", "tensorflow", "buildah")
# what `make demo` builds: a stack can start, README's first pod (busybox) runs
DEMO = ("busybox", "alpine", "python")


def busybox_tree(out: Path) -> Path:
    """A root file system tarball like the busybox image's: the static binary, its applets, passwd and group."""
    applets = subprocess.run(
        [str(BUSYBOX), "--list-full"], capture_output=True, text=True, check=True
    ).stdout.split()
    with tarfile.open(out, "w") as tar:

        def add_dir(name: str, mode: int = 0o755) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)

        def add_file(name: str, data: bytes, mode: int = 0o644) -> None:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))

        for name in ("bin", "sbin", "usr", "usr/bin", "usr/sbin", "etc", "root", "home", "var", "var/spool"):
            add_dir(name, 0o700 if name == "root" else 0o755)
        add_dir("tmp", 0o1777)
        add_file("bin/busybox", BUSYBOX.read_bytes(), 0o755)
        for applet in applets:
            if applet != "bin/busybox":
                link = tarfile.TarInfo(applet)
                link.type, link.linkname = tarfile.LNKTYPE, "bin/busybox"
                tar.addfile(link)
        add_file(
            "etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/home:/bin/false\n"
        )
        add_file("etc/group", b"root:x:0:\nnogroup:x:65534:\n")
    return out


def build(log=print, only: tuple[str, ...] = STANDINS) -> dict[str, str]:
    """Build the stand-ins ``only`` (default: all) in the image builder's store and push them to the
    mirror's storage; {public name: digest} of what was pushed."""
    unknown = sorted(set(only) - set(STANDINS))
    if unknown or not only:
        raise ValueError(
            f"stand-ins {', '.join(unknown) or '(none)'}: expected some of {', '.join(STANDINS)}"
        )
    sys.path.insert(0, str(REPO / "plugins"))
    from include.devstack import registry
    from include.devstack.stack import free_port, wait_http
    from kubetrain.imagebuild.buildah import BuildahBuilder
    from kubetrain.imagebuild.builders import BuildRequest, PushTarget
    from kubetrain.imagebuild.products import ImagePublisher

    builder = BuildahBuilder(REPO / ".tools" / "buildah", storage_driver="auto", log=log)
    publisher = ImagePublisher(builder, REPO / "trainer", REPO / ".tools" / "images" / "oci", log=log)
    local: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="mirror-") as tmp:
        tree = busybox_tree(Path(tmp) / "busybox.tar")
        for name, cmd in (("busybox", ["sh"]), ("alpine", ["/bin/sh"])):
            if name not in only:
                continue
            ref = f"localhost/kubetrain/standin-{name}:latest"
            builder.import_rootfs(
                tree, ref, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, cmd=cmd, labels=TITLE
            )
            local[name] = ref
    if {"python", "buildah"} & set(only):
        local["python"] = publisher.local_base(ROOTFS)
    if "tensorflow" in only:
        local["tensorflow"] = publisher.local_tensorflow(ROOTFS)
    if "buildah" in only:
        local["buildah"] = builder.build(
            BuildRequest(
                context=Path(__file__).with_name("mirror_images"),
                repository="kubetrain/standin-buildah",
                tags=("latest",),
                dockerfile="buildah.Dockerfile",
                build_args={"BASE_IMAGE": local["python"]},
            ),
            local_tag="latest",
        )

    data = MIRROR_DIR / "data"
    port = free_port()
    argv = registry.command(MIRROR_DIR / "build", port, data_dir=data)
    digests = {}
    with open(MIRROR_DIR / "build.log", "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/v2/", 30, proc, MIRROR_DIR / "build.log")
        for public, which in IMAGES.items():
            if which not in only:
                continue
            path, _, tag = public.split("/", 1)[1].rpartition(
                ":"
            )  # served as a mirror serves it: no registry host
            target = PushTarget(f"127.0.0.1:{port}", path, insecure=True)
            digests[public] = builder.push(local[which], target, tag)
    finally:
        proc.terminate()
        proc.wait(10)
    # images.json (`make mirror`'s target) lists a mirror of every stand-in; demo.json one of DEMO's
    listing = "images.json" if set(only) == set(STANDINS) else "demo.json"
    (MIRROR_DIR / listing).write_text(json.dumps(digests, indent=2) + "\n")
    return digests


def tensorflow_base(log=print) -> str:
    """The TensorFlow stand-in's image in the builder's store, unpushed: the CPU trainer image's base."""
    sys.path.insert(0, str(REPO / "plugins"))
    from kubetrain.imagebuild.buildah import BuildahBuilder
    from kubetrain.imagebuild.products import ImagePublisher

    builder = BuildahBuilder(REPO / ".tools" / "buildah", storage_driver="auto", log=log)
    publisher = ImagePublisher(builder, REPO / "trainer", REPO / ".tools" / "images" / "oci", log=log)
    return publisher.local_tensorflow(ROOTFS)


def digests() -> dict[str, str]:
    """{public name: manifest digest} of what the mirror serves (written by :func:`build`)."""
    path = MIRROR_DIR / "images.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: run `make mirror`")
    return json.loads(path.read_text())


def pinned(name: str) -> str:
    """``name`` (e.g. ``python:3.11-slim``) pinned by the digest the mirror serves: ``python:3.11-slim@sha256:...``."""
    full = name if "/" in name.split(":")[0] and "." in name.split("/")[0] else f"docker.io/{name}"
    if full.count("/") == 1:
        full = full.replace("docker.io/", "docker.io/library/", 1)
    return f"{name}@{digests()[full]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m include.devstack.mirror", description=__doc__.splitlines()[0]
    )
    parser.add_argument("command", choices=["build", "base", "list"])
    parser.add_argument(
        "--only",
        default=",".join(STANDINS),
        help="build: the stand-ins to build, comma-separated (default: all, %(default)s)",
    )
    args = parser.parse_args(argv)
    only = tuple(name.strip() for name in args.only.split(",") if name.strip())
    unknown = sorted(set(only) - set(STANDINS))
    if unknown or not only:
        parser.error(f"--only {args.only!r}: expected stand-ins among {', '.join(STANDINS)}")
    if args.command == "list":
        for name in IMAGES:
            print(name)
        return 0
    if not ROOTFS.exists():
        print(f"error: {ROOTFS} is missing: run `make images-base`", file=sys.stderr)
        return 1
    if not shutil.which("buildah"):
        print("error: buildah is not installed: run `make setup`", file=sys.stderr)
        return 1
    os.environ.setdefault("TMPDIR", str(REPO / ".tools" / "buildah" / "tmp"))
    # the build's lines (buildah's steps) go to stdout: `make mirror` keeps them in its log and shows
    # the last one as its progress
    if args.command == "base":
        print(tensorflow_base(log=lambda line: print(line, flush=True)))
        return 0
    for name, digest in build(log=lambda line: print(line, flush=True), only=only).items():
        print(f"{name}  {digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
