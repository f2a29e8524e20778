"""Deleting a multi-worker job's objects: Service, Jobs or custom resources, and with them their pods."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)


def _body() -> Any:
    from kubernetes.client import V1DeleteOptions

    # Background: the object goes at once, the garbage collector (or the Job controller) deletes its pods.
    return V1DeleteOptions(propagation_policy="Background")


def delete_sync(
    hook: Any, namespace: str, resources: Sequence[Sequence[str]], logger: Any = log
) -> list[str]:
    """Delete every resource (``[api_version, kind, plural, name]``) that still exists; return what was deleted."""
    from kubernetes.client.rest import ApiException

    deleted = []
    for api_version, kind, plural, name in reversed([tuple(r) for r in resources]):
        try:
            if api_version == "v1" and kind == "Service":
                hook.core_v1_client.delete_namespaced_service(name, namespace)
            elif api_version == "batch/v1" and kind == "Job":
                hook.batch_v1_client.delete_namespaced_job(name, namespace, body=_body())
            else:
                group, _, version = api_version.rpartition("/")
                hook.custom_object_client.delete_namespaced_custom_object(
                    group, version, namespace, plural, name, body=_body()
                )
        except ApiException as exc:
            if exc.status != 404:
                raise
            continue
        deleted.append(f"{kind} {name}")
    if deleted:
        logger.info("Deleted %s in namespace %s", ", ".join(deleted), namespace)
    return deleted


async def delete_async(
    hook: Any, namespace: str, resources: Sequence[Sequence[str]], logger: Any = log
) -> None:
    """:func:`delete_sync` for a trigger (the provider's async hook)."""
    from kubernetes_asyncio import client as aclient

    async with hook.get_conn() as conn:
        options = aclient.V1DeleteOptions(propagation_policy="Background")
        for api_version, kind, plural, name in reversed([tuple(r) for r in resources]):
            try:
                if api_version == "v1" and kind == "Service":
                    await aclient.CoreV1Api(conn).delete_namespaced_service(name, namespace)
                elif api_version == "batch/v1" and kind == "Job":
                    await aclient.BatchV1Api(conn).delete_namespaced_job(name, namespace, body=options)
                else:
                    group, _, version = api_version.rpartition("/")
                    await aclient.CustomObjectsApi(conn).delete_namespaced_custom_object(
                        group, version, namespace, plural, name, body=options
                    )
                logger.info("Deleted %s %s in namespace %s", kind, name, namespace)
            except aclient.ApiException as exc:
                if exc.status != 404:
                    logger.exception("Cannot delete %s %s", kind, name)
