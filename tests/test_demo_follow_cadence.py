"""include/demo_follow.py: the demos say something at least every 30 s while `airflow dags test` runs.

The run is replayed on a fake clock: each console line comes at its time (lines as `make demo`
captured them in .demo/train_image_classifier.log, the quiet stretches of a first demo on a loaded
machine: the DAG's parsing, a pod waiting 95 s for its image, a 50 s epoch), so the test needs no
sleeps and checks the cadence to the second.
"""

from __future__ import annotations

import threading

import pytest

from include.demo import DemoOutput
from include.demo_follow import _EOF, Heartbeat, RunFollower, duration, follow, lines_with_timeout

FOLLOWER = "[kubetrain.triggers.pod.PodLogFollower] loc=pod.py:133"
DAG = "[airflow.sdk.definitions.dag] loc=dag.py:1501"


def line(event: str, logger: str = DAG, level: str = "info") -> str:
    return f"2026-11-29T15:20:36.572622Z [{level:<9}] {event} {logger}\n"


def trainer(message: str) -> str:
    return line(f"[base] 2026-11-29 15:21:13,219 INFO {message}", FOLLOWER)


# (seconds after the start, console line)
RUN = [
    (2.0, "Could not import graphviz. Rendering graph to the graphical format will not be possible.\n"),
    # the DAG's parsing and the run's creation: 41 s without a line worth showing
    (41.0, line("creating dag run", "[airflow.serialization.definitions.dag] loc=dag.py:615")),
    (43.0, line("[DAG TEST] starting task_id=stage_dataset map_index=-1")),
    (53.0, line("[DAG TEST] end task task_id=stage_dataset map_index=-1")),
    (54.0, line("[DAG TEST] starting task_id=train map_index=-1")),
    (
        55.0,
        line(
            "Building pod train-dd9zop93 with labels: {'dag_id': 'train_image_classifier'}",
            "[airflow.task.operators.kubetrain.operators.training.TrainingPodOperator] loc=pod.py:1740",
        ),
    ),
    (55.5, line("[DAG TEST] running trigger in line", "[airflow.sdk.definitions.dag] loc=dag.py:1534")),
    # the first pull of the trainer image: 95 s without a line
    (150.0, line("[stage-in] 2026-11-29T15:20:50Z stage-in: starting without checkpoints", FOLLOWER)),
    (
        151.0,
        line(
            "Pod kubetrain/train-dd9zop93 is running: its containers' lines follow",
            "[kubetrain.triggers.pod.TrainingPodTrigger] loc=pod.py:363",
        ),
    ),
    (160.0, trainer("step 10 epoch 1/4 batch 10/22 loss 1.9446 accuracy 0.3733 eta 40 s")),
    (185.0, trainer("step 20 epoch 1/4 batch 20/22 loss 1.4867 accuracy 0.5969 eta 30 s")),
    (210.0, trainer("epoch 1: loss 1.7085 accuracy 0.4908 val_loss 1.7745 val_accuracy 0.3649")),
    (260.0, trainer("epoch 2: loss 1.0067 accuracy 0.8523 val_loss 1.0151 val_accuracy 0.7883")),
    (262.0, line("[DAG TEST] end task task_id=train map_index=-1")),
    (300.0, line("[DAG TEST] starting task_id=report map_index=-1")),
    (303.0, line("Report written to s3://training/runs/x/report/report.html", "[kubetrain] loc=report.py:1")),
    (304.0, line("[DAG TEST] end task task_id=report map_index=-1")),
]
END = 330.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def replay(run: list[tuple[float, str]], end: float, clock: FakeClock):
    """A ``next_line(timeout)`` that hands out ``run``'s lines at their times on ``clock``."""
    pending = list(run)

    def next_line(timeout: float) -> object:
        if not pending:
            if clock.now + timeout < end:
                clock.now += timeout
                return None
            clock.now = max(clock.now, end)
            return _EOF
        at, text = pending[0]
        if at <= clock.now + timeout:
            clock.now = max(clock.now, at)
            pending.pop(0)
            return text
        clock.now += timeout
        return None

    return next_line


