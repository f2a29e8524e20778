"""The batch/v1 Job controller: creates a Job's pods (synchronously on create), counts their outcomes,
and sets the Job's status and conditions as kube-controller-manager does."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from typing import TYPE_CHECKING

from include.devstack.kubeapi.meta import parse_time, rfc3339
from include.devstack.kubeapi.validation import generate_name

if TYPE_CHECKING:
    from include.devstack.kubeapi.cluster import Cluster

log = logging.getLogger("kubeapi.jobs")
INDEX_KEY = "batch.kubernetes.io/job-completion-index"
MAX_POD_BACKOFF = 360.0


def controller_of(pod: dict) -> dict | None:
    for ref in pod["metadata"].get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == "Job":
            return ref
    return None


def format_indexes(indexes: set[int]) -> str:
    """``{0,1,2,4}`` -> ``"0-2,4"`` (the completedIndexes notation)."""
    out, run = [], []
    for i in sorted(indexes):
        if run and i == run[-1] + 1:
            run.append(i)
        else:
            if run:
                out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


class JobController:
    def __init__(self, cluster: Cluster, create_pod) -> None:
        self.cluster = cluster
        self.store = cluster.store
        self.create_pod = create_pod  # the API's pod creation path (defaults, validation, kubelet)
        self.outcomes: dict[
            str, dict[str, tuple[str, int | None]]
        ] = {}  # job uid -> pod uid -> (phase, index)
        self.last_failure: dict[str, float] = {}
        self.timers: dict[tuple[str, str], asyncio.TimerHandle] = {}
        self._task: asyncio.Task | None = None
        cluster.jobs = self

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._watch_pods())

    async def _watch_pods(self) -> None:
        watcher = self.store.subscribe("pods", None)
        try:
            while True:
                change = await watcher.queue.get()
                ref = controller_of(change.obj)
                if ref is not None:
                    self.schedule(change.namespace, ref["name"])
        finally:
            self.store.unsubscribe(watcher)

    def schedule(self, namespace: str, name: str, delay: float = 0.0) -> None:
        key = (namespace, name)
        loop = asyncio.get_running_loop()
        old = self.timers.get(key)
        when = loop.time() + delay
        if old is not None and not old.cancelled() and old.when() <= when:
            return
        if old is not None:
            old.cancel()
        self.timers[key] = loop.call_at(when, self._run, namespace, name)

    def _run(self, namespace: str, name: str) -> None:
        self.timers.pop((namespace, name), None)
        try:
            self.reconcile(namespace, name)
        except Exception:
            log.exception("job %s/%s: reconcile failed", namespace, name)

    # -- create / delete ---------------------------------------------------------------------

    def prepare(self, job: dict) -> None:
        """Defaults that need the uid: the selector and the template's job labels."""
        meta = job["metadata"]
        uid = meta["uid"]
        spec = job["spec"]
        labels = {
            "batch.kubernetes.io/controller-uid": uid,
            "batch.kubernetes.io/job-name": meta["name"],
            "controller-uid": uid,
            "job-name": meta["name"],
        }
        if not spec.get("manualSelector"):
            spec["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}
        tmeta = spec["template"].setdefault("metadata", {})
        tmeta["labels"] = {**(tmeta.get("labels") or {}), **labels}

    def on_created(self, job: dict) -> None:
        self.reconcile(job["metadata"]["namespace"], job["metadata"]["name"])

    def owned_pods(self, job: dict) -> list[dict]:
        uid = job["metadata"]["uid"]
        return [
            p
            for p in self.store.list("pods", job["metadata"]["namespace"])
            if (ref := controller_of(p)) is not None and ref.get("uid") == uid
        ]

    def delete(self, job: dict, propagation: str) -> dict:
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        pods = self.owned_pods(job)
        if propagation == "Orphan":
            for p in pods:

                def orphan(pod: dict, uid=job["metadata"]["uid"]) -> None:
                    refs = [r for r in pod["metadata"].get("ownerReferences") or [] if r.get("uid") != uid]
                    if refs:
                        pod["metadata"]["ownerReferences"] = refs
                    else:
                        pod["metadata"].pop("ownerReferences", None)

                self.store.mutate("pods", ns, p["metadata"]["name"], orphan)
            return self._remove(job)
        for p in pods:
            if not p["metadata"].get("deletionTimestamp"):
                self.cluster.delete_pod(ns, p["metadata"]["name"], None)
        if propagation == "Foreground" and pods:

            def mark(j: dict) -> None:
                j["metadata"]["deletionTimestamp"] = rfc3339()
                j["metadata"]["deletionGracePeriodSeconds"] = 0
                fins = j["metadata"].setdefault("finalizers", [])
                if "foregroundDeletion" not in fins:
                    fins.append("foregroundDeletion")

            marked = self.store.mutate("jobs", ns, name, mark)
            asyncio.ensure_future(self._remove_when_pods_gone(marked))
            return marked
        return self._remove(job)

    async def _remove_when_pods_gone(self, job: dict) -> None:
        while self.owned_pods(job):
            await asyncio.sleep(0.1)
        current = self.store.get("jobs", job["metadata"]["namespace"], job["metadata"]["name"])
        if current is not None and current["metadata"]["uid"] == job["metadata"]["uid"]:
            self._remove(current)

    def _remove(self, job: dict) -> dict:
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        timer = self.timers.pop((ns, name), None)
        if timer:
            timer.cancel()
        self.outcomes.pop(job["metadata"]["uid"], None)
        return self.store.remove("jobs", ns, name) or job

    # -- reconcile ---------------------------------------------------------------------------

    def reconcile(self, namespace: str, name: str) -> None:
        job = self.store.get("jobs", namespace, name)
        if job is None or job["metadata"].get("deletionTimestamp"):
            return
        spec, status = job["spec"], job.get("status") or {}
        uid = job["metadata"]["uid"]
        conds = {c["type"]: c for c in status.get("conditions") or []}
        finished = any(conds.get(t, {}).get("status") == "True" for t in ("Complete", "Failed"))
        if finished:
            self._ttl(job, status)
            return
        now = time.time()
        indexed = spec.get("completionMode") == "Indexed"
        pods = self.owned_pods(job)
        outcomes = self.outcomes.setdefault(uid, {})
        active, terminating, ready = [], 0, 0
        restarts = 0
        for p in pods:
            phase = (p.get("status") or {}).get("phase")
            index = _pod_index(p)
            if phase in ("Succeeded", "Failed"):
                if p["metadata"]["uid"] not in outcomes:
                    outcomes[p["metadata"]["uid"]] = (phase, index)
                    if phase == "Failed":
                        self.last_failure[uid] = now
            elif p["metadata"].get("deletionTimestamp"):
                terminating += 1
            else:
                active.append(p)
                cs = (p.get("status") or {}).get("containerStatuses") or []
                restarts += sum(c.get("restartCount", 0) for c in cs)
                if any(
                    c.get("type") == "Ready" and c.get("status") == "True"
                    for c in (p.get("status") or {}).get("conditions") or []
                ):
                    ready += 1
        succeeded = sum(1 for ph, _ in outcomes.values() if ph == "Succeeded")
        failed = sum(1 for ph, _ in outcomes.values() if ph == "Failed")
        done_indexes = {i for ph, i in outcomes.values() if ph == "Succeeded" and i is not None}
        completions = spec.get("completions")
        new_status = dict(status)
        new_conds = list(status.get("conditions") or [])

        def set_cond(type_: str, value: str, reason: str, message: str) -> None:
            for c in new_conds:
                if c["type"] == type_:
                    if c["status"] != value:
                        c.update(status=value, lastTransitionTime=rfc3339())
                    c.update(reason=reason, message=message, lastProbeTime=rfc3339())
                    return
            new_conds.append(
                {
                    "type": type_,
                    "status": value,
                    "reason": reason,
                    "message": message,
                    "lastProbeTime": rfc3339(),
                    "lastTransitionTime": rfc3339(),
                }
            )

        suspended = bool(spec.get("suspend"))
        if not suspended and not new_status.get("startTime"):
            new_status["startTime"] = rfc3339()
        failure: tuple[str, str] | None = None
        if failed + restarts > spec.get("backoffLimit", 6):
            failure = ("BackoffLimitExceeded", "Job has reached the specified backoff limit")
        elif spec.get("activeDeadlineSeconds") and new_status.get("startTime") and not suspended:
            elapsed = now - parse_time(new_status["startTime"])
            if elapsed >= spec["activeDeadlineSeconds"]:
                failure = ("DeadlineExceeded", "Job was active longer than specified deadline")
            else:
                self.schedule(namespace, name, spec["activeDeadlineSeconds"] - elapsed + 0.05)
        if completions is None:
            complete = succeeded >= 1 and not active
        elif indexed:
            complete = len(done_indexes) >= completions
        else:
            complete = succeeded >= completions
        if failure and not complete:
            for p in active:
                self.cluster.delete_pod(namespace, p["metadata"]["name"], None)
            set_cond("FailureTarget", "True", *failure)
            set_cond("Failed", "True", *failure)
            self.cluster.record_event(job, "Warning", failure[0], failure[1], component="job-controller")
            active = []
        elif complete:
            for p in active:
                self.cluster.delete_pod(namespace, p["metadata"]["name"], None)
            active = []
            set_cond(
                "SuccessCriteriaMet",
                "True",
                "CompletionsReached",
                "Reached expected number of succeeded pods",
            )
            set_cond("Complete", "True", "CompletionsReached", "Reached expected number of succeeded pods")
            new_status["completionTime"] = rfc3339()
            self.cluster.record_event(job, "Normal", "Completed", "Job completed", component="job-controller")
        elif suspended:
            for p in active:
                self.cluster.delete_pod(namespace, p["metadata"]["name"], None)
            active = []
            if conds.get("Suspended", {}).get("status") != "True":
                set_cond("Suspended", "True", "JobSuspended", "Job suspended")
                self.cluster.record_event(
                    job, "Normal", "Suspended", "Job suspended", component="job-controller"
                )
            new_status.pop("startTime", None)
        else:
            if conds.get("Suspended", {}).get("status") == "True":
                set_cond("Suspended", "False", "JobResumed", "Job resumed")
                self.cluster.record_event(job, "Normal", "Resumed", "Job resumed", component="job-controller")
            active += self._create_missing(job, active, succeeded, failed, done_indexes, now)
        new_status.update(
            active=len(active),
            succeeded=succeeded,
            failed=failed,
            ready=ready,
            terminating=terminating,
            uncountedTerminatedPods={},
        )
        for key in ("active", "succeeded", "failed"):
            if not new_status[key] and key != "active":
                new_status.pop(key)
        if not new_status["active"]:
            new_status.pop("active")
        if indexed:
            if done_indexes:
                new_status["completedIndexes"] = format_indexes(done_indexes)
            else:
                new_status.pop("completedIndexes", None)
        if new_conds:
            new_status["conditions"] = new_conds

        def apply(j: dict) -> None:
            j["status"] = new_status

        updated = self.store.mutate("jobs", namespace, name, apply)
        if updated and (failure or complete):
            self._ttl(updated, new_status)

    def _create_missing(
        self, job: dict, active: list[dict], succeeded: int, failed: int, done: set[int], now: float
    ) -> list[dict]:
        spec = job["spec"]
        uid = job["metadata"]["uid"]
        parallelism = spec.get("parallelism", 1)
        completions = spec.get("completions")
        if failed and uid in self.last_failure:
            delay = min(self.cluster.backoff * 2 ** (failed - 1), MAX_POD_BACKOFF)
            wait = self.last_failure[uid] + delay - now
            if wait > 0:
                self.schedule(job["metadata"]["namespace"], job["metadata"]["name"], wait + 0.01)
                return []
        created = []
        if spec.get("completionMode") == "Indexed":
            busy = {_pod_index(p) for p in active}
            todo = [i for i in range(completions) if i not in done and i not in busy]
            for index in todo[: max(0, parallelism - len(active))]:
                created.append(self._create_pod(job, index))
        else:
            remaining = (
                (completions - succeeded)
                if completions is not None
                else (parallelism if not succeeded else 0)
            )
            want = min(parallelism, remaining) - len(active)
            for _ in range(max(0, want)):
                created.append(self._create_pod(job, None))
        return [p for p in created if p]

    def _create_pod(self, job: dict, index: int | None) -> dict | None:
        meta = job["metadata"]
        template = copy.deepcopy(job["spec"]["template"])
        tmeta = template.get("metadata") or {}
        labels = dict(tmeta.get("labels") or {})
        annotations = dict(tmeta.get("annotations") or {})
        pod_spec = template["spec"]
        base = f"{meta['name']}-{index}-" if index is not None else f"{meta['name']}-"
        if index is not None:
            labels[INDEX_KEY] = str(index)
            annotations[INDEX_KEY] = str(index)
            pod_spec.setdefault("hostname", f"{meta['name']}-{index}"[:63])
            for c in (pod_spec.get("initContainers") or []) + pod_spec.get("containers", []):
                env = c.setdefault("env", [])
                if not any(e.get("name") == "JOB_COMPLETION_INDEX" for e in env):
                    env.append(
                        {
                            "name": "JOB_COMPLETION_INDEX",
                            "valueFrom": {
                                "fieldRef": {
                                    "apiVersion": "v1",
                                    "fieldPath": f"metadata.annotations['{INDEX_KEY}']",
                                }
                            },
                        }
                    )
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": generate_name(base),
                "generateName": base,
                "namespace": meta["namespace"],
                "labels": labels,
                "annotations": annotations,
                "ownerReferences": [
                    {
                        "apiVersion": "batch/v1",
                        "kind": "Job",
                        "name": meta["name"],
                        "uid": meta["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": pod_spec,
        }
        if not annotations:
            del pod["metadata"]["annotations"]
        try:
            created = self.create_pod(pod)
        except Exception as exc:  # noqa: BLE001 - reported on the Job, as the controller does
            self.cluster.record_event(
                job, "Warning", "FailedCreate", f"Error creating: {exc}", component="job-controller"
            )
            return None
        self.cluster.record_event(
            job,
            "Normal",
            "SuccessfulCreate",
            f"Created pod: {created['metadata']['name']}",
            component="job-controller",
        )
        return created

    def _ttl(self, job: dict, status: dict) -> None:
        ttl = job["spec"].get("ttlSecondsAfterFinished")
        if ttl is None:
            return
        finished_at = status.get("completionTime")
        for c in status.get("conditions") or []:
            if c["type"] == "Failed" and c["status"] == "True":
                finished_at = c.get("lastTransitionTime")
        start = parse_time(finished_at) if finished_at else time.time()
        wait = start + ttl - time.time()
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        if wait > 0:
            asyncio.get_running_loop().call_later(wait, self._ttl_expired, ns, name, job["metadata"]["uid"])
        else:
            self._ttl_expired(ns, name, job["metadata"]["uid"])

    def _ttl_expired(self, namespace: str, name: str, uid: str) -> None:
        job = self.store.get("jobs", namespace, name)
        if job is not None and job["metadata"]["uid"] == uid:
            with contextlib.suppress(Exception):
                self.delete(job, "Background")


def _pod_index(pod: dict) -> int | None:
    value = (pod["metadata"].get("annotations") or {}).get(INDEX_KEY) or (
        pod["metadata"].get("labels") or {}
    ).get(INDEX_KEY)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
