"""`make stack-images`: build and push the dev stack's training images only when their inputs changed.

    python -m include.stack_images current ARGS   # exit 0, saying so, when the registry holds today's images
    python -m include.stack_images record ARGS    # after a build and push: remember its inputs and digests

ARGS are the release's (``--images trainer-cpu,sync --tag latest --base debian --rootfs TAR
--revision REV``). The inputs are the trainer directory as the build sees it
(:func:`kubetrain.imagebuild.layer.tree_hash`: sources, Dockerfiles, requirements), the
Debian-made base (its tarball's size and time), the release's arguments and the revision the
images' labels record. ``<stack dir>/images.json`` keeps them with the digests pushed. The images
are current when the inputs are the same and the registry still serves those digests under their
tags: a registry emptied, or pushed to by anyone else since, gets a build again.

Runs in the Airflow environment (.venv) with the dev stack's env (``. .stack/env``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "plugins"))


def inputs_key(args: argparse.Namespace) -> str:
    """The identity of what a build with ``args`` would push."""
    from kubetrain.imagebuild.layer import tree_hash

    rootfs = Path(args.rootfs)
    base = f"{rootfs.stat().st_size}:{rootfs.stat().st_mtime_ns}" if rootfs.exists() else "none"
    parts = {
        "trainer": tree_hash(REPO / "trainer"),
        "rootfs": base,
        "images": args.images,
        "tag": args.tag,
        "base": args.base,
        "revision": args.revision,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def registry_digests(registry: str, images: str, tag: str) -> dict[str, str | None]:
    """``{"<repository>:<tag>": digest or None}`` for every tag the release of ``images`` pushes."""
    from kubetrain.imagebuild.oci import RegistryClient
    from kubetrain.imagebuild.products import product

    found: dict[str, str | None] = {}
    with RegistryClient(registry, insecure=True, timeout=30) as client:
        for name in filter(None, (n.strip() for n in images.split(","))):
            item = product(name)
            for each in item.tags(tag):
                found[f"{item.repository}:{each}"] = client.manifest_digest(item.repository, each)
    return found


def stamp_path() -> Path:
    return Path(os.environ.get("KUBETRAIN_STACK_DIR") or REPO / ".stack") / "images.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m include.stack_images", description=__doc__.splitlines()[0]
    )
    parser.add_argument("action", choices=("current", "record"))
    parser.add_argument("--images", required=True)
    parser.add_argument("--tag", required=True)
    parser.add_argument("--base", required=True)
    parser.add_argument("--rootfs", required=True)
    parser.add_argument("--revision", default="")
    args = parser.parse_args(argv)
    registry = os.environ.get("KUBETRAIN_REGISTRY")
    if not registry:
        print(
            "error: KUBETRAIN_REGISTRY is not set: source the dev stack's env (`. .stack/env`)",
            file=sys.stderr,
        )
        return 2
    key = inputs_key(args)
    path = stamp_path()
    try:
        digests = registry_digests(registry, args.images, args.tag)
    except Exception as exc:  # noqa: BLE001 - for `current`, an unreachable registry means: build
        if args.action == "record":
            raise
        print(f"training images: {registry} did not answer ({exc}): building them", flush=True)
        return 1
    if args.action == "record":
        missing = sorted(ref for ref, digest in digests.items() if digest is None)
        if missing:
            print(f"error: {registry} lacks {', '.join(missing)} after the push", file=sys.stderr)
            return 1
        path.write_text(
            json.dumps({"registry": registry, "inputs": key, "digests": digests}, indent=2) + "\n"
        )
        return 0
    try:
        stamp = json.loads(path.read_text())
    except (OSError, ValueError):
        return 1
    if stamp.get("registry") != registry or stamp.get("inputs") != key or stamp.get("digests") != digests:
        return 1
    print(
        f"training images: unchanged since their last build, and in {registry} "
        f"({', '.join(sorted(digests))}): not built or pushed again",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