def follow_run(pod_phase=None) -> tuple[list[tuple[float, str]], list[tuple[str, str | None]]]:
    clock = FakeClock()
    said: list[tuple[float, str]] = []
    probes: list[tuple[str, str | None]] = []

    def probe(name: str, namespace: str | None) -> str | None:
        probes.append((name, namespace))
        return pod_phase(clock.now) if pod_phase else None

    follower = RunFollower(clock=clock, pod_phase=probe)
    follow(replay(RUN, END, clock), DemoOutput().feed, follower, lambda text: said.append((clock.now, text)))
    return said, probes


def test_a_line_comes_at_least_every_30_s_of_a_quiet_run():
    said, _ = follow_run()
    times = [0.0] + [t for t, _ in said] + [END]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert max(gaps) <= 30.0, list(zip(times, gaps, strict=False))
    # and no more than needed: a progress line only after 30 quiet seconds
    progress = [t for t, text in said if text.startswith("... ")]
    shown = [t for t, text in said if not text.startswith("... ")]
    for t in progress:
        last = max([0.0] + [s for s in shown + progress if s < t])
        assert t - last == pytest.approx(30.0), (t, last)


def test_the_progress_lines_say_the_task_the_pod_and_the_last_step():
    phases = {True: "Pending (ContainerCreating)", False: "Running"}
    said, probes = follow_run(pod_phase=lambda now: phases[now < 150.0])
    progress = {t: text for t, text in said if text.startswith("... ")}
    # before the first task: what `airflow dags test` is doing, and the time since the start
    assert progress[30.0] == "... 30 s: parsing the DAG and creating the run"
    # the pod waits for its image: the task, how long in it, the pod and the phase the API server reports
    assert progress[83.0] == (
        "... 1 min 23 s: task train (29 s in it), pod train-dd9zop93 Pending (ContainerCreating); "
        "last: waiting on its trigger (the pod or job)"
    )
    assert progress[143.0].startswith(
        "... 2 min 23 s: task train (1 min 29 s in it), pod train-dd9zop93 Pending (ContainerCreating)"
    )
    # a slow epoch: the trainer's last step line, which the terminal does not show on its own
    assert progress[240.0] == (
        "... 4 min 00 s: task train (3 min 06 s in it), pod train-dd9zop93 Running; last: trainer: epoch 1: "
        "loss 1.7085 accuracy 0.4908 val_loss 1.7745 val_accuracy 0.3649"
    )
    assert progress[292.0] == "... 4 min 52 s: between tasks; last: task train finished"
    # the probe asked for the pod the operator built, at most once a progress line
    assert set(probes) == {("train-dd9zop93", None)}
    assert len(probes) == sum(1 for text in progress.values() if "pod train-dd9zop93" in text)
    # the lines the terminal shows on their own still come, in order
    shown = [text for _, text in said if not text.startswith("... ")]
    assert shown[0] == "task stage_dataset finished"
    assert "trainer: epoch 2: loss 1.0067 accuracy 0.8523 val_loss 1.0151 val_accuracy 0.7883" in shown
    assert shown[-2:] == ["Report written to s3://training/runs/x/report/report.html", "task report finished"]


def test_a_failing_pod_probe_does_not_end_the_run():
    def broken(now: float) -> str:
        raise ConnectionRefusedError("the API server is gone")

    said, _ = follow_run(pod_phase=broken)
    assert any("pod train-dd9zop93 phase unknown: ConnectionRefusedError" in text for _, text in said)
    assert said[-1][1] == "task report finished"


@pytest.mark.parametrize(
    ("seconds", "words"), [(0, "0 s"), (59.9, "59 s"), (60, "1 min 00 s"), (605, "10 min 05 s")]
)
def test_duration(seconds, words):
    assert duration(seconds) == words


def test_every_must_be_positive():
    with pytest.raises(ValueError, match=r"every=0: expected a number of seconds above 0"):
        RunFollower(every=0)


