"""The trigger that follows a deferred training pod: kubetrain's start-up phases, then the provider's wait."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from airflow.providers.cncf.kubernetes.triggers.pod import KubernetesPodTrigger
from airflow.triggers.base import TriggerEvent

from kubetrain.pod_startup import EVENT_KEY, STARTUP_FAILURES, PodStartup, failure_kind


class TrainingPodTrigger(KubernetesPodTrigger):
    """A :class:`KubernetesPodTrigger` that judges the pod's start-up with :class:`~kubetrain.pod_startup.PodStartup`.

    Scheduling, image pulls and stage-in each get their own budget; a pod that cannot start
    yields one ``timeout`` event whose ``kubetrain_startup`` names the failure class. Once
    the pod runs, the provider's trigger waits for its base container as usual.

    :param stage_in_timeout: seconds the stage-in container may run.
    :param unschedulable_grace: seconds an unschedulable pod waits for an autoscaler.
    :param stage_in_container: name of the stage-in init container.
    :param kwargs: KubernetesPodTrigger arguments.
    """

    def __init__(
        self,
        *,
        stage_in_timeout: float,
        unschedulable_grace: float,
        stage_in_container: str = "stage-in",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.stage_in_timeout = stage_in_timeout
        self.unschedulable_grace = unschedulable_grace
        self.stage_in_container = stage_in_container

    def serialize(self) -> tuple[str, dict[str, Any]]:
        _, kwargs = super().serialize()
        kwargs.update(
            stage_in_timeout=self.stage_in_timeout,
            unschedulable_grace=self.unschedulable_grace,
            stage_in_container=self.stage_in_container,
        )
        return f"{type(self).__module__}.{type(self).__qualname__}", kwargs

    def startup(self) -> PodStartup:
        return PodStartup(
            schedule_timeout=self.schedule_timeout,
            unschedulable_grace=self.unschedulable_grace,
            startup_timeout=self.startup_timeout,
            stage_in_timeout=self.stage_in_timeout,
            stage_in_container=self.stage_in_container,
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        startup = self.startup()
        try:
            while True:
                pod = await self.hook.get_pod(name=self.pod_name, namespace=self.pod_namespace)
                events = []
                if startup.needs_events(pod):
                    listing = await self.hook.get_pod_events(name=self.pod_name, namespace=self.pod_namespace)
                    events = list(listing.items or [])
                if startup.observe(pod, events, datetime.now(UTC)):
                    break
                await asyncio.sleep(self.startup_check_interval)
        except STARTUP_FAILURES as exc:
            self.log.warning("Pod %s/%s cannot start: %s", self.pod_namespace, self.pod_name, exc)
            yield TriggerEvent(
                {
                    "status": "timeout",
                    "namespace": self.pod_namespace,
                    "name": self.pod_name,
                    "message": str(exc),
                    EVENT_KEY: failure_kind(exc),
                    **self.trigger_kwargs,
                }
            )
            return
        except Exception as exc:  # the provider's own wait below reads the pod again and reports errors
            self.log.warning("Could not follow the start-up of pod %s/%s: %s", self.pod_namespace, self.pod_name, exc)
        async for event in super().run():
            yield event
