"""A sweep's prefix in the test S3 server, for the tests of the sweep's operators."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import airflow  # noqa: F401  (importing Airflow puts its plugins folder on sys.path)
import pytest

from kubetrain.s3_layout import S3Layout
from kubetrain.sweep.config import SweepSettings
from kubetrain.sweep.records import SweepLocation

RUN_AFTER = datetime(2026, 11, 22, 4, 0, tzinfo=UTC)


class TaskInstance(SimpleNamespace):
    """The task instance of a context: what the operators read of it, and the XComs they push."""

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcoms[key] = value


class Sweep:
    """One sweep DAG run's prefix in the test server's training bucket."""

    def __init__(self, client, store) -> None:
        self.client = client
        self.store = store
        self.dag_id = f"sweep_{uuid.uuid4().hex[:8]}"
        self.run_id = "manual__2026-11-22T04:00:00+00:00"
        self.location = SweepLocation.of(S3Layout(), self.dag_id, self.run_id)

    def plan(self, space: dict[str, Any], **params: Any) -> dict[str, Any]:
        """A checked plan, as the plan task writes it (without the image), written to S3."""
        params = {
            "space": space,
            "algorithm": "grid",
            "max_trials": 8,
            "parallel_trials": 1,
            "objective": {"metric": "val_accuracy", "mode": "max"},
            **params,
        }
        document = {
            "kind": "kubetrain/sweep-plan",
            "format_version": 1,
            **self.settings(),
            **SweepSettings(tunable=None).plan(params),
            "image": "registry.local/trainer@sha256:" + "a" * 64,
            "dataset": {"uri": "s3://datasets/flowers", "version": "v1", "manifest": None},
            "model": None,
            "created_at": "2026-11-22T04:00:01Z",
        }
        self.put(self.location.plan_key, document)
        return document

    def settings(self) -> dict[str, Any]:
        """The trials' settings (``plan.output["trial_settings"]``) of this sweep."""
        return {
            "id": f"{self.dag_id}/{self.run_id}",
            "dag_id": self.dag_id,
            "run_id": self.run_id,
            "uri": self.location.uri,
            "trials_uri": self.location.trials_uri,
            "algorithm": "grid",
            "objective": {"metric": "val_accuracy", "mode": "max"},
            "early_stopping": {"rule": "off"},
            "title": "Flowers",
        }

    def context(self, *, task_id: str = "task", map_index: int = -1, **params: Any) -> dict[str, Any]:
        ti = TaskInstance(
            dag_id=self.dag_id,
            task_id=task_id,
            map_index=map_index,
            try_number=1,
            start_date=RUN_AFTER,
            xcoms={},
        )
        return {
            "ti": ti,
            "run_id": self.run_id,
            "params": params,
            "dag_run": SimpleNamespace(run_after=RUN_AFTER),
        }

    def put(self, key: str, document: Any, *, bucket: str = "training") -> None:
        body = document if isinstance(document, bytes) else json.dumps(document).encode()
        self.client.put_object(Bucket=bucket, Key=key, Body=body)

    def get(self, key: str, *, bucket: str = "training") -> bytes:
        return self.client.get_object(Bucket=bucket, Key=key)["Body"].read()


@pytest.fixture
def sweep(client, store) -> Sweep:
    return Sweep(client, store)