def test_lines_with_timeout_reads_a_stream_to_its_end():
    """The reader the demos use over the subprocess's stdout: the lines, then the end; None on a timeout."""
    gate = threading.Event()

    def stream():
        yield "first\n"
        gate.wait()
        yield "second\n"

    next_line = lines_with_timeout(stream())
    assert next_line(60) == "first\n"
    assert next_line(0) is None  # the stream is held at the gate: nothing yet
    gate.set()
    assert next_line(60) == "second\n"
    assert next_line(60) is _EOF


def test_heartbeat_says_what_a_quiet_step_does_until_it_ends():
    said: list[str] = []
    two = threading.Event()

    def say(text: str) -> None:
        said.append(text)
        if len(said) >= 2:
            two.set()

    with Heartbeat("making the Airflow metadata database", every=0.01, say=say) as beat:
        assert two.wait(60), said
    assert all(text.startswith("  ... making the Airflow metadata database (") for text in said)
    # the block has ended: its thread is gone, so no line comes after it
    assert beat._thread is not None and not beat._thread.is_alive()


def test_pod_phase_reads_the_phase_and_the_waiting_reasons_from_the_api_server(tmp_path):
    """PodPhase against an HTTP server that answers a pod read as an API server does (the pod's JSON)."""
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from include.demo_follow import PodPhase

    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "train-dd9zop93", "namespace": "kubetrain"},
        "status": {
            "phase": "Pending",
            "initContainerStatuses": [
                {"name": "stage-in", "image": "s", "imageID": "", "ready": False, "restartCount": 0,
                 "state": {"waiting": {"reason": "PodInitializing"}}},
            ],
            "containerStatuses": [
                {"name": "base", "image": "t", "imageID": "", "ready": False, "restartCount": 0,
                 "state": {"waiting": {"reason": "ContainerCreating"}}},
            ],
        },
    }  # fmt: skip
    paths: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            paths.append(self.path)
            body = json.dumps(pod).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            json.dumps({
                "apiVersion": "v1", "kind": "Config", "current-context": "dev",
                "clusters": [{"name": "dev", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}],
                "users": [{"name": "worker", "user": {"token": "t"}}],
                "contexts": [{"name": "dev", "context": {"cluster": "dev", "user": "worker", "namespace": "kubetrain"}}],
            })
        )  # fmt: skip
        phase = PodPhase(str(kubeconfig))
        assert phase("train-dd9zop93", None) == "Pending (ContainerCreating, PodInitializing)"
        assert phase("train-dd9zop93", "other") == "Pending (ContainerCreating, PodInitializing)"
        # the kubeconfig context's namespace, else the one the trigger named
        assert paths == [
            "/api/v1/namespaces/kubetrain/pods/train-dd9zop93",
            "/api/v1/namespaces/other/pods/train-dd9zop93",
        ]
    finally:
        server.shutdown()


@pytest.mark.parametrize(
    ("event", "detail"),
    [
        (
            "[stage-in] 2026-11-29T15:20:50Z stage-in: dataset digits version 04d598435446b7e2: 1 objects",
            "stage-in: dataset digits version 04d598435446b7e2: 1 objects",
        ),
        (
            "[chief train-dist-chief-0] 2026-11-26 20:10:58,001 INFO epoch 2: loss 0.9981",
            "chief train-dist-chief-0: epoch 2: loss 0.9981",
        ),
        (
            "[base] 2026-11-29 15:21:08,453 INFO step 1 epoch 1/4 batch 1/22",
            "trainer: step 1 epoch 1/4 batch 1/22",
        ),
        # `airflow dags test`'s own lines are no step of the run
        ("[DAG TEST] running task <TaskInstance: train_image_classifier.train manual__1>", None),
        ("[DAG TEST] Trigger completed", None),
    ],
)
def test_the_last_line_of_note(event, detail):
    follower = RunFollower(clock=FakeClock())
    follower.feed(line(event, FOLLOWER))
    assert follower.detail == detail
