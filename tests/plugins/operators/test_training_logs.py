"""The training pod's log lines in the task log while the task is deferred, on the dev stack.

The trigger is run in this process as the triggerer runs it; its log records are what the
triggerer writes into the task's log. A training container that prints lines over several
seconds shows that they arrive while it still runs, each once, marked by container, with
the stage-in and checkpoint-sync containers' lines beside them; a failed pod's last lines
and its events reach the log when the task resumes.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest
import structlog
from airflow.sdk import DAG
from airflow.sdk.exceptions import AirflowException, AirflowFailException, TaskDeferred
from airflow.sdk.execution_time.context import OutletEventAccessors

from include.devstack.stack import NAMESPACE, s3_client
from kubetrain.operators.resumable import NOTES_XCOM_KEY
from kubetrain.operators.stage import StageDatasetOperator
from kubetrain.operators.training import TrainingPodOperator
from kubetrain.pod_startup import NOTES_KEY
from kubetrain.triggers.pod import LOGS_FLUSHED_KEY, TrainingPodTrigger

# Prints a line a second, then keeps running: the lines must reach the log before it exits.
TICKING = r"""
import sys, time
for n in range(1, 6):
    print(f"tick {n} of 5", flush=True)
    time.sleep(1)
time.sleep(8)
print("last line before exit", flush=True)
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""
# Leaves at once with the exit code it is given.
EXITING = r"""
import sys
print(f"leaving with exit code {sys.argv[1]}", flush=True)
sys.exit(int(sys.argv[1]))
"""


class TaskInstance:
    def __init__(self, dag_id: str, task_id: str) -> None:
        self.dag_id, self.task_id, self.try_number, self.map_index = dag_id, task_id, 1, -1
        self.xcom: dict[str, object] = {}

    def xcom_push(self, key: str, value: object) -> None:
        self.xcom[key] = value


class Records:
    """Every line logged (through Airflow's structlog loggers) inside ``with records:``, with its time."""

    def __init__(self) -> None:
        self.entries: list[dict] = []
        self._processors = None

    def __enter__(self) -> Records:
        def keep(logger, method_name, event_dict):
            self.entries.append({**event_dict, "at": time.time()})
            raise structlog.DropEvent

        self._processors = structlog.get_config()["processors"]
        structlog.configure(processors=[keep])
        return self

    def __exit__(self, *exc: object) -> None:
        structlog.configure(processors=self._processors)

    def lines(self) -> list[str]:
        return [str(e["event"]) for e in self.entries]

    def first(self, text: str) -> dict:
        for entry in self.entries:
            if text in str(entry["event"]):
                return entry
        raise AssertionError(f"no log line with {text!r}; lines: {self.lines()[-40:]}")


@pytest.fixture
def stack_env(devstack, stack_images, monkeypatch):
    env = devstack.env()
    for name in ("AIRFLOW_CONN_AWS_DEFAULT", "KUBETRAIN_REGISTRY", "AIRFLOW_CONN_KUBETRAIN_REGISTRY_DEFAULT"):
        monkeypatch.setenv(name, env[name])
    # In-process, the kubeconfig goes by the connection: the kubernetes client read $KUBECONFIG
    # when it was imported, before this test could set it.
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv(
        "AIRFLOW_CONN_KUBERNETES_DEFAULT",
        json.dumps(
            {
                "conn_type": "kubernetes",
                "extra": {"kube_config_path": env["KUBECONFIG"], "namespace": NAMESPACE},
            }
        ),
    )
    for name in (
        "KUBETRAIN_TRAINING_BUCKET",
        "AIRFLOW_VAR_KUBETRAIN_TRAINING_BUCKET",
        "KUBETRAIN_GPU_RESOURCE",
    ):
        monkeypatch.delenv(name, raising=False)
    return env


@pytest.fixture
def staged(stack_env):
    s3 = s3_client(stack_env)
    dataset = f"logs-{uuid.uuid4().hex[:8]}"
    s3.put_object(Bucket="datasets", Key=f"{dataset}/table.csv", Body=b"a,b\n1,2\n")
    return StageDatasetOperator(task_id="stage", source_uri=f"s3://datasets/{dataset}/").execute(
        {"outlet_events": OutletEventAccessors()}
    )


def ticking_pod(
    env: dict,
    staged: dict,
    *,
    exit_code: int = 0,
    gpus: int = 0,
    script: str = TICKING,
    deferrable: bool = True,
) -> tuple[TrainingPodOperator, dict]:
    with DAG(f"logs_{uuid.uuid4().hex[:8]}", schedule=None) as dag:
        train = TrainingPodOperator(
            task_id="train",
            image=f"{env['KUBETRAIN_REGISTRY']}/kubetrain/trainer:latest-cpu",
            sync_image=f"{env['KUBETRAIN_REGISTRY']}/kubetrain/sync:latest",
            cmds=["python", "-c", script, str(exit_code)],
            dataset_manifest=staged["manifest_uri"],
            dataset_version=staged["version"],
            s3_secret=env["KUBETRAIN_S3_SECRET"],
            gpus=gpus,
            sync_interval=1,
            sync_quiet=0,
            termination_grace_period=20,
            cpu="250m",
            memory="512Mi",
            startup_check_interval_seconds=1,
            poll_interval=1,
            logging_interval=1,
            retries=2,
            deferrable=deferrable,
        )
    ti = TaskInstance(dag.dag_id, "train")
    context = {
        "ti": ti,
        "run_id": "manual__logs",
        "dag": dag,
        "dag_run": SimpleNamespace(run_after=datetime.now(UTC)),
    }
    return train, context


