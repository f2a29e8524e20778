"""The build_trainer_image DAG's task bodies: plan the trainer and sync image updates, publish both.

``plan_images`` compares ``trainer/`` with what was published last (the Variables
``kubetrain_trainer_image_source`` and ``kubetrain_sync_image_source``) and with the registry;
``publish_images`` checks that both images are complete in the registry, moves their release
tags (the names of :mod:`kubetrain.imagebuild.products`: ``latest`` and ``latest-gpu`` or
``latest-cpu`` for the trainer, ``latest`` for the sync image) and only then points the Variables
``kubetrain_trainer_image`` and ``kubetrain_sync_image`` at them by digest. They read and write
Airflow Variables, so they run inside tasks.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kubetrain import settings
from kubetrain.hooks.registry import RegistryHook
from kubetrain.imagebuild.products import (
    SYNC,
    SYNC_REPOSITORY,
    TRAINER_CPU,
    TRAINER_GPU,
    TRAINER_REPOSITORY,
    ImageProduct,
)

IMAGE_VARIABLE = "kubetrain_trainer_image"
SYNC_IMAGE_VARIABLE = "kubetrain_sync_image"
SOURCE_VARIABLE = "kubetrain_trainer_image_source"
SYNC_SOURCE_VARIABLE = "kubetrain_sync_image_source"
BUILD_ARGS_VARIABLE = "kubetrain_image_build_args"
TRAINER_REPOSITORY_VARIABLE = "kubetrain_trainer_repository"
SYNC_REPOSITORY_VARIABLE = "kubetrain_sync_repository"
TRAINERS: dict[str, ImageProduct] = {"gpu": TRAINER_GPU, "cpu": TRAINER_CPU}

log = logging.getLogger(__name__)


def _json_variable(name: str) -> Any:
    from airflow.sdk import Variable

    raw = Variable.get(name, default=None)
    if not raw:
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"Variable {name} is not JSON ({exc}): {raw[:200]!r}") from None


def build_args(product: ImageProduct, overrides: Mapping[str, Any] | None) -> dict[str, str]:
    """``BASE_IMAGE`` of ``product``, then what ``kubetrain_image_build_args[product.name]`` sets.

    :param overrides: the Variable's value: ``{"trainer-gpu": {...}, "trainer-cpu": {...}, "sync": {...}}``.
    """
    overrides = overrides or {}
    if not isinstance(overrides, Mapping) or not all(isinstance(v, Mapping) for v in overrides.values()):
        raise ValueError(
            f"Variable {BUILD_ARGS_VARIABLE} must map image names to build arguments, e.g. "
            f'{{"sync": {{"BASE_IMAGE": "python:3.11-slim"}}}}; got {overrides!r}'
        )
    unknown = set(overrides) - {p.name for p in (*TRAINERS.values(), SYNC)}
    if unknown:
        raise ValueError(
            f"Variable {BUILD_ARGS_VARIABLE} names unknown image(s) {', '.join(sorted(unknown))}: "
            "expected trainer-gpu, trainer-cpu or sync"
        )
    return {
        "BASE_IMAGE": product.base_image,
        **{k: str(v) for k, v in overrides.get(product.name, {}).items()},
    }


def plan_images(
    trainer_dir: str,
    *,
    registry_conn_id: str,
    trainer_repository: str | None = None,
    sync_repository: str | None = None,
    variant: str | None = None,
    mode: str = "auto",
    force: bool = False,
) -> dict[str, Any] | bool:
    """Plan both image updates; False (short-circuit) when neither image needs anything.

    :param trainer_dir: the trainer package on the worker (the build context of both images).
    :param registry_conn_id: connection of the registry.
    :param trainer_repository: the trainer's repository in the registry (default: the Variable
        ``kubetrain_trainer_repository``, else ``kubetrain/trainer``).
    :param sync_repository: the sync image's repository (default: the Variable ``kubetrain_sync_repository``,
        else ``kubetrain/sync``).
    :param variant: ``gpu`` or ``cpu``: the trainer variant to build and publish (default: the
        ``trainer_variant`` setting).
    :param mode: 'auto', 'full' or 'append' for the trainer.
    :param force: build even when nothing changed.
    """
    from airflow.sdk import Variable

    from kubetrain.imagebuild.plan import base_tag, check_variant, plan_image, plan_sync_image, sync_tag

    trainer_repository = trainer_repository or Variable.get(
        TRAINER_REPOSITORY_VARIABLE, default=TRAINER_REPOSITORY
    )
    sync_repository = sync_repository or Variable.get(SYNC_REPOSITORY_VARIABLE, default=SYNC_REPOSITORY)
    variant = variant or settings.get("trainer_variant") or "gpu"
    trainer_dir_path = Path(trainer_dir)
    if not trainer_dir_path.is_dir():
        raise ValueError(f"trainer directory {trainer_dir!r} does not exist")
    trainer = TRAINERS[check_variant(variant)]
    overrides = _json_variable(BUILD_ARGS_VARIABLE)
    trainer_args, sync_args = build_args(trainer, overrides), build_args(SYNC, overrides)
    previous = _json_variable(SOURCE_VARIABLE)
    previous_sync = _json_variable(SYNC_SOURCE_VARIABLE)
    hook = RegistryHook(registry_conn_id)
    with hook.get_conn() as client:
        base_exists = (
            client.manifest_digest(trainer_repository, base_tag(trainer_dir_path, variant, trainer_args))
            is not None
        )
        existing_sync = client.manifest_digest(sync_repository, sync_tag(trainer_dir_path, sync_args))
    trainer_plan = plan_image(
        trainer_dir_path,
        previous=previous,
        base_exists=base_exists,
        mode=mode,
        force=force,
        variant=variant,
        build_args=trainer_args,
    )
    sync_plan = plan_sync_image(
        trainer_dir_path,
        previous=previous_sync,
        existing_digest=existing_sync,
        force=force,
        build_args=sync_args,
    )
    log.info("trainer image (%s): %s (%s)", variant, trainer_plan.action, trainer_plan.reason)
    log.info("sync image: %s (%s)", sync_plan.action, sync_plan.reason)
    if trainer_plan.action == "skip" and sync_plan.action == "skip":
        return False
    sync = sync_plan.as_dict()
    if sync_plan.action == "reuse":
        sync["reference"] = f"{hook.registry}/{sync_repository}@{sync_plan.digest}"
    elif sync_plan.action == "skip":
        sync["reference"] = previous_sync["reference"]
    trainer_dict = trainer_plan.as_dict()
    if trainer_plan.action == "skip":
        trainer_dict["reference"] = previous["reference"]
    return {
        "trainer": {**trainer_dict, "repository": trainer_repository, "build_args": trainer_args},
        "sync": {**sync, "repository": sync_repository, "build_args": sync_args},
    }


def image_build_tasks(plan: dict[str, Any]) -> list[str]:
    """The DAG's tasks that ``plan`` (of :func:`plan_images`) needs, publish always last."""
    tasks = {"full": ["build_full"], "append": ["append_code"]}.get(plan["trainer"]["action"], [])
    if plan["sync"]["action"] == "build":
        tasks.append("build_sync")
    return [*tasks, "publish"]


