"""The build_trainer_image DAG's task bodies: plan the trainer image update and publish the result.

``plan_trainer_image`` compares ``trainer/`` with what was published last (the Variable
``kubetrain_trainer_image_source``) and the registry; ``publish_trainer_image`` points the
Variable ``kubetrain_trainer_image`` at the new image by digest and moves ``latest``. They read
and write Airflow Variables, so they run inside tasks.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kubetrain.hooks.registry import RegistryHook

IMAGE_VARIABLE = "kubetrain_trainer_image"
SOURCE_VARIABLE = "kubetrain_trainer_image_source"


def plan_trainer_image(
    trainer_dir: str, repository: str, *, registry_conn_id: str, mode: str = "auto", force: bool = False
) -> dict[str, Any] | bool:
    """Plan the trainer image update; False (short-circuit) when the code is unchanged.

    :param trainer_dir: the trainer package on the worker.
    :param repository: the image repository in the registry.
    :param registry_conn_id: connection of the registry.
    :param mode: 'auto', 'full' or 'append'.
    :param force: build even when nothing changed.
    """
    import json
    import logging

    from airflow.sdk import Variable

    from kubetrain.imagebuild.plan import base_tag, plan_image

    log = logging.getLogger(__name__)
    raw = Variable.get(SOURCE_VARIABLE, default=None)
    previous = json.loads(raw) if raw else None
    with RegistryHook(registry_conn_id).get_conn() as client:
        base_exists = client.manifest_digest(repository, base_tag(Path(trainer_dir))) is not None
    plan = plan_image(Path(trainer_dir), previous=previous, base_exists=base_exists, mode=mode, force=force)
    log.info("image plan: %s (%s)", plan.action, plan.reason)
    return False if plan.action == "skip" else plan.as_dict()


def publish_trainer_image(plan: dict[str, Any], built: dict[str, Any], *, registry_conn_id: str) -> dict[str, Any]:
    """Record the new image for the training DAGs: Variable by digest, ``latest`` tag, source hashes.

    :param plan: what :func:`plan_trainer_image` returned.
    :param built: the XCom of the build or append task that ran.
    :param registry_conn_id: connection of the registry.
    """
    import json

    from airflow.sdk import Variable

    from kubetrain.imagebuild.reference import parse_reference

    ref = parse_reference(built["reference"])
    with RegistryHook(registry_conn_id).get_conn() as client:
        client.tag(ref.repository, ref.digest, ["latest"])
    Variable.set(IMAGE_VARIABLE, built["reference"])
    record = {
        "reference": built["reference"],
        "action": plan["action"],
        "code_hash": plan["code_hash"],
        "deps_hash": plan["deps_hash"],
        "revision": plan.get("revision"),
        "published_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    Variable.set(SOURCE_VARIABLE, json.dumps(record))
    return record
