"""Kill soak: train_image_classifier runs killed at seeded random points, across kinds of kill.

Real parts only: the dev stack (its Kubernetes API running the pods' containers as
processes, its S3 server, its registry with the trainer and sync images built from their
Dockerfiles), and a real Airflow (include/airflow_ui.py: API server, scheduler, DAG
processor, triggerer, LocalExecutor), which retries the training task as it would in
production. DAG runs are triggered through the REST API, one after the other, each with a
few kills; the kinds:

  pod_delete       the training pod deleted through the API (SIGTERM to the trainer, then the
                   sidecar's final pass: a preemption or a node drain); the task replaces the
                   pod in the same try, without a retry
  evict            the training pod evicted through the Eviction API (policy/v1 Eviction, with the
                   cluster admin's identity), as a node drain does: the DisruptionTarget condition
                   (EvictionByEvictionAPI), SIGTERM, deletion; replaced in the same try
  kueue_preempt    the run is queued (conf queue=training, priority=low: Kueue's plain-pod
                   integration); a high-priority pod that asks for the ClusterQueue's whole CPU quota
                   arrives in the same LocalQueue, Kueue preempts the run's pod (DisruptionTarget,
                   SIGTERM, deletion); once that pod is gone the high-priority pod is deleted, and the
                   task's new pod is admitted again and resumes, in the same try
  trainer_sigkill  SIGKILL of the trainer process, from the node (an OOM kill or a crash; a
                   `kubectl exec ... kill -9 1` does nothing, as on a cluster: the kernel
                   ignores SIGKILL sent to a PID namespace's init from inside it)
  sidecar_sigkill  SIGKILL of the checkpoint-sync sidecar (the kubelet restarts it)
  airflow_restart  SIGKILL of the Airflow process that holds the deferred training task (the
                   triggerer; every other such kill the scheduler, with its executor), then a
                   new one started, as a supervisor does
  kubeapi_pause    the Kubernetes API server stopped (SIGSTOP) for 5-20 s, then continued:
                   clients time out or wait, the pods' processes keep running. The dev stack's
                   API server keeps its objects in memory and runs its pods' containers as its
                   own children, so a restart of it is a lost node and a wiped cluster at once,
                   which no cluster does; an outage of the API is what this kind measures.

A kill fires once the trainer of the running pod has reached the kill's target step (a seeded
uniform draw over the run's steps), which puts it anywhere: between steps, in a validation
pass, in a checkpoint write. The step reached at a kill is the trainer's own count: exact for
a SIGTERM (the trainer checkpoints the step it is at and logs it), otherwise the last step it
logged plus the steps its logged rate covers since then (it logs every 10 steps).

Per kill: whether the run went on (the same trainer process), resumed (a new pod's trainer
restored step R > 0) or restarted from 0 (and whether a sync pass had committed a checkpoint
before that pod started: a restart from 0 after a committed pass is a failure), the steps lost
(step at the kill minus the step resumed at), against the checkpoint interval (the trainer
checkpoints at every epoch end, every 100 steps and on SIGTERM: here one epoch), and the Airflow
retries it used (the training task's try_number once the kill has settled minus the one before it;
a kill the task replaces in the same try must use none). Per DAG run:
the run's state, pods left behind once it ended (orphans), and whether the promoted model is
the one trained across the kills: the promoted files are the final sync pass's outputs
(sha256), the final pass was written by the pod whose trainer finished, metrics.json counts
every step and epoch once, and the promoted model.keras scores on the validation split what
metrics.json says it scores.

    make bench BENCH=kill_soak                    # 20 kills, seed 13
    .venv/bin/python bench/bench_kill_soak.py --kills 5 --stack-dir .stack   # a running stack
    .venv/bin/python bench/bench_kill_soak.py --kinds evict,kueue_preempt --kills 40 --per-run 8

Writes bench/results/kill_soak.md, and every observation (each pod's logs, each sync pass) to
--observations (default: kubetrain-kill-soak.json in the temporary directory).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "plugins"))

from include.devstack.workloads import queued_pod  # noqa: E402
from kubetrain_contract.run_layout import pass_prefix  # noqa: E402

TRAINER_PYTHON = REPO / "trainer" / ".venv" / "bin" / "python"
RESULTS = REPO / "bench" / "results"
DAG_ID = "train_image_classifier"
MODEL = "soak-digits"
DATASET_KEY = "soak-digits/digits.zip"
KINDS = (
    "pod_delete",
    "trainer_sigkill",
    "sidecar_sigkill",
    "airflow_restart",
    "kubeapi_pause",
    "evict",
    "kueue_preempt",
)
# kills that end the training container by itself, so the task fails and Airflow retries it (retries=2)
RETRIED = ("trainer_sigkill",)
# kills from outside the pod: the task replaces the pod in the same try (no retry), up to max_preemptions
REPLACED = ("pod_delete", "evict", "kueue_preempt")
# kills that end the pod with SIGTERM: the trainer checkpoints the step it is at and logs it
SIGTERMED = REPLACED
# kills whose DAG run is queued in Kueue (a LocalQueue and a WorkloadPriorityClass)
QUEUED = ("kueue_preempt",)
LOCAL_QUEUE = "training"  # include/devstack/kueue.yaml: the LocalQueue of ClusterQueue kubetrain
QUEUE_CPU = "64"  # that ClusterQueue's whole CPU quota: a pod asking for it fits beside no training pod
LOG_EVERY = 10  # the trainer's --log-every-steps default
PERIODIC_CHECKPOINT = 100  # its --checkpoint-every-steps default

STEP_LINE = re.compile(r"step (\d+) epoch (\d+)/(\d+) batch (\d+)/(\d+) .* examples/s ([\d.]+)")
CKPT_LINE = re.compile(r"checkpoint ckpt-(\d+) written \(([^;)]*)")
RESUMED_LINE = re.compile(r"resumed from ckpt-(\d+): step (\d+)")
FRESH_LINE = "starting at step 0"
DONE_LINE = re.compile(r"done: (\d+) steps")
SPLIT_LINE = re.compile(r"split: (\d+) training")


# -- what is observed ------------------------------------------------------------------------


@dataclass
class PodLog:
    """One training pod as the soak saw it."""

    name: str
    uid: str
    created: float
    lines: dict[str, list[tuple[float, str]]] = field(default_factory=dict)  # container -> (time seen, text)
    steps: list[tuple[float, int, float]] = field(default_factory=list)  # (time, step, examples/s)
    checkpoints: list[tuple[float, int, str]] = field(default_factory=list)  # (time, step, reason)
    start_step: int | None = None  # the step its trainer started at (0: from scratch)
    started_at: float | None = None
    done_steps: int | None = None
    batch_size: int = 64
    steps_per_epoch: int | None = None
    gone_at: float | None = None
    deleting_at: float | None = None

    def last_step(self) -> tuple[float, int, float] | None:
        """(time, step, step time in s) of the trainer's newest known step."""
        known = [(t, s, 0.0) for t, s, _ in self.checkpoints] + [(t, s, r) for t, s, r in self.steps]
        if self.start_step is not None and self.started_at is not None:
            known.append((self.started_at, self.start_step, 0.0))
        if not known:
            return None
        t, step, _ = max(known, key=lambda k: (k[1], k[0]))
        rates = [r for _, _, r in self.steps if r > 0]
        step_time = self.batch_size / rates[-1] if rates else 0.0
        return t, step, step_time


