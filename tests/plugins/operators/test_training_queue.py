"""A training pod that waits in a Kueue queue on the dev stack (its Kueue stand-in: one GPU of quota in
LocalQueue 'training'): the task defers, its start-up budgets do not run while Kueue holds the pod,
the task log says why it waits, and the run starts once the quota is free."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest
from airflow.sdk import DAG
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred
from kubernetes import client, config

# the dev stack's environment and a staged dataset: the fixtures of the log tests
from test_training_logs import TICKING, Records, TaskInstance, run_trigger, stack_env, staged  # noqa: F401

from include.devstack.stack import NAMESPACE
from include.devstack.workloads import queued_pod
from kubetrain.operators.resumable import NOTES_XCOM_KEY
from kubetrain.operators.training import TrainingPodOperator

QUEUED = "is queued in Kueue LocalQueue 'training'"


def holder_pod(name: str) -> dict:
    """A pod that takes the queue's one GPU until it is deleted."""
    return queued_pod(name, {"nvidia.com/gpu": "1"})


def wait_lines(records: Records, text: str, count: int, thread: threading.Thread) -> list[str]:
    """The log lines holding ``text`` once there are ``count`` of them (the trigger thread writes them)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and thread.is_alive():
        found = [line for line in records.lines() if text in line]
        if len(found) >= count:
            return found
        thread.join(0.2)
    raise AssertionError(f"fewer than {count} lines with {text!r}: {records.lines()[-20:]}")


def queued_training(env: dict, dataset: dict, **kwargs) -> tuple[TrainingPodOperator, dict]:
    """A training task in LocalQueue 'training' asking for the queue's one GPU, and its context."""
    with DAG(f"queue_{uuid.uuid4().hex[:8]}", schedule=None, render_template_as_native_obj=True) as dag:
        train = TrainingPodOperator(
            task_id="train",
            image=f"{env['KUBETRAIN_REGISTRY']}/kubetrain/trainer:latest-cpu",
            sync_image=f"{env['KUBETRAIN_REGISTRY']}/kubetrain/sync:latest",
            cmds=["python", "-c", kwargs.pop("script", TICKING), "0"],
            dataset_manifest=dataset["manifest_uri"],
            dataset_version=dataset["version"],
            s3_secret=env["KUBETRAIN_S3_SECRET"],
            gpus=kwargs.pop("gpus", 1),
            local_queue=kwargs.pop("local_queue", "training"),
            # budgets far shorter than the wait: only queue_timeout may end it
            schedule_timeout_seconds=2,
            startup_timeout_seconds=60,
            queue_timeout_seconds=300,
            queue_log_interval_seconds=1,
            sync_interval=1,
            sync_quiet=0,
            termination_grace_period=20,
            cpu="250m",
            memory="512Mi",
            startup_check_interval_seconds=1,
            poll_interval=1,
            logging_interval=1,
            **kwargs,
        )
    context = {
        "ti": TaskInstance(dag.dag_id, "train"),
        "run_id": "manual__queue",
        "dag": dag,
        "dag_run": SimpleNamespace(run_after=datetime.now(UTC)),
    }
    return train, context


def ticking(train: TrainingPodOperator, context: dict) -> tuple[TaskDeferred, str, threading.Thread, dict]:
    """Submit the task's pod and follow it with its trigger in a thread until the script ticks twice:
    the deferral, the pod's name, the trigger's thread and the dict its event will be put in."""
    with pytest.raises(TaskDeferred) as deferred:
        train.execute(context)
    records = Records()
    thread, result = in_thread(deferred.value.trigger, records)
    wait_lines(records, "[base] tick 2 of 15", 1, thread)
    return deferred.value, context["ti"].xcom["pod_name"], thread, result


def in_thread(trigger, records: Records) -> tuple[threading.Thread, dict]:
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(event=run_trigger(trigger, records)), daemon=True)
    thread.start()
    return thread, result


