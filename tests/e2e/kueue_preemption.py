"""A preemption through the dev stack's Kueue stand-in, for the end-to-end tests of preempted runs.

One GPU of quota in LocalQueue 'training': once the run's pod is ready to be preempted (its log
says so), a high-priority GPU workload is let in and Kueue preempts the low-priority pod; once that
pod is gone and the task's replacement waits behind the workload (Kueue's admission gate), the
workload ends so the run is admitted again. Used by test_kueue_training.py (the digits classifier)
and test_kit_keras_e2e.py (the guide's Keras example with the kit's callback)::

    with preempting(core, dag_id, ready=lambda log: "Epoch 2/5" in log) as seen:
        run = airflow.dags_test(dag_id, conf)
    assert "preempted" in seen

What ``seen`` holds afterwards: ``preempted`` (the preempted pod's name), ``preempted_log`` (its
``base`` container's log, read while it ended: the checkpoint written on SIGTERM), ``requeued``
(the gated replacement pods) and ``holder_deleted`` (a monotonic time).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

from kubernetes import client

from include.devstack.stack import NAMESPACE
from include.devstack.workloads import queued_pod

ADMISSION_GATE = "kueue.x-k8s.io/admission"
# how long the replacement waits behind the high-priority workload: the pods' timestamps have whole
# seconds, so a shorter wait could read as none in the run's time queued
QUEUED_AT_LEAST = timedelta(seconds=2)


def preempt_once(
    core: client.CoreV1Api,
    dag_id: str,
    ready: Callable[[str], bool],
    stop: threading.Event,
    seen: dict[str, Any],
    poll_s: float = 0.5,
) -> None:
    """Preempt the DAG's running pod once, when ``ready`` holds for its ``base`` container's log, and let
    the run back in once its replacement has queued; record what happened in ``seen`` (module docstring).

    :param core: the admin's CoreV1Api of the dev stack.
    :param dag_id: the DAG whose pods (label ``kubetrain.io/dag-id``) are watched.
    :param ready: whether a pod's log shows it has reached the point to preempt it at.
    :param stop: set by the test when the run has ended; the watcher then stops at once.
    :param seen: filled in as the preemption goes.
    :param poll_s: how often the pods are looked at (a pod that must be caught early in an epoch: less).
    """
    holder = f"high-{uuid.uuid4().hex[:6]}"
    selector = f"kubetrain.io/dag-id={dag_id}"
    try:
        while not stop.is_set() and "preempted" not in seen:
            for pod in core.list_namespaced_pod(NAMESPACE, label_selector=selector).items:
                if pod.metadata.deletion_timestamp or pod.status.phase != "Running":
                    continue
                try:
                    log = core.read_namespaced_pod_log(pod.metadata.name, NAMESPACE, container="base")
                except client.ApiException:
                    continue
                if ready(log):
                    seen["preempted"] = pod.metadata.name
                    core.create_namespaced_pod(
                        NAMESPACE, queued_pod(holder, {"nvidia.com/gpu": "1"}, priority="high")
                    )
                    break
            stop.wait(poll_s)
        while not stop.is_set():
            pods = core.list_namespaced_pod(NAMESPACE, label_selector=selector).items
            if seen.get("preempted") in {p.metadata.name for p in pods}:
                try:  # its last lines, while it ends: the checkpoint written on SIGTERM
                    seen["preempted_log"] = core.read_namespaced_pod_log(
                        seen["preempted"], NAMESPACE, container="base"
                    )
                except client.ApiException:
                    pass
            else:
                gated = [
                    p for p in pods if any(g.name == ADMISSION_GATE for g in p.spec.scheduling_gates or [])
                ]
                if gated:
                    seen["requeued"] = [p.metadata.name for p in gated]
                    created = min(p.metadata.creation_timestamp for p in gated)
                    while not stop.is_set() and datetime.now(UTC) - created < QUEUED_AT_LEAST:
                        stop.wait(poll_s)
                    break
            stop.wait(poll_s)
    finally:
        try:
            core.delete_namespaced_pod(holder, NAMESPACE, grace_period_seconds=0)
            seen["holder_deleted"] = time.monotonic()
        except client.ApiException:
            pass


@contextmanager
def preempting(
    core: client.CoreV1Api, dag_id: str, ready: Callable[[str], bool], *, poll_s: float = 0.5
) -> Iterator[dict[str, Any]]:
    """:func:`preempt_once` in a thread for the duration of the block; yields its ``seen``."""
    stop, seen = threading.Event(), {}
    watcher = threading.Thread(
        target=preempt_once, args=(core, dag_id, ready, stop, seen, poll_s), daemon=True
    )
    watcher.start()
    try:
        yield seen
    finally:
        stop.set()
        watcher.join(10)