class Observer:
    """Follows every pod of one DAG run: its trainer's, sidecar's and stage-in's logs, and its life."""

    def __init__(self, core, namespace: str, run_label: str) -> None:
        self.core = core
        self.namespace = namespace
        self.selector = f"kubetrain.io/dag-id={DAG_ID},kubetrain.io/run-id={run_label}"
        self.pods: dict[str, PodLog] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self._following: set[tuple[str, str, int]] = set()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> Observer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._thread.join(10)

    def _watch(self) -> None:
        while not self.stop.is_set():
            try:
                pods = self.core.list_namespaced_pod(
                    self.namespace, label_selector=self.selector, _request_timeout=10
                ).items
            except Exception:  # the API may be paused on purpose: look again
                self.stop.wait(0.5)
                continue
            now = time.time()
            seen = set()
            for pod in pods:
                name = pod.metadata.name
                seen.add(name)
                with self.lock:
                    record = self.pods.get(name)
                    if record is None:
                        record = self.pods[name] = PodLog(name, pod.metadata.uid, now)
                    if pod.metadata.deletion_timestamp and record.deleting_at is None:
                        record.deleting_at = now
                statuses = [
                    *(pod.status.init_container_statuses or []),
                    *(pod.status.container_statuses or []),
                ]
                for status in statuses:
                    if status.state and (status.state.running or status.state.terminated):
                        key = (name, status.name, status.restart_count or 0)
                        if key not in self._following:
                            self._following.add(key)
                            threading.Thread(
                                target=self._follow, args=(record, status.name), daemon=True
                            ).start()
            with self.lock:
                for name, record in self.pods.items():
                    if name not in seen and record.gone_at is None:
                        record.gone_at = now
            self.stop.wait(0.3)

    def _follow(self, record: PodLog, container: str) -> None:
        try:
            resp = self.core.read_namespaced_pod_log(
                record.name,
                self.namespace,
                container=container,
                follow=True,
                _preload_content=False,
                _request_timeout=(10, None),
            )
        except Exception:
            return
        buffer = b""
        try:
            for chunk in resp.stream(4096):
                buffer += chunk
                *complete, buffer = buffer.split(b"\n")
                for raw in complete:
                    self._line(record, container, raw.decode(errors="replace"))
        except Exception:
            pass
        finally:
            resp.release_conn()

    def _line(self, record: PodLog, container: str, text: str) -> None:
        now = time.time()
        with self.lock:
            record.lines.setdefault(container, []).append((now, text))
            if container != "base":
                return
            if m := STEP_LINE.search(text):
                step, spe, rate = int(m.group(1)), int(m.group(5)), float(m.group(6))
                record.steps.append((now, step, rate))
                record.steps_per_epoch = spe
            elif m := CKPT_LINE.search(text):
                record.checkpoints.append((now, int(m.group(1)), m.group(2)))
            elif m := RESUMED_LINE.search(text):
                record.start_step, record.started_at = int(m.group(2)), now
            elif FRESH_LINE in text:
                record.start_step, record.started_at = 0, now
            elif m := DONE_LINE.search(text):
                record.done_steps = int(m.group(1))

    # -- questions the killer asks -----------------------------------------------------------

    def current(self) -> PodLog | None:
        """The pod whose trainer is training now (started, not finished, not being deleted)."""
        with self.lock:
            live = [
                p
                for p in self.pods.values()
                if p.gone_at is None
                and p.deleting_at is None
                and p.start_step is not None
                and p.done_steps is None
            ]
            return max(live, key=lambda p: p.created) if live else None

    def estimate(self, pod: PodLog, at: float | None = None) -> int | None:
        """The step ``pod``'s trainer has reached at time ``at``: the last one it logged, plus what its rate covers."""
        with self.lock:
            last = pod.last_step()
            spe = pod.steps_per_epoch
            saved = {s for _, s, _ in pod.checkpoints} | {pod.start_step}
        if last is None:
            return None
        t, step, step_time = last
        if spe and step % spe == 0 and step not in saved:
            return step  # an epoch's last step: its validation and checkpoint come before the next step
        at = time.time() if at is None else at
        if step_time <= 0:
            return step
        ahead = int((at - t) / step_time)
        cap = LOG_EVERY - step % LOG_EVERY  # the next logged step would have told
        if spe:
            cap = min(cap, spe - step % spe or spe)  # and the epoch's end checkpoint
        return step + max(0, min(ahead, cap - 1 if cap > 1 else 0))

    def snapshot(self) -> list[dict[str, Any]]:
        with self.lock:
            return [
                {
                    "name": p.name,
                    "created": p.created,
                    "start_step": p.start_step,
                    "started_at": p.started_at,
                    "done_steps": p.done_steps,
                    "deleting_at": p.deleting_at,
                    "gone_at": p.gone_at,
                    "checkpoints": p.checkpoints,
                    "steps_per_epoch": p.steps_per_epoch,
                    "logs": {c: [text for _, text in lines] for c, lines in p.lines.items()},
                }
                for p in sorted(self.pods.values(), key=lambda p: p.created)
            ]