def run_trigger(trigger: TrainingPodTrigger, records: Records) -> dict:
    """Run the trigger as the triggerer does (rebuilt from its serialized form); its records go to ``records``."""
    trigger = TrainingPodTrigger(**trigger.serialize()[1])

    async def first_event():
        async for event in trigger.run():
            return event.payload

    with records:
        return asyncio.run(first_event())


def pod_of(train: TrainingPodOperator, context: dict):
    name = context["ti"].xcom["pod_name"]
    return train.client.read_namespaced_pod(name, NAMESPACE)


def test_lines_of_every_container_reach_the_log_while_the_pod_runs(stack_env, staged):
    train, context = ticking_pod(stack_env, staged, gpus=1)
    with pytest.raises(TaskDeferred) as deferred:
        train.execute(context)
    trigger = deferred.value.trigger
    assert isinstance(trigger, TrainingPodTrigger)
    assert (trigger.logging_interval, trigger.log_containers) == (1, ["stage-in", "checkpoint-sync"])
    records = Records()
    event = run_trigger(trigger, records)
    assert event["status"] == "success", event
    assert event[LOGS_FLUSHED_KEY] is True

    # The first tick was in the log well before the training container ended (it sleeps 8 s
    # after its fifth tick): the log follows the pod, it does not wait for it.
    pod = pod_of(train, context)
    base = next(s for s in pod.status.container_statuses if s.name == "base")
    finished = base.state.terminated.finished_at.timestamp()
    assert records.first("[base] tick 1 of 5")["at"] < finished - 5, (
        records.first("[base] tick 1 of 5"),
        finished,
    )
    # Each line once, in order, and the last one too (read when the pod ended).
    lines = records.lines()
    ticks = [line for line in lines if line.startswith("[base] tick")]
    assert ticks == [f"[base] tick {n} of 5" for n in range(1, 6)], ticks
    assert lines.count("[base] last line before exit") == 1
    # The stage-in and checkpoint-sync containers' lines are there, marked by their container.
    assert any(line.startswith("[stage-in] ") for line in lines), lines[:40]
    assert any(line.startswith("[checkpoint-sync] ") for line in lines), lines[:40]
    # The dev stack has no GPU: the request was served on CPU, and the log says so in one line.
    notes = event[NOTES_KEY]
    assert (
        len(notes) == 1
        and notes[0].startswith("GPU request served on CPU: pod ")
        and "nvidia.com/gpu" in notes[0]
    )
    assert notes[0] in lines

    # The task resumes: the trigger read the logs to their end, so the training container's
    # lines are not logged a second time; the note goes to XCom for the report.
    with Records() as resumed:
        getattr(train, deferred.value.method_name)(context, event)
    assert not [line for line in resumed.lines() if "tick" in line], resumed.lines()
    assert context["ti"].xcom[NOTES_XCOM_KEY] == notes


def test_a_failed_pod_leaves_its_last_lines_states_and_events_in_the_log(stack_env, staged):
    train, context = ticking_pod(stack_env, staged, exit_code=3)
    with pytest.raises(TaskDeferred) as deferred:
        train.execute(context)
    records = Records()
    event = run_trigger(deferred.value.trigger, records)
    assert event["status"] == "failed", event
    assert "[base] last line before exit" in records.lines()

    # Exit code 3 (training diverged) would fail again: the task fails without its retries, in words.
    with Records() as resumed, pytest.raises(AirflowFailException) as failure:
        getattr(train, deferred.value.method_name)(context, event)
    name = context["ti"].xcom["pod_name"]
    assert str(failure.value).startswith(
        f"the base container of pod {name} exited with 3: training diverged"
    ), failure.value
    text = "\n".join(resumed.lines())
    # The containers' states (the base container's exit code) and the pod's events.
    assert "Container 'base': state='TERMINATED', reason='Error', exit_code=3" in text, text[-3000:]
    assert "Pod Event: Scheduled - Successfully assigned" in text, text[-3000:]
    assert context["ti"].xcom[NOTES_XCOM_KEY] == []


def test_a_pod_stopped_after_its_checkpoint_is_retried(stack_env, staged):
    # 75: stopped by SIGTERM after writing a checkpoint; the next try resumes from it.
    train, context = ticking_pod(stack_env, staged, exit_code=75, script=EXITING)
    with pytest.raises(TaskDeferred) as deferred:
        train.execute(context)
    event = run_trigger(deferred.value.trigger, Records())
    assert event["status"] == "failed", event
    with Records(), pytest.raises(AirflowException) as failure:
        getattr(train, deferred.value.method_name)(context, event)
    assert not isinstance(failure.value, AirflowFailException), failure.value
    assert "returned a failure" in str(failure.value), failure.value


def test_a_task_that_waits_in_the_worker_logs_the_last_lines_once(stack_env, staged):
    # The training container's log ends as it exits, a moment before the kubelet says so: the
    # provider then read the log again from a second before its end and logged the last lines twice
    train, context = ticking_pod(stack_env, staged, deferrable=False)
    with Records() as records:
        train.execute(context)
    lines = [line.rstrip("\n") for line in records.lines()]
    ticks = [line for line in lines if line.startswith("[base] tick")]
    assert ticks == [f"[base] tick {n} of 5" for n in range(1, 6)], ticks
    assert lines.count("[base] last line before exit") == 1, lines[-30:]
    assert not [line for line in lines if "log read interrupted" in line], lines[-30:]


def test_unusable_data_fails_without_retries_when_not_deferred(stack_env, staged):
    train, context = ticking_pod(stack_env, staged, exit_code=65, script=EXITING, deferrable=False)
    with Records(), pytest.raises(AirflowFailException) as failure:
        train.execute(context)
    name = context["ti"].xcom["pod_name"]
    assert str(failure.value).startswith(f"the base container of pod {name} exited with 65: unusable data"), (
        failure.value
    )