def test_a_queued_run_waits_past_its_start_up_budgets_and_starts_when_the_quota_frees(stack_env, staged):  # noqa: F811
    core = client.CoreV1Api(config.new_client_from_config(stack_env["KUBECONFIG"]))
    holder = f"holder-{uuid.uuid4().hex[:6]}"
    core.create_namespaced_pod(NAMESPACE, holder_pod(holder))
    try:
        train, context = queued_training(stack_env, staged)
        with pytest.raises(TaskDeferred) as deferred:
            train.execute(context)
        pod_name = context["ti"].xcom["pod_name"]
        pod = core.read_namespaced_pod(pod_name, NAMESPACE)
        assert pod.metadata.labels["kueue.x-k8s.io/queue-name"] == "training"
        assert [g.name for g in pod.spec.scheduling_gates] == ["kueue.x-k8s.io/admission"]

        records = Records()
        thread, result = in_thread(deferred.value.trigger, records)
        lines = wait_lines(records, QUEUED, 4, thread)  # 3 s and more past schedule_timeout=2
        assert "insufficient unused quota for nvidia.com/gpu" in lines[-1], lines[-1]
        assert "(Workload pod-" in lines[-1], lines[-1]
        core.delete_namespaced_pod(holder, NAMESPACE, grace_period_seconds=0)
        thread.join(300)
        event = result["event"]
        assert event["status"] == "success", event
        assert any("[base] last line before exit" in line for line in records.lines())
        getattr(train, deferred.value.method_name)(context, event)
    finally:
        try:
            core.delete_namespaced_pod(holder, NAMESPACE, grace_period_seconds=0)
        except client.ApiException:
            pass


# Ticks for about 15 s, long enough to be preempted while it runs; on SIGTERM it takes 3 s to save a
# checkpoint and leaves with 75, as the trainers do.
LONG_TICKING = (
    "import signal, sys, time\n"
    "def stop(*_):\n"
    "    print('checkpointing before exit', flush=True)\n"
    "    time.sleep(3)\n"
    "    sys.exit(75)\n"
    "signal.signal(signal.SIGTERM, stop)\n"
    + TICKING.replace("range(1, 6)", "range(1, 16)").replace("of 5", "of 15")
)


@pytest.mark.parametrize("allowed", [20, 0], ids=["resumed", "past-max-preemptions"])
def test_a_preempted_run_gets_a_new_pod_in_the_same_try(stack_env, staged, allowed):  # noqa: F811
    core = client.CoreV1Api(config.new_client_from_config(stack_env["KUBECONFIG"]))
    holder = f"high-{uuid.uuid4().hex[:6]}"
    try:
        train, context = queued_training(
            stack_env, staged, script=LONG_TICKING, priority_class="low", max_preemptions=allowed
        )
        first, first_pod, thread, result = ticking(train, context)
        # a higher-priority workload arrives: Kueue preempts the running pod
        high = queued_pod(holder, {"nvidia.com/gpu": "1"}, priority="high")
        core.create_namespaced_pod(NAMESPACE, high)
        thread.join(300)
        event = result["event"]
        if allowed == 0:
            with pytest.raises(
                AirflowFailException, match=r"ended from outside 1 times in this try .*max_preemptions=0"
            ):
                getattr(train, first.method_name)(context, event)
            return
        with pytest.raises(TaskDeferred) as second:  # no failure, no retry: a new pod, deferred again
            getattr(train, first.method_name)(context, event)
        second_pod = context["ti"].xcom["pod_name"]
        assert second_pod != first_pod
        assert [g.name for g in core.read_namespaced_pod(second_pod, NAMESPACE).spec.scheduling_gates] == [
            "kueue.x-k8s.io/admission"
        ]  # it queues behind the high-priority pod
        core.delete_namespaced_pod(holder, NAMESPACE, grace_period_seconds=0)
        records = Records()
        thread, result = in_thread(second.value.trigger, records)
        thread.join(300)
        event = result["event"]
        assert event["status"] == "success", event
        getattr(train, second.value.method_name)(context, event)
        notes = context["ti"].xcom[NOTES_XCOM_KEY]
        # why: Kueue's TerminationTarget when the trigger still saw the pod, else "deleted" (it was gone)
        assert any(
            note.startswith(f"pod {first_pod} was ended from outside (pod {first_pod}: ")
            and ("TerminationTarget: WorkloadEvictedDueToPreempted" in note or ": deleted)" in note)
            and "interruption 1 of at most 20" in note
            for note in notes
        ), "\n".join(notes)
    finally:
        try:
            core.delete_namespaced_pod(holder, NAMESPACE, grace_period_seconds=0)
        except client.ApiException:
            pass