# -- kills -----------------------------------------------------------------------------------


@dataclass
class Kill:
    run: int
    kind: str
    target: int  # the global step at which it fires
    variant: str = ""
    fired_at: float | None = None
    pod: str | None = None
    step_at_kill: int | None = None
    exact: bool = False
    outcome: str = "not fired"  # continued | resumed | restarted from 0
    resumed_at: int | None = None
    lost: int | None = None
    committed_before_restart: bool | None = None
    tries_before: int | None = None  # the training task's try_number just before the kill
    tries_after: int | None = None  # and once what the kill set off has settled
    notes: list[str] = field(default_factory=list)

    def retries(self) -> int | None:
        """The Airflow retries the kill used (None when a try_number could not be read)."""
        if self.tries_before is None or self.tries_after is None:
            return None
        return self.tries_after - self.tries_before


def container_pid(pod: str, marker: str) -> int | None:
    """Host PID of a container's main process: the oldest process with the pod's hostname whose
    command line holds ``marker`` (with PID namespaces it is PID 1 inside the container)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            start = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[19])
        except (OSError, ValueError, IndexError):
            continue
        if f"HOSTNAME={pod}".encode() in environ and marker in cmdline:
            found.append((start, int(entry.name)))
    return min(found)[1] if found else None


def holder_pod(name: str) -> dict[str, Any]:
    """A high-priority pod in LocalQueue LOCAL_QUEUE asking for the ClusterQueue's whole CPU quota
    (Pod Security level restricted), so that Kueue preempts the low-priority run to make room for it.

    :param name: the pod's name.
    """
    return queued_pod(name, {"cpu": QUEUE_CPU}, queue=LOCAL_QUEUE, priority="high")


class Soak:
    """The dev stack, Airflow and the S3 client that the soak works with."""

    def __init__(
        self,
        stack_env: dict[str, str],
        ui,
        kubeapi_pid: int,
        seed: int,
        epochs: int,
        admin_kubeconfig: str,
    ) -> None:
        """The soak's clients.

        :param stack_env: the dev stack's environment (stack.env()).
        :param ui: the running Airflow (include.airflow_ui.AirflowUI).
        :param kubeapi_pid: the PID of the dev stack's API server (for kubeapi_pause).
        :param seed: seeds the random draws of the kills' variants.
        :param epochs: the runs' epochs.
        :param admin_kubeconfig: the cluster admin's kubeconfig (evictions and Kueue's high-priority pods).
        """
        import boto3
        from kubernetes import client, config

        self.client = client

        self.env = stack_env
        self.ui = ui
        self.kubeapi_pid = kubeapi_pid
        self.rng = random.Random(seed)
        self.epochs = epochs
        self.core = client.CoreV1Api(config.new_client_from_config(config_file=stack_env["KUBECONFIG"]))
        # a drain and a cluster's other workloads are not Airflow's: its identity may not evict (deploy/rbac.yaml)
        self.admin = client.CoreV1Api(config.new_client_from_config(config_file=admin_kubeconfig))
        self.namespace = stack_env["KUBETRAIN_NAMESPACE"]
        self.s3 = boto3.client(
            "s3",
            endpoint_url=stack_env["KUBETRAIN_S3_ENDPOINT"],
            region_name="us-east-1",
            aws_access_key_id=stack_env["KUBETRAIN_S3_ACCESS_KEY_ID"],
            aws_secret_access_key=stack_env["KUBETRAIN_S3_SECRET_ACCESS_KEY"],
        )
        self.airflow_kills = 0

    # -- one kill ----------------------------------------------------------------------------

    def fire(self, kill: Kill, observer: Observer, pod: PodLog) -> None:
        kill.fired_at = time.time()
        kill.pod = pod.name
        kill.step_at_kill = observer.estimate(pod, kill.fired_at)
        if kill.kind == "pod_delete":
            self.core.delete_namespaced_pod(pod.name, self.namespace)
        elif kill.kind == "evict":
            meta = self.client.V1ObjectMeta(name=pod.name, namespace=self.namespace)
            self.admin.create_namespaced_pod_eviction(
                pod.name, self.namespace, self.client.V1Eviction(metadata=meta)
            )
        elif kill.kind == "kueue_preempt":
            self.preempt(kill, pod)
        elif kill.kind in ("trainer_sigkill", "sidecar_sigkill"):
            marker = "trainer.image_classifier" if kill.kind == "trainer_sigkill" else "checkpoint-sync"
            pid = container_pid(pod.name, marker)
            if pid is None:
                kill.notes.append(f"no {marker} process of {pod.name} found")
                kill.fired_at = None
                return
            os.kill(pid, signal.SIGKILL)
        elif kill.kind == "airflow_restart":
            component = "triggerer" if self.airflow_kills % 2 == 0 else "scheduler"
            self.airflow_kills += 1
            kill.variant = component
            self.ui.restart(component)
        elif kill.kind == "kubeapi_pause":
            seconds = self.rng.uniform(5, 20)
            kill.variant = f"{seconds:.0f} s"
            os.kill(self.kubeapi_pid, signal.SIGSTOP)
            try:
                time.sleep(seconds)
            finally:
                os.kill(self.kubeapi_pid, signal.SIGCONT)
        else:
            raise ValueError(f"unknown kind of kill {kill.kind!r}: expected one of {', '.join(KINDS)}")

    def preempt(self, kill: Kill, pod: PodLog, timeout: float = 600) -> None:
        """Kueue preempts ``pod`` for a high-priority pod that does not fit beside it; once ``pod`` is
        gone the high-priority pod is deleted, so that the run's next pod is admitted again.

        :param kill: the kill (its variant and notes are set).
        :param pod: the running training pod, in LocalQueue LOCAL_QUEUE with priority low.
        :param timeout: seconds to wait for Kueue to preempt the pod and for the pod to go.
        """
        holder = f"soak-high-{kill.run + 1}-{kill.target}"
        self.admin.create_namespaced_pod(self.namespace, holder_pod(holder))
        kill.variant = f"{holder} asks cpu {QUEUE_CPU}"
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                try:
                    live = self.admin.read_namespaced_pod(pod.name, self.namespace, _request_timeout=10)
                except self.client.ApiException as exc:
                    if exc.status == 404:
                        return
                    raise
                if live.metadata.uid != pod.uid:
                    return
                time.sleep(0.2)
            kill.notes.append(f"{pod.name} was still there {timeout:.0f} s after {holder} was created")
        finally:
            try:
                self.admin.delete_namespaced_pod(holder, self.namespace, grace_period_seconds=0)
            except self.client.ApiException as exc:
                if exc.status != 404:
                    kill.notes.append(f"deleting {holder} failed: {exc.status} {exc.reason}")

    def tries(self, run_id: str) -> int | None:
        """The training task's try_number, or None when Airflow does not answer.

        :param run_id: the DAG run.
        """
        try:
            value = self.ti(run_id).get("try_number")
        except Exception:  # an Airflow process may be down on purpose (airflow_restart)
            return None
        return int(value) if value is not None else None

    def xcom(self, run_id: str, task_id: str, key: str) -> Any:
        quoted = urllib.parse.quote(run_id, safe="")
        value = self.ui.api(
            "GET", f"/dags/{DAG_ID}/dagRuns/{quoted}/taskInstances/{task_id}/xcomEntries/{key}"
        )["value"]
        if isinstance(value, str) and value[:1] in ('"', "{", "["):
            value = json.loads(value)
        return value

    def ti(self, run_id: str) -> dict[str, Any]:
        return self.ui.task_instances(DAG_ID, run_id).get("train", {})

    def wait_kill_point(self, kill: Kill, observer: Observer, run_id: str, deadline: float) -> PodLog | None:
        """The pod to kill once its trainer reaches ``kill.target`` (and, for Airflow, the task is deferred)."""
        checked_ti = 0.0
        deferred = False
        while time.monotonic() < deadline:
            self.ui.check_alive()
            pod = observer.current()
            if pod is not None:
                step = observer.estimate(pod)
                if kill.kind == "airflow_restart" and time.monotonic() - checked_ti > 1:
                    deferred = self.ti(run_id).get("state") == "deferred"
                    checked_ti = time.monotonic()
                if step is not None and step >= kill.target and (kill.kind != "airflow_restart" or deferred):
                    return pod
            run = self.ui.api("GET", f"/dags/{DAG_ID}/dagRuns/{urllib.parse.quote(run_id, safe='')}")
            if run["state"] in ("success", "failed"):
                return None
            time.sleep(0.05)
        return None

    def settle(self, kill: Kill, observer: Observer, run_id: str, timeout: float = 900) -> None:
        """Wait for what a kill sets off before the next one: a new trainer, a restarted sidecar."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            run = self.ui.api("GET", f"/dags/{DAG_ID}/dagRuns/{urllib.parse.quote(run_id, safe='')}")
            if run["state"] in ("success", "failed"):
                return
            if kill.kind in (*RETRIED, *REPLACED):
                with observer.lock:
                    started = [
                        p for p in observer.pods.values() if p.started_at and p.started_at > kill.fired_at
                    ]
                if started:
                    return
            elif kill.kind == "sidecar_sigkill":
                with observer.lock:
                    pod = observer.pods.get(kill.pod)
                    lines = pod.lines.get("checkpoint-sync", []) if pod else []
                    again = [
                        t
                        for t, text in lines
                        if t > kill.fired_at and "checkpoint-sync:" in text and " -> s3://" in text
                    ]
                if again or (pod and (pod.gone_at or pod.deleting_at)):
                    return
            else:
                return
            time.sleep(0.5)
        kill.notes.append(f"nothing followed within {timeout:.0f} s")