def publish_images(
    plan: dict[str, Any],
    built_trainer: dict[str, Any] | None,
    built_sync: dict[str, Any] | None,
    *,
    registry_conn_id: str,
) -> dict[str, Any]:
    """Publish both images once both are complete in the registry: release tags, Variables by digest.

    Nothing is published when either image is missing: the Variables keep naming the images of
    the last complete run.

    :param plan: what :func:`plan_images` returned.
    :param built_trainer: the XCom of the trainer's build or append task, None when it did not run.
    :param built_sync: the XCom of the sync image's build task, None when it did not run.
    :param registry_conn_id: connection of the registry.
    :raises RuntimeError: an image that should be there is not in the registry.
    """
    from airflow.sdk import Variable

    from kubetrain.imagebuild.reference import parse_reference

    trainer_ref = _reference(plan["trainer"], built_trainer, "trainer")
    sync_ref = _reference(plan["sync"], built_sync, "sync")
    product = TRAINERS[plan["trainer"]["variant"]]
    release = settings.get("image_tag") or "latest"
    with RegistryHook(registry_conn_id).get_conn() as client:
        refs = {name: parse_reference(ref) for name, ref in (("trainer", trainer_ref), ("sync", sync_ref))}
        repositories = {name: client.relative(ref) for name, ref in refs.items()}
        digests: dict[str, str] = {}
        for name, ref in refs.items():
            if ref.digest is None:
                raise RuntimeError(
                    f"the {name} image {ref} is not pinned to a digest: expected a reference ending in "
                    "@sha256:<digest>, as the build tasks return"
                )
            digests[name] = ref.digest
            if client.manifest_digest(repositories[name], ref.digest) is None:
                raise RuntimeError(
                    f"the {name} image {ref} is not in the registry: nothing is published, the "
                    "Variables keep the images of the last complete run"
                )
        client.tag(repositories["trainer"], digests["trainer"], list(product.tags(release)))
        client.tag(repositories["sync"], digests["sync"], list(SYNC.tags(release)))
    Variable.set(IMAGE_VARIABLE, trainer_ref)
    Variable.set(SYNC_IMAGE_VARIABLE, sync_ref)
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    trainer = plan["trainer"]
    record = {
        "reference": trainer_ref,
        "action": trainer["action"],
        "variant": trainer["variant"],
        "code_hash": trainer["code_hash"],
        "deps_hash": trainer["deps_hash"],
        "revision": trainer.get("revision"),
        "tags": list(product.tags(release)),
        "published_at": now,
    }
    sync_record = {
        "reference": sync_ref,
        "action": plan["sync"]["action"],
        "source_hash": plan["sync"]["source_hash"],
        "tags": list(SYNC.tags(release)),
        "published_at": now,
    }
    Variable.set(SOURCE_VARIABLE, json.dumps(record))
    Variable.set(SYNC_SOURCE_VARIABLE, json.dumps(sync_record))
    log.info("published %s and %s", trainer_ref, sync_ref)
    return {"trainer": record, "sync": sync_record}


def _reference(planned: dict[str, Any], built: dict[str, Any] | None, name: str) -> str:
    if built:
        return built["reference"]
    if planned.get("reference"):
        return planned["reference"]
    raise RuntimeError(f"the {name} image was to be built ({planned['action']}) but its task left no image")
