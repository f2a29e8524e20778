"""Build an image of yours and push it to the dev stack's registry, its FROM images pulled through the stack's mirror.

    make stack-up
    .venv/bin/python -m include.devstack.build docs/examples/keras_model examples/keras-model:1

The dev stack's kubelet runs only images that a registry serves, as a cluster's does: this is the
dev stack's `buildah bud` + `buildah push` (docs/extending.md), with public bases such as
``tensorflow/tensorflow:2.21.0`` coming from the registry mirror (include/devstack/mirror.py),
since this machine reaches no public registry. Prints the pushed image by digest.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def build_and_push(
    context: Path,
    name: str,
    *,
    registry: str,
    mirror: str,
    dockerfile: str = "Dockerfile",
    log=lambda line: None,
) -> str:
    """Build ``context`` as ``<registry>/<name>`` and push it; returns ``<registry>/<repository>@<digest>``."""
    sys.path.insert(0, str(REPO / "plugins"))
    from kubetrain.imagebuild.buildah import BuildahBuilder
    from kubetrain.imagebuild.builders import BuildRequest, PushTarget

    repository, _, tag = name.partition(":")
    tag = tag or "latest"
    builder = BuildahBuilder(
        REPO / ".tools" / "buildah", storage_driver="auto", mirror=mirror, mirror_insecure=True, log=log
    )
    target = PushTarget(registry, repository, insecure=True)
    request = BuildRequest(context=context, repository=repository, tags=(tag,), dockerfile=dockerfile)
    local = builder.build(request, target, local_tag=f"devstack-{tag}")
    digest = builder.push(local, target, tag)
    return f"{registry}/{repository}@{digest}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m include.devstack.build", description=__doc__.splitlines()[0]
    )
    parser.add_argument("context", type=Path, help="the build context (the folder of the Dockerfile)")
    parser.add_argument(
        "name", help="repository[:tag] in the dev stack's registry, e.g. examples/keras-model:1"
    )
    parser.add_argument("--file", default="Dockerfile", help="the Dockerfile, relative to the context")
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=Path(os.environ.get("KUBETRAIN_STACK_DIR") or REPO / ".stack"),
        help="the dev stack (default: $KUBETRAIN_STACK_DIR, which .stack/env sets, else .stack)",
    )
    args = parser.parse_args(argv)
    from include.devstack.stack import Stack, StackError

    try:
        state = Stack(args.state_dir.resolve()).load_state()
        print(
            build_and_push(
                args.context.resolve(),
                args.name,
                registry=state["registry"],
                mirror=state["mirror"],
                dockerfile=args.file,
                log=lambda line: print(line, file=sys.stderr),
            )
        )
    except (StackError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - a failed build: its message, not a traceback
        if type(exc).__name__ != "BuildError":
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
