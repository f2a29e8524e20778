"""The trigger that waits, in the triggerer, for a run's final checkpoint-sync pass to land in S3."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent


class FinalSyncPassTrigger(BaseTrigger):
    """Yield one event when the run's newest sync pass manifest is final, or when ``timeout`` runs out.

    The sidecar writes its final pass when the pod shuts down, which can be after the training
    task has seen its base container end. The event says ``{"status": "final", "pass": N}``,
    ``{"status": "timeout", "message": ...}`` or ``{"status": "error", "message": ...}``; the
    operator verifies the pass itself when it resumes.

    :param run_uri: ``s3://<bucket>/<run prefix>``.
    :param aws_conn_id: Airflow connection for S3.
    :param timeout: seconds to wait in all.
    :param poll_interval: seconds between looks.
    """

    def __init__(
        self, *, run_uri: str, aws_conn_id: str | None, timeout: float, poll_interval: float = 2.0
    ) -> None:
        super().__init__()
        self.run_uri = run_uri
        self.aws_conn_id = aws_conn_id
        self.timeout = timeout
        self.poll_interval = poll_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "run_uri": self.run_uri,
                "aws_conn_id": self.aws_conn_id,
                "timeout": self.timeout,
                "poll_interval": self.poll_interval,
            },
        )

    def _newest(self) -> tuple[int | None, bool]:
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook

        from kubetrain.run_store import RunStore
        from kubetrain.s3_layout import RunLocation, S3Layout

        run = RunLocation.from_uri(self.run_uri)
        found = RunStore(
            S3Hook(aws_conn_id=self.aws_conn_id), S3Layout(training_bucket=run.bucket)
        ).passes.newest(run)
        return (found.number, found.final) if found else (None, False)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        deadline = time.monotonic() + self.timeout
        last = "no sync pass manifest yet"
        while True:
            try:
                # boto3 is synchronous: the look runs in a thread, off the triggerer's event loop.
                number, final = await asyncio.to_thread(self._newest)
            except Exception as exc:
                yield TriggerEvent(
                    {"status": "error", "message": f"cannot read the sync passes of {self.run_uri}: {exc}"}
                )
                return
            if final:
                yield TriggerEvent({"status": "final", "pass": number})
                return
            if number is not None:
                last = f"the newest pass is {number}, not final"
            if time.monotonic() >= deadline:
                yield TriggerEvent(
                    {
                        "status": "timeout",
                        "message": f"no final sync pass under {self.run_uri}/sync/ within {self.timeout:g} s ({last})",
                    }
                )
                return
            await asyncio.sleep(self.poll_interval)