# -- the plan --------------------------------------------------------------------------------


def plan(
    kills: int, seed: int, total_steps: int, per_run: int = 4, kinds_of_soak: tuple[str, ...] = KINDS
) -> list[list[Kill]]:
    """Kinds in equal shares, shuffled with ``seed``, packed into DAG runs of ``per_run`` kills with
    at most two retried ones each (the task has two retries; a deleted, evicted or preempted pod costs
    none); targets drawn per run, in order.

    :param kills: how many kills in all.
    :param seed: seeds the shuffle and the targets.
    :param total_steps: a run's steps.
    :param per_run: kills per DAG run.
    :param kinds_of_soak: the kinds of kill, shared out equally.
    """
    rng = random.Random(seed)
    kinds = [kinds_of_soak[i % len(kinds_of_soak)] for i in range(kills)]
    rng.shuffle(kinds)
    runs: list[list[str]] = []
    for kind in kinds:
        for run in runs:
            if len(run) < per_run and (kind not in RETRIED or sum(k in RETRIED for k in run) < 2):
                run.append(kind)
                break
        else:
            runs.append([kind])
    planned = []
    for index, kinds_of_run in enumerate(runs):
        # one target per equal slice of 10%..85% of the run's steps: kills spread over the run, in order
        lo, hi = 0.10 * total_steps, 0.85 * total_steps
        width = (hi - lo) / len(kinds_of_run)
        targets = [int(lo + width * (i + rng.random())) for i in range(len(kinds_of_run))]
        rng.shuffle(kinds_of_run)
        planned.append(
            [Kill(index, kind, target) for kind, target in zip(kinds_of_run, targets, strict=True)]
        )
    return planned


