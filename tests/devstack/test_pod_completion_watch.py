"""TrainingPodManager's waits on the local API: the end of a training-shaped pod (a native
sidecar that finishes its work after the main container) comes from a watch, not a read every
2 s, and a pod deleted meanwhile ends the wait with the API's 404; a task that does not defer
sees its pod start on a watch too, not a read every ``startup_check_interval_seconds``."""

from __future__ import annotations

import threading

from kubernetes import watch
from kubernetes.client.rest import ApiException

from kubetrain.operators.training import TrainingPodOperator
from kubetrain.operators.training_pods import TrainingPodManager

from .support import simple_pod, wait_for

NS = "default"


def training_shaped(name: str, main: str) -> dict:
    # The sidecar's SIGTERM comes after the main container's exit; it writes for a moment, as the
    # checkpoint-sync sidecar's final pass does, and exits.
    sidecar = {
        "name": "sync",
        "image": "busybox",
        "restartPolicy": "Always",
        "command": [
            "sh",
            "-c",
            "trap 'sleep 1; echo final-pass >> /w/log; exit 0' TERM; touch /w/trapped; "
            "while true; do sleep 0.1; done",
        ],
        "volumeMounts": [{"name": "w", "mountPath": "/w"}],
    }
    # main starts once the sidecar's trap is set: a SIGTERM before it would end the sidecar in 137
    return simple_pod(
        name,
        f"until [ -e /w/trapped ]; do sleep 0.1; done; {main}",
        initContainers=[sidecar],
        volumes=[{"name": "w", "emptyDir": {}}],
        container={"volumeMounts": [{"name": "w", "mountPath": "/w"}]},
    )


class CountingManager(TrainingPodManager):
    watch_seconds = 600  # longer than any wait here: a second read would mean the watch gave up

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reads = 0

    def read_pod(self, pod):
        self.reads += 1
        return super().read_pod(pod)


def test_the_wait_ends_on_the_watch_event_of_the_pods_end(core):
    core.create_namespaced_pod(NS, training_shaped("completion-watch", "sleep 1; echo trained"))
    pod = core.read_namespaced_pod("completion-watch", NS)
    manager = CountingManager(kube_client=core)
    try:
        remote = manager.await_pod_completion(pod, container_name="main")
        assert remote.status.phase == "Succeeded"
        main = remote.status.container_statuses[0].state.terminated
        sidecar = remote.status.init_container_statuses[0].state.terminated
        assert main.exit_code == 0 and sidecar.exit_code == 0 and sidecar.finished_at >= main.finished_at
        assert manager.reads == 1, "the pod was read again: the wait polled instead of watching"
        # the pod that ended already: no watch at all
        assert manager.await_pod_completion(pod, container_name="main").status.phase == "Succeeded"
    finally:
        core.delete_namespaced_pod("completion-watch", NS)


def test_a_pod_deleted_while_waited_for_ends_the_wait_with_404(core):
    core.create_namespaced_pod(NS, training_shaped("completion-deleted", "sleep 600"))
    pod = core.read_namespaced_pod("completion-deleted", NS)
    wait_for(
        lambda: core.read_namespaced_pod("completion-deleted", NS).status.phase == "Running",
        timeout=120,
        what="the pod to run",
    )
    outcome: dict[str, object] = {}

    def wait() -> None:
        try:
            outcome["pod"] = CountingManager(kube_client=core).await_pod_completion(
                pod, container_name="main"
            )
        except ApiException as exc:
            outcome["error"] = exc

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    core.delete_namespaced_pod("completion-deleted", NS, grace_period_seconds=1)
    waiter.join(timeout=300)
    assert not waiter.is_alive(), "the wait did not end when the pod was deleted"
    if "pod" in outcome:  # the watch saw the terminal status before the pod left the API
        assert outcome["pod"].status.phase in ("Succeeded", "Failed")
    else:
        assert isinstance(outcome.get("error"), ApiException) and outcome["error"].status == 404, outcome

    def gone() -> bool:
        try:
            core.read_namespaced_pod("completion-deleted", NS)
        except ApiException as exc:
            return exc.status == 404
        return False

    wait_for(gone, timeout=120, what="the deleted pod to leave the API")


def test_a_task_that_does_not_defer_sees_its_pod_start_on_a_watch(core):
    core.create_namespaced_pod(NS, training_shaped("start-watch", "sleep 600"))
    pod = core.read_namespaced_pod("start-watch", NS)
    # a poll would read the pod a second time after 600 s: only a watch can see the start sooner
    operator = TrainingPodOperator(
        task_id="start_watch", deferrable=False, startup_check_interval_seconds=600
    )
    operator.pod_manager = manager = CountingManager(kube_client=core)
    try:
        operator.await_pod_start(pod)
        assert manager.reads == 1, "the pod was read again: the start was polled instead of watched"
        remote = core.read_namespaced_pod("start-watch", NS)
        assert remote.status.phase == "Running" and remote.status.container_statuses[0].state.running
    finally:
        core.delete_namespaced_pod("start-watch", NS, grace_period_seconds=1)


def test_a_watch_without_a_change_reads_the_pod_again(core):
    core.create_namespaced_pod(NS, training_shaped("quiet-watch", "true"))
    try:
        # an ended pod changes no more once its last status write is in (on a loaded machine that write can
        # follow the phase's): the watch from its resourceVersion then sees nothing
        def settled():
            pod = core.read_namespaced_pod("quiet-watch", NS)
            if pod.status.phase != "Succeeded":
                return None
            changes = watch.Watch().stream(
                core.list_namespaced_pod,
                NS,
                field_selector="metadata.name=quiet-watch",
                resource_version=pod.metadata.resource_version,
                timeout_seconds=1,
            )
            return None if any(True for _ in changes) else pod

        ended = wait_for(settled, timeout=120, what="the pod to end and its status to settle")
        manager = CountingManager(kube_client=core)
        again = manager.await_pod_change(ended, timeout_seconds=1)
        assert manager.reads == 1, "the watch's end did not read the pod again"
        assert again.metadata.uid == ended.metadata.uid and again.status.phase == "Succeeded"
    finally:
        core.delete_namespaced_pod("quiet-watch", NS, grace_period_seconds=1)
