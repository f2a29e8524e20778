"""``python -m kubetrain.imagebuild.release``: build kubetrain's images, check them and push them (``make images``).

    PYTHONPATH=plugins python -m kubetrain.imagebuild.release --tag v1
    PYTHONPATH=plugins python -m kubetrain.imagebuild.release --base debian --rootfs .tools/images/bookworm-python.tar \\
        --images trainer-cpu,sync
    PYTHONPATH=plugins python -m kubetrain.imagebuild.release --list     # the names it would push, nothing built

The registry is the connection ``kubetrain_registry_default`` when it is defined (host,
credentials, TLS settings), else the ``registry`` setting (``KUBETRAIN_REGISTRY``); a registry
on a loopback address is spoken to over plain HTTP, as Docker and containerd do. Prints one
JSON object per pushed image: name, digest, reference by digest and tags.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

from kubetrain.imagebuild.builders import BuildError, PushTarget
from kubetrain.imagebuild.products import BASES, PRODUCTS, ImagePublisher, product

LOOPBACK = ("localhost", "127.0.0.1", "[::1]")
# Build output that tells a reader nothing: pip's download progress bars (rich's "━━━╸ 4.4/4.4 MB 15.3 MB/s eta
# 0:00:00", the older "|████| 4.4 MB") and its notices, and its warning about running as root (the images install
# into their system Python on purpose, as python:3.11-slim does). A failed step's error still quotes its last lines.
PIP_NOISE = re.compile(
    r"^\s*(?:[━╸╺╾╼─]+\s+[\d.]+/[\d.]+ [kMG]?B\b|\|[█▉▊▋▌▍▎▏ ]*\|)"
    r"|^WARNING: Running pip as the 'root' user"
    r"|^\[notice\] "
)


def worth_showing(line: str) -> bool:
    """Whether a line of the build's output goes to the terminal (pip's progress and warnings do not)."""
    return PIP_NOISE.search(line) is None


def registry_target(registry: str | None, conn_id: str, authdir: Path, insecure: bool | None) -> PushTarget:
    """Where images go: the registry connection when it exists, else ``registry`` (or the setting)."""
    from kubetrain.hooks.registry import RegistryHook

    if not registry:
        hook = RegistryHook(conn_id)
        try:
            settings = hook.settings
        except Exception as exc:  # noqa: BLE001 - not defined: fall back to the setting
            if type(exc).__name__ != "AirflowNotFoundException":
                raise
        else:
            authfile = hook.write_authfile(authdir / "auth.json") if settings.username else None
            return PushTarget(
                settings.registry,
                "",
                insecure=settings.insecure if insecure is None else insecure,
                ca_bundle=settings.ca_bundle,
                tls_verify=settings.tls_verify,
                authfile=authfile,
            )
        from kubetrain import settings as kubetrain_settings

        registry = kubetrain_settings.get("registry")
    host = registry.split(":")[0] if not registry.startswith("[") else registry.split("]")[0] + "]"
    return PushTarget(registry, "", insecure=(host in LOOPBACK) if insecure is None else insecure)


def list_images(images: str, tag: str, registry: str | None, conn_id: str) -> int:
    """Print ``{"name", "references"}`` per image: where a release of ``tag`` would put it."""
    try:
        items = [product(name.strip()) for name in images.split(",") if name.strip()]
        with tempfile.TemporaryDirectory(prefix="kubetrain-auth-") as tmp:
            host = registry_target(registry, conn_id, Path(tmp), None).registry
        for item in items:
            refs = [f"{host}/{item.repository}:{t}" for t in item.tags(tag)]
            print(json.dumps({"name": item.name, "references": refs}))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kubetrain.imagebuild.release",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--images", default=",".join(PRODUCTS), help="comma-separated: %(default)s")
    parser.add_argument("--tag", default="latest", help="release tag (default %(default)s)")
    parser.add_argument(
        "--base",
        choices=BASES,
        default="official",
        help="official bases (TensorFlow, python:3.11-slim) or the Debian-made one",
    )
    parser.add_argument("--rootfs", type=Path, help="root file system tarball of the Debian-made base")
    parser.add_argument(
        "--registry", help="host[:port]; default: the registry connection, else KUBETRAIN_REGISTRY"
    )
    parser.add_argument("--registry-conn-id", default="kubetrain_registry_default")
    parser.add_argument(
        "--insecure",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="plain HTTP (default: only for loopback registries or as the connection says)",
    )
    parser.add_argument("--trainer-dir", type=Path, default=Path("trainer"))
    parser.add_argument(
        "--storage-root",
        type=Path,
        default=Path(".tools/buildah"),
        help="buildah's store (layer cache) (default %(default)s)",
    )
    parser.add_argument("--storage-driver", default="auto", choices=("auto", "vfs", "overlay"))
    parser.add_argument(
        "--layouts",
        type=Path,
        default=Path(".tools/images/oci"),
        help="OCI layouts kept between pushes (default %(default)s)",
    )
    parser.add_argument("--revision", help="source revision recorded in the images' labels")
    parser.add_argument(
        "--list",
        action="store_true",
        help="print the references each image would be pushed as; build nothing",
    )
    args = parser.parse_args(argv)
    if args.list:
        return list_images(args.images, args.tag, args.registry, args.registry_conn_id)

    from kubetrain.imagebuild.buildah import BuildahBuilder

    try:
        items = [product(name.strip()) for name in args.images.split(",") if name.strip()]
        builder = BuildahBuilder(
            args.storage_root,
            storage_driver=args.storage_driver,
            log=lambda line: print(line, file=sys.stderr, flush=True) if worth_showing(line) else None,
        )
        publisher = ImagePublisher(builder, args.trainer_dir, args.layouts, log=builder.log)
        labels = {"org.opencontainers.image.revision": args.revision} if args.revision else {}
        with tempfile.TemporaryDirectory(prefix="kubetrain-auth-") as tmp:
            target = registry_target(args.registry, args.registry_conn_id, Path(tmp), args.insecure)

            def target_for(item):
                from dataclasses import replace

                return replace(target, repository=item.repository)

            published = publisher.publish(
                items, target_for, tag=args.tag, base=args.base, rootfs=args.rootfs, labels=labels
            )
    except (ValueError, BuildError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for image in published:
        print(json.dumps(image.as_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