# -- checks after a run ----------------------------------------------------------------------


def read_json(s3, bucket: str, key: str) -> Any:
    return json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())


def passes(s3, bucket: str, prefix: str) -> list[dict[str, Any]]:
    """The run's sync pass manifests, oldest first, each with the time S3 stored it."""
    found = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=pass_prefix(prefix)):
        for item in page.get("Contents", []):
            doc = read_json(s3, bucket, item["Key"])
            doc["_stored"] = item["LastModified"].timestamp()
            found.append(doc)
    return sorted(found, key=lambda d: d["pass"])


def committed_checkpoint(manifests: list[dict[str, Any]], before: float) -> int | None:
    """The newest checkpoint step that a complete pass stored before ``before`` lists (data, index and `checkpoint`)."""
    best = None
    for doc in manifests:
        if doc["_stored"] >= before or not doc.get("complete"):
            continue
        paths = {f["path"] for f in doc["files"] if f["area"] == "checkpoints"}
        if "checkpoint" not in paths:
            continue
        for path in paths:
            if m := re.fullmatch(r"ckpt-(\d+)\.index", path):
                if any(p.startswith(f"ckpt-{m.group(1)}.data-") for p in paths):
                    best = max(best or 0, int(m.group(1)))
    return best


EVALUATE = r"""
import json, sys, zipfile, tempfile
from pathlib import Path
import keras
from trainer.image_classifier.config import ClassifierConfig
from trainer.image_classifier.data import ImagePipeline, split_files
from trainer.image_classifier.prepare import prepare_images
model_path, archive, params = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
with tempfile.TemporaryDirectory() as tmp:
    zipfile.ZipFile(archive).extractall(tmp)
    config = ClassifierConfig(data_dir=tmp, checkpoint_dir=tmp, output_dir=tmp, **params)
    folder = prepare_images(Path(tmp), config, Path(tmp) / "prepared", environ={})
    train, val = split_files(folder.files, config.validation_split, config.seed)
    pipeline = ImagePipeline(folder, train, val, config)
    model = keras.models.load_model(model_path)
    correct = count = 0
    for images, labels in pipeline.val_dataset():
        predicted = model(images, training=False).numpy().argmax(axis=-1)
        correct += int((predicted == labels.numpy().reshape(-1)).sum())
        count += int(predicted.shape[0])
print(json.dumps({"val_accuracy": correct / count, "count": count}))
"""


def check_model(soak: Soak, run_uri: str, observer: Observer, archive: Path, conf: dict) -> list[str]:
    """Why the promoted model is not the one trained across the kills; empty when it is."""
    problems = []
    s3 = soak.s3
    bucket, _, prefix = run_uri[len("s3://") :].partition("/")
    latest = read_json(s3, bucket, f"models/{MODEL}/latest")
    if latest.get("run_uri") != run_uri:
        return [f"models/{MODEL}/latest names {latest.get('run_uri')}, not this run"]
    final = next(d for d in passes(s3, bucket, prefix) if d["pass"] == latest["sync_pass"])
    if not final.get("final") or not final.get("complete"):
        problems.append(f"the promoted pass {final['pass']} is not a complete final pass")
    outputs = {f["path"]: f for f in final["files"] if f["area"] == "output"}
    version_prefix = latest["uri"][len(f"s3://{bucket}/") :]
    for path, entry in outputs.items():
        head = s3.head_object(Bucket=bucket, Key=version_prefix + path)
        sha = {k.lower(): v for k, v in head.get("Metadata", {}).items()}.get("sha256")
        if head["ContentLength"] != entry["size"] or (sha is not None and sha != entry["sha256"]):
            problems.append(f"promoted {path} differs from the final pass's")
    snapshot = observer.snapshot()
    finisher = [p for p in snapshot if p["done_steps"] is not None]
    if not finisher:
        problems.append("no trainer logged `done`")
    elif final["pod"] != finisher[-1]["name"]:
        problems.append(
            f"the final pass was written by {final['pod']}, the trainer that finished ran in {finisher[-1]['name']}"
        )
    metrics = read_json(s3, bucket, version_prefix + "metrics.json")
    run_metrics = read_json(s3, bucket, f"{prefix}/output/metrics.json")
    if metrics != run_metrics:
        problems.append("the promoted metrics.json is not the run's")
    spe = next((p["steps_per_epoch"] for p in snapshot if p["steps_per_epoch"]), None)
    if spe and metrics["steps"] != conf["epochs"] * spe:
        problems.append(
            f"metrics.json counts {metrics['steps']} steps, {conf['epochs']} epochs x {spe} is {conf['epochs'] * spe}"
        )
    if metrics["epochs"] != conf["epochs"]:
        problems.append(f"metrics.json counts {metrics['epochs']} epochs, the run had {conf['epochs']}")
    history = (
        s3.get_object(Bucket=bucket, Key=f"{prefix}/output/history.csv")["Body"]
        .read()
        .decode()
        .splitlines()[1:]
    )
    epochs = [int(row.split(",")[0]) for row in history]
    if epochs != list(range(1, conf["epochs"] + 1)):
        problems.append(f"history.csv has epochs {epochs}")
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / "model.keras"
        s3.download_file(bucket, version_prefix + "model.keras", str(local))
        params = {"image_size": conf["image_size"], "batch_size": conf["batch_size"], "validation_split": 0.2}
        out = subprocess.run(
            [str(TRAINER_PYTHON), "-c", EVALUATE, str(local), str(archive), json.dumps(params)],
            cwd=REPO,
            capture_output=True,
            text=True,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        )
    if out.returncode:
        problems.append(f"evaluating the promoted model failed: {out.stderr[-500:]}")
    else:
        scored = json.loads(out.stdout.strip().splitlines()[-1])
        claimed = metrics["final"]["val_accuracy"]
        if abs(scored["val_accuracy"] - claimed) > 0.5 / scored["count"]:
            problems.append(
                f"the promoted model scores val_accuracy {scored['val_accuracy']:.4f}, metrics.json says {claimed:.4f}"
            )
    return problems