def test_an_eviction_through_the_eviction_api_costs_no_retry(stack_env, staged, devstack):  # noqa: F811
    # a drain is a cluster admin's: Airflow's identities may not evict (deploy/rbac.yaml)
    core = client.CoreV1Api(config.new_client_from_config(devstack.load_state()["kubeconfig_admin"]))
    # no queue: a drain evicts pods wherever they came from
    train, context = queued_training(stack_env, staged, script=LONG_TICKING, local_queue="", gpus=0)
    first, first_pod, thread, result = ticking(train, context)
    core.create_namespaced_pod_eviction(
        first_pod,
        NAMESPACE,
        client.V1Eviction(metadata=client.V1ObjectMeta(name=first_pod, namespace=NAMESPACE)),
    )
    thread.join(300)
    with pytest.raises(TaskDeferred) as second:
        getattr(train, first.method_name)(context, result["event"])
    records = Records()
    thread, result = in_thread(second.value.trigger, records)
    thread.join(300)
    assert result["event"]["status"] == "success", result["event"]
    getattr(train, second.value.method_name)(context, result["event"])
    notes = context["ti"].xcom[NOTES_XCOM_KEY]
    assert any(
        note.startswith(f"pod {first_pod} was ended from outside (pod {first_pod}: ")
        and ("DisruptionTarget: EvictionByEvictionAPI" in note or ": deleted)" in note)
        for note in notes
    ), "\n".join(notes)


def test_a_preempted_pod_gone_before_the_completion_wait_is_still_replaced(stack_env, staged):  # noqa: F811
    """Kueue deletes a preempted pod: when it is gone between the trigger's last look (which saw why it
    ended) and the provider's wait for its completion, the provider forgets the pod and raises "Container
    state failed" without the cleanup that tells an interruption from a failure. The task must still
    replace it in the same try. The fault is a timing window: here the pod is deleted for real (through
    the API) at the start of that wait, which then meets the API's real 404."""
    core = client.CoreV1Api(config.new_client_from_config(stack_env["KUBECONFIG"]))
    train, context = queued_training(stack_env, staged, script=LONG_TICKING, local_queue="", gpus=0)
    first, first_pod, thread, result = ticking(train, context)
    # the event the trigger gives after a preemption it saw (failed, with why), while the pod still exists
    event = {
        "status": "failed",
        "namespace": NAMESPACE,
        "name": first_pod,
        "message": "Container state failed",
        "kubetrain_interrupted": "TerminationTarget: WorkloadEvictedDueToPreempted",
    }
    waited = train.pod_manager.await_pod_completion

    def gone_first(pod, *args, **kwargs):
        from kubernetes import watch

        listed = core.list_namespaced_pod(NAMESPACE, field_selector=f"metadata.name={pod.metadata.name}")
        core.delete_namespaced_pod(pod.metadata.name, NAMESPACE, grace_period_seconds=0)
        for change in watch.Watch().stream(
            core.list_namespaced_pod,
            NAMESPACE,
            field_selector=f"metadata.name={pod.metadata.name}",
            resource_version=listed.metadata.resource_version,
            timeout_seconds=120,
        ):
            if change["type"] == "DELETED":
                break
        return waited(pod, *args, **kwargs)  # meets the API's 404

    train.pod_manager.await_pod_completion = gone_first
    try:
        with pytest.raises(TaskDeferred) as second:  # a new pod, deferred again: no failure, no retry
            getattr(train, first.method_name)(context, event)
    finally:
        train.pod_manager.await_pod_completion = waited
    second_pod = context["ti"].xcom["pod_name"]
    assert second_pod != first_pod
    thread.join(300)  # the first pod's trigger ends with it
    (interrupted,) = context["ti"].xcom["disruptions"]["interruptions"]
    assert interrupted["pod"] == first_pod and interrupted["reason"].startswith(f"pod {first_pod}: "), (
        interrupted
    )
    assert isinstance(second.value, TaskDeferred)
    core.delete_namespaced_pod(second_pod, NAMESPACE, grace_period_seconds=0)
