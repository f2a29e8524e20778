"""The triggerer's own access, reviewed from the triggerer: the preflight's second half.

A deferred task's trigger talks to the cluster from the triggerer, under the triggerer's identity
(with the official Helm chart, its service account ``airflow-triggerer``), not the worker's. Only
that process can ask the API what it may do, so the preflight DAG defers one task to this trigger,
which sends a SelfSubjectAccessReview for everything kubetrain's triggers do and yields the refused
ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook
from airflow.triggers.base import BaseTrigger, TriggerEvent


class AccessReviewTrigger(BaseTrigger):
    """Review ``attributes`` (SelfSubjectAccessReview resourceAttributes) as the triggerer's identity.

    :param attributes: the resourceAttributes to review.
    :param kubernetes_conn_id: the cluster's connection (in the triggerer: with ``in_cluster``, its service account).
    :param config_file: a kubeconfig path to use instead, read in the triggerer.
    """

    def __init__(
        self,
        *,
        attributes: list[dict[str, str]],
        kubernetes_conn_id: str = "kubernetes_default",
        config_file: str | None = None,
    ) -> None:
        super().__init__()
        self.attributes = attributes
        self.kubernetes_conn_id = kubernetes_conn_id
        self.config_file = config_file

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "kubetrain.triggers.access.AccessReviewTrigger",
            {
                "attributes": self.attributes,
                "kubernetes_conn_id": self.kubernetes_conn_id,
                "config_file": self.config_file,
            },
        )

    @contextlib.asynccontextmanager
    async def api_client(self):
        """The connection's API client, or one of ``config_file`` (which replaces the connection entirely)."""
        if self.config_file:
            from kubernetes_asyncio import config

            client = await config.new_client_from_config(config_file=self.config_file)
            try:
                yield client
            finally:
                await client.close()
        else:
            async with AsyncKubernetesHook(conn_id=self.kubernetes_conn_id).get_conn() as client:
                yield client

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from kubernetes_asyncio import client as aclient

        refused: list[dict[str, str]] = []
        try:
            async with self.api_client() as conn:
                api = aclient.AuthorizationV1Api(conn)
                for attrs in self.attributes:
                    # V1ResourceAttributes' text fields by name (namespace, verb, group, resource, ...)
                    given: dict[str, Any] = {k: v for k, v in attrs.items() if v}
                    body = aclient.V1SelfSubjectAccessReview(
                        spec=aclient.V1SelfSubjectAccessReviewSpec(
                            resource_attributes=aclient.V1ResourceAttributes(**given)
                        )
                    )
                    review = await api.create_self_subject_access_review(body)
                    if not review.status.allowed:
                        refused.append(attrs)
        except Exception as exc:  # noqa: BLE001 - the task reports it as one line
            yield TriggerEvent(
                {
                    "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                }
            )
            return
        yield TriggerEvent({"refused": refused, "total": len(self.attributes)})