def orphans(soak: Soak, run_label: str, wait: float = 120) -> list[str]:
    """Pods of the run still there ``wait`` seconds after it ended (a pod being deleted may finish first)."""
    deadline = time.monotonic() + wait
    while True:
        pods = soak.core.list_namespaced_pod(
            soak.namespace, label_selector=f"kubetrain.io/dag-id={DAG_ID},kubetrain.io/run-id={run_label}"
        ).items
        if not pods or time.monotonic() > deadline:
            return [p.metadata.name for p in pods]
        time.sleep(1)


def resolve(kills: list[Kill], observer: Observer, manifests: list[dict[str, Any]]) -> None:
    """What each fired kill led to: the same trainer went on, or the next pod's trainer started at R."""
    pods = observer.snapshot()
    fired = [k for k in kills if k.fired_at is not None]
    for i, kill in enumerate(fired):
        until = fired[i + 1].fired_at if i + 1 < len(fired) else float("inf")
        starts = [
            p
            for p in pods
            if p["started_at"] and kill.fired_at < p["started_at"] < until and p["name"] != kill.pod
        ]
        if kill.kind in SIGTERMED:
            sigterm = [
                c
                for p in pods
                if p["name"] == kill.pod
                for c in p["checkpoints"]
                if c[2].startswith("SIGTERM")
            ]
            if sigterm:
                kill.step_at_kill, kill.exact = sigterm[-1][1], True
        if not starts:
            kill.outcome = "continued"
            kill.lost = 0
            continue
        start = starts[0]
        kill.resumed_at = start["start_step"]
        kill.outcome = "resumed" if kill.resumed_at > 0 else "restarted from 0"
        if kill.step_at_kill is not None:
            kill.lost = kill.step_at_kill - kill.resumed_at
        committed = committed_checkpoint(manifests, start["created"])
        kill.committed_before_restart = committed is not None
        if committed is not None and kill.resumed_at < committed:
            kill.notes.append(
                f"resumed at {kill.resumed_at} although ckpt-{committed} was committed before the pod started"
            )


# -- set-up ----------------------------------------------------------------------------------


def publish_images(stack) -> None:
    """The CPU trainer and sync images, built from their Dockerfiles (cached under .tools/), in the stack's registry."""
    from kubetrain.imagebuild.buildah import BuildahBuilder
    from kubetrain.imagebuild.builders import PushTarget
    from kubetrain.imagebuild.products import SYNC, TRAINER_CPU, ImagePublisher

    rootfs = REPO / ".tools" / "images" / "bookworm-python.tar"
    if not rootfs.exists():
        raise SystemExit(f"{rootfs} is missing: run `make images-base`")
    registry = stack.load_state()["registry"]
    builder = BuildahBuilder(REPO / ".tools" / "buildah", storage_driver="auto", log=lambda line: None)
    publisher = ImagePublisher(
        builder, REPO / "trainer", REPO / ".tools" / "images" / "oci", log=lambda line: None
    )
    publisher.publish(
        [TRAINER_CPU, SYNC],
        lambda item: PushTarget(registry, item.repository, insecure=True),
        base="debian",
        rootfs=rootfs,
    )


def median(values: list[int]) -> str:
    return f"{statistics.median(values):g}" if values else "-"


def report(
    kills: list[Kill], runs: list[dict[str, Any]], interval: int | None, args, wall: float, machine: str
) -> str:
    rows = []
    for kind in args.kinds:
        of_kind = [k for k in kills if k.kind == kind]
        fired = [k for k in of_kind if k.fired_at is not None]
        lost = [k.lost for k in fired if k.lost is not None]
        runs_of_kind = {k.run for k in fired}
        retries = [k.retries() for k in fired]
        unknown = sum(r is None for r in retries)
        rows.append(
            f"| {kind} | {len(fired)}/{len(of_kind)} | {sum(k.outcome == 'continued' for k in fired)} | "
            f"{sum(k.outcome == 'resumed' for k in fired)} | "
            f"{sum(k.outcome == 'restarted from 0' for k in fired)} "
            f"({sum(k.outcome == 'restarted from 0' and bool(k.committed_before_restart) for k in fired)}) | "
            f"{sum(r or 0 for r in retries)}{f' ({unknown} unread)' if unknown else ''} | "
            f"{median(lost)} | {max(lost) if lost else '-'} | "
            f"{sum(len(runs[r]['orphans']) for r in runs_of_kind)} | "
            f"{sum(bool(runs[r]['model_problems']) for r in runs_of_kind)} |"
        )
    fired = [k for k in kills if k.fired_at is not None]
    ok_runs = sum(r["state"] == "success" for r in runs)
    bound = (interval or 0) + 1
    over = [k for k in fired if k.lost is not None and k.lost > bound]
    from0 = [k for k in fired if k.outcome == "restarted from 0" and k.committed_before_restart]
    replaced = [k for k in fired if k.kind in REPLACED]
    command = args.command or "make bench BENCH=kill_soak"
    lines = [
        f"Command: `{command}` (seed {args.seed}, {args.kills} kills of {', '.join(args.kinds)}; "
        f"train_image_classifier on the digits data, {args.epochs} epochs of {interval or '?'} steps, image size "
        f"{args.image_size}, batch 64, sync interval 2 s; a real scheduler and triggerer (LocalExecutor) against "
        f"the dev stack; {len(runs)} DAG runs of up to {args.per_run} kills, {wall / 60:.0f} min).",
        "",
        machine,
        "",
        "| kind | fired | went on | resumed | from 0 (after a committed pass) | retries used | steps lost median | max | orphan pods | wrong final model |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Resumed or went on: {sum(k.outcome in ('continued', 'resumed') for k in fired)}/{len(fired)}; "
        f"restarts from 0 after a committed pass: {len(from0)}; kills that lost more than one checkpoint "
        f"interval + the step in flight ({bound} steps): {len(over)}; retries used by the kills the task "
        f"replaces in the same try ({', '.join(k for k in REPLACED if k in args.kinds) or 'none here'}): "
        f"{sum(k.retries() or 0 for k in replaced)}"
        f"{f' ({sum(k.retries() is None for k in replaced)} unread)' if any(k.retries() is None for k in replaced) else ''}; "
        f"DAG runs that succeeded: {ok_runs}/{len(runs)}; "
        f"orphan pods: {sum(len(r['orphans']) for r in runs)}; runs whose promoted model is wrong: "
        f"{sum(bool(r['model_problems']) for r in runs)}.",
        "",
        "The checkpoint interval is one epoch: the trainer checkpoints at every epoch end (and every "
        f"{PERIODIC_CHECKPOINT} steps, more than an epoch here) and on SIGTERM. Steps lost = the step the trainer "
        "had reached when killed minus the step the next pod resumed at (0 when the same trainer went on). "
        '"went on": the kill did not stop the trainer (sidecar, Airflow, API server); a wrong final model is a '
        "promoted model that is not the final pass's outputs, was not written by the trainer that finished, "
        "miscounts steps or epochs, or does not score on the validation split what metrics.json says.",
        "",
        "The kinds: pod_delete deletes the training pod through the API (SIGTERM to the trainer, which "
        "checkpoints, then the sidecar's final pass, as a preemption); trainer_sigkill and sidecar_sigkill "
        "SIGKILL that container's main process from the node (an OOM kill; the step at the kill is estimated "
        "from the trainer's last logged step and rate); airflow_restart SIGKILLs the Airflow process that "
        "holds the deferred training task (the triggerer, or the scheduler with its LocalExecutor, in turn) "
        "and starts a new one, as a supervisor would; kubeapi_pause stops the Kubernetes API server "
        "(SIGSTOP) for 5-20 s, then lets it go on; evict evicts the training pod through the Eviction API "
        "(policy/v1, the cluster admin's identity), as a node drain; kueue_preempt runs are queued "
        f"(queue={LOCAL_QUEUE}, priority=low) and a high-priority pod asking for the ClusterQueue's whole CPU "
        f"quota ({QUEUE_CPU}) makes Kueue preempt the training pod, and is deleted once that pod is gone, so "
        "that the task's next pod is admitted again. Retries used: the training task's try_number once the "
        "kill had settled minus the one just before it (pod_delete, evict and kueue_preempt must use none: "
        "the task replaces the pod in the same try).",
        "",
        "**Not measured: a restart of the dev stack's API server.** It keeps its objects in memory and runs "
        "the pods' containers as its own children, which die with it, so restarting it is a lost node and a "
        "wiped cluster at once: no real cluster does that (a real API server restarts against etcd while the "
        "kubelets keep the pods running). The API outage that a restart causes is what kubeapi_pause measures.",
        "",
        "Every kill:",
        "",
        "| run | kind | variant | pod | step at kill | outcome | resumed at | steps lost | try | notes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k in kills:
        step = "-" if k.step_at_kill is None else f"{k.step_at_kill}{'' if k.exact else ' (est.)'}"
        tries = "-" if k.fired_at is None else f"{k.tries_before or '?'} -> {k.tries_after or '?'}"
        lines.append(
            f"| {k.run + 1} | {k.kind} | {k.variant or '-'} | {k.pod or '-'} | {step} | {k.outcome} | "
            f"{'-' if k.resumed_at is None else k.resumed_at} | {'-' if k.lost is None else k.lost} | {tries} | "
            f"{'; '.join(k.notes) or '-'} |"
        )
    bad = [
        f"run {i + 1} ({r['run_id']}): {r['state']}; {'; '.join(r['model_problems'] + r['notes'])}"
        for i, r in enumerate(runs)
        if r["state"] != "success" or r["model_problems"] or r["notes"]
    ]
    if bad:
        lines += ["", "Runs with problems:", "", *[f"- {b}" for b in bad]]
    return "\n".join(lines) + "\n"


def kinds_arg(text: str) -> tuple[str, ...]:
    """The --kinds option: comma-separated names from KINDS.

    :param text: the option's value.
    """
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(
            f"unknown kinds of kill {', '.join(map(repr, unknown)) or '(none given)'}: expected some of {', '.join(KINDS)}"
        )
    return kinds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--per-run", type=int, default=4, help="kills per DAG run")
    parser.add_argument(
        "--kinds",
        type=kinds_arg,
        default=KINDS,
        help=f"comma-separated kinds of kill, shared out equally (default: all, {','.join(KINDS)})",
    )
    parser.add_argument("--stack-dir", type=Path, help="a running dev stack to use (default: a private one)")
    parser.add_argument(
        "--keep", action="store_true", help="keep the Airflow home and the private stack's files"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "kill_soak.md")
    parser.add_argument(
        "--observations",
        type=Path,
        default=Path(tempfile.gettempdir()) / "kubetrain-kill-soak.json",
        help="where every observation goes (JSON)",
    )
    args = parser.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    args.command = f".venv/bin/python bench/bench_kill_soak.py {' '.join(given)}" if given else None

    from include.airflow_ui import AirflowUI
    from include.devstack.stack import Stack, free_port
    from kubetrain.pod_spec import label_value

    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="kubetrain-soak-"))
    stack = Stack(args.stack_dir) if args.stack_dir else Stack(tmp / "stack")
    own_stack = args.stack_dir is None
    if own_stack:
        stack.up()
    ui = None
    kills: list[Kill] = []
    runs: list[dict[str, Any]] = []
    spe = None
    try:
        stack_env = stack.env()
        kubeapi_pid = stack.load_state()["components"]["kubeapi"]["pid"]
        print("kill soak: images to the stack's registry ...", flush=True)
        publish_images(stack)
        archive = tmp / "digits.zip"
        subprocess.run(
            [str(TRAINER_PYTHON), "-m", "include.sample_data.digits", "--out", str(archive)],
            cwd=REPO,
            check=True,
        )
        ui = AirflowUI(
            tmp / "airflow",
            stack_env,
            port=free_port(),
            pool_slots=1,
            paused_at_creation=True,
            env={
                "KUBETRAIN_RETRY_DELAY_SECONDS": "1",
                "KUBETRAIN_IMAGE_CLASSIFIER_CRON": "",
                "KUBETRAIN_IMAGE_BUILD_CRON": "",
            },
        )
        print(f"kill soak: starting Airflow ({ui.home}) ...", flush=True)
        ui.start()
        ui.wait_dags([DAG_ID], timeout=300)
        ui.set_paused(DAG_ID, False)
        soak = Soak(
            stack_env, ui, kubeapi_pid, args.seed, args.epochs, stack.load_state()["kubeconfig_admin"]
        )
        soak.s3.upload_file(str(archive), "datasets", DATASET_KEY)
        conf = {
            "dataset_uri": f"s3://datasets/{DATASET_KEY.split('/')[0]}/",
            "model_name": MODEL,
            "epochs": args.epochs,
            "image_size": args.image_size,
            "batch_size": 64,
            "sync_interval": 2,
            "promote": "always",
            "force": True,
        }
        # 1437 training images of the 1,797 at validation split 0.2, 64 a batch: 22 steps an epoch
        planned = plan(args.kills, args.seed, args.epochs * 22, args.per_run, args.kinds)
        for index, run_kills in enumerate(planned):
            kills += run_kills
            queued = any(k.kind in QUEUED for k in run_kills)
            run_id = ui.trigger(DAG_ID, {**conf, "queue": LOCAL_QUEUE, "priority": "low"} if queued else conf)
            print(
                f"kill soak: run {index + 1}/{len(planned)} {run_id}{' (queued, priority low)' if queued else ''}: "
                + ", ".join(f"{k.kind}@{k.target}" for k in run_kills),
                flush=True,
            )
            record: dict[str, Any] = {
                "run_id": run_id,
                "state": None,
                "orphans": [],
                "model_problems": [],
                "notes": [],
            }
            runs.append(record)
            with Observer(soak.core, soak.namespace, label_value(run_id)) as observer:
                for kill in run_kills:
                    pod = soak.wait_kill_point(kill, observer, run_id, time.monotonic() + 1800)
                    if pod is None:
                        kill.notes.append("the run ended before the kill point")
                        continue
                    kill.tries_before = soak.tries(run_id)
                    soak.fire(kill, observer, pod)
                    print(
                        f"  {kill.kind}{' (' + kill.variant + ')' if kill.variant else ''} of {pod.name} "
                        f"at step ~{kill.step_at_kill}",
                        flush=True,
                    )
                    if kill.fired_at is not None:
                        soak.settle(kill, observer, run_id)
                        kill.tries_after = soak.tries(run_id)
                final = ui.wait_run(DAG_ID, run_id, timeout=3600)
                record["state"] = final["state"]
                ti = soak.ti(run_id)
                record["train_tries"] = ti.get("try_number")
                label = label_value(run_id)
                record["orphans"] = orphans(soak, label)
                time.sleep(1)  # the last log lines
            run_uri = soak.xcom(run_id, "train", "run_uri")
            bucket, _, prefix = run_uri[len("s3://") :].partition("/")
            manifests = passes(soak.s3, bucket, prefix)
            resolve(run_kills, observer, manifests)
            spe = spe or next(
                (p["steps_per_epoch"] for p in observer.snapshot() if p["steps_per_epoch"]), None
            )
            if record["state"] == "success":
                record["model_problems"] = check_model(soak, run_uri, observer, archive, conf)
            else:
                record["notes"] += ui.task_errors(DAG_ID, run_id, "train")
            record["pods"] = observer.snapshot()
            record["passes"] = [
                {k: v for k, v in d.items() if k != "files"} | {"files": [f["path"] for f in d["files"]]}
                for d in manifests
            ]
            for kill in run_kills:
                print(
                    f"  -> {kill.kind}: {kill.outcome}, step {kill.step_at_kill}, resumed at {kill.resumed_at}, "
                    f"lost {kill.lost}, try {kill.tries_before} -> {kill.tries_after} {'; '.join(kill.notes)}",
                    flush=True,
                )
            print(
                f"  run {record['state']}, train tries {record.get('train_tries')}, orphans {record['orphans']}, "
                f"model problems {record['model_problems']}",
                flush=True,
            )
    finally:
        if ui is not None:
            ui.stop()
        if own_stack:
            stack.down()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    machine = (
        f"Run on {time.strftime('%Y-%m-%d', time.gmtime())}: {os.cpu_count()} CPU cores, no GPU (every figure is "
        f"CPU-only), other work sharing the cores (load average {os.getloadavg()[0]:.1f} at the end)."
    )
    text = report(kills, runs, spe, args, time.monotonic() - started, machine)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"every observation: {args.observations}")
    args.observations.write_text(
        json.dumps({"kills": [asdict(k) for k in kills], "runs": runs}, indent=1, default=str)
    )
    fired = [k for k in kills if k.fired_at is not None]
    ok = (
        len(fired) == len(kills)
        and all(k.outcome in ("continued", "resumed") for k in fired)
        and all(k.lost is not None and k.lost <= (spe or 0) + 1 for k in fired)
        and all(k.retries() == 0 for k in fired if k.kind in REPLACED)
        and all(r["state"] == "success" and not r["orphans"] and not r["model_problems"] for r in runs)
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
