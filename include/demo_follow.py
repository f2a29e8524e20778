"""What the demos say while a run is quiet: a progress line at least every 30 seconds.

``airflow dags test`` runs the tasks one after the other and logs them to its console; the demos
show the lines a newcomer follows (include/demo.py, :class:`~include.demo.DemoOutput`). Between
those lines a run can be quiet for minutes: the DAG's parsing, a pod waiting for its image (the
first pull unpacks the trainer image's layers), a slow epoch on a loaded machine. Then
:class:`RunFollower` says what is going on::

    ... 1 min 05 s: task train (17 s in it), pod train-dd9zop93 Pending (ContainerCreating); last: waiting on its trigger (the pod or job)

from what the console said (the task that started last, the pod it built, the last line of
note: a trainer's step, a stage-in line) and, where a ``pod_phase`` probe is given, the pod's
phase as the API server reports it (:class:`PodPhase`).
"""

from __future__ import annotations

import queue
import re
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

EVERY_S = 30.0
DETAIL_WIDTH = 110

# A line of the console output as Airflow's console logger writes it: time, [level], the event, [logger] and
# key=value fields, e.g. "2026-11-26T19:39:18.142055Z [info     ] [base] ... [kubetrain.triggers.pod.PodLogFollower]
# loc=pod.py:124". The event is everything up to the last " [logger]" that only fields follow.
LOG_LINE = re.compile(
    r"^(?P<time>\d{4}-\d\d-\d\dT[\d:.]+Z?) \[(?P<level>\w+)\s*\] (?P<event>.*?)"
    r"(?: \[(?P<logger>[A-Za-z_][\w.]*)\](?: [\w.]+=.*)?)?$"
)
_TASK_START = re.compile(r"\[DAG TEST\] starting task_id=(?P<task>\S+) map_index=(?P<map>-?\d+)")
_TASK_END = re.compile(r"\[DAG TEST\] end task task_id=(?P<task>\S+)")
_POD_BUILT = re.compile(r"^Building pod (?P<pod>\S+) with labels")
_POD_CHECKED = re.compile(r"^Checking pod '(?P<pod>[^']+)' in namespace '(?P<ns>[^']+)'")
_CONTAINER_LINE = re.compile(
    r"^\[(?P<source>[^\]]+)\] (?:\d{4}-\d\d-\d\d[T ][\d:,.]+Z? )?(?:[A-Z]+ )?(?P<message>.+)$"
)
# lines that say where a task is, though the terminal does not show them on their own
_DETAILS = (
    (re.compile(r"^\[DAG TEST\] running trigger in line"), "waiting on its trigger (the pod or job)"),
    (
        re.compile(r"^::group::Waiting up to \d+s to get the POD scheduled"),
        "waiting for the pod to be scheduled",
    ),
    (re.compile(r"^Pod \S+ is running"), "the pod is running"),
)


def duration(seconds: float) -> str:
    """``75`` -> ``1 min 15 s``; ``9`` -> ``9 s``."""
    seconds = int(seconds)
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


def _short(text: str, width: int = DETAIL_WIDTH) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


class RunFollower:
    """The state of a run as its console output tells it, and the progress line due when the terminal is quiet.

    :param every: the most seconds between two lines on the terminal.
    :param clock: seconds, monotonic (a test's fake clock).
    :param pod_phase: ``pod_phase(name, namespace)``: the pod's phase in words, or None; called only
        when a progress line is due, so at most once in ``every`` seconds.
    """

    def __init__(
        self,
        *,
        every: float = EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        pod_phase: Callable[[str, str | None], str | None] | None = None,
    ) -> None:
        if not every > 0:
            raise ValueError(f"every={every!r}: expected a number of seconds above 0")
        self.every = every
        self.clock = clock
        self.pod_phase = pod_phase
        self.started = self.last_said = clock()
        self.task: str | None = None
        self.task_started = self.started
        self.pod: str | None = None
        self.namespace: str | None = None
        self.detail: str | None = None

    def feed(self, line: str) -> None:
        """Take a line of the console output into the run's state."""
        found = LOG_LINE.match(line.rstrip("\n"))
        if found is None:
            return
        event = found["event"]
        if start := _TASK_START.search(event):
            self.task = start["task"] + (f"[{start['map']}]" if start["map"] != "-1" else "")
            self.task_started = self.clock()
            self.pod = self.namespace = self.detail = None
            return
        if _TASK_END.search(event):
            self.detail = f"task {self.task} finished" if self.task else None
            self.task, self.pod = None, None
            return
        if built := _POD_BUILT.match(event):
            self.pod = built["pod"]
            return
        if checked := _POD_CHECKED.match(event):
            self.pod, self.namespace = checked["pod"], checked["ns"]
            return
        for pattern, detail in _DETAILS:
            if pattern.search(event):
                self.detail = detail
                return
        if event.startswith("[DAG TEST]"):
            return  # `airflow dags test`'s own bookkeeping
        if container := _CONTAINER_LINE.match(event):
            source = "trainer" if container["source"] == "base" else container["source"]
            message = container["message"]
            # the sidecars and init containers name themselves ("stage-in: ...")
            self.detail = message if message.startswith(f"{source}: ") else f"{source}: {message}"

    def said(self) -> None:
        """A line went to the terminal now: the next progress line is due ``every`` seconds later."""
        self.last_said = self.clock()

    def due_in(self) -> float:
        """Seconds until a progress line is due (0 when it is)."""
        return max(0.0, self.last_said + self.every - self.clock())

    def tick(self) -> str | None:
        """The progress line, when one is due; else None."""
        if self.due_in() > 0:
            return None
        text = self.status()
        self.said()
        return text

    def status(self) -> str:
        now = self.clock()
        parts = []
        if self.task is None:
            parts.append("between tasks" if self.detail else "parsing the DAG and creating the run")
        else:
            parts.append(f"task {self.task} ({duration(now - self.task_started)} in it)")
        if self.pod:
            phase = None
            if self.pod_phase is not None:
                try:
                    phase = self.pod_phase(self.pod, self.namespace)
                except Exception as exc:  # noqa: BLE001 - a progress line must not end the demo
                    phase = f"phase unknown: {type(exc).__name__}"
            parts.append(f"pod {self.pod}" + (f" {phase}" if phase else ""))
        text = f"... {duration(now - self.started)}: " + ", ".join(parts)
        if self.detail:
            text += f"; last: {_short(self.detail)}"
        return text


_EOF = object()


def follow(
    next_line: Callable[[float], object],
    show: Callable[[str], str | None],
    follower: RunFollower,
    say: Callable[[str], None],
) -> None:
    """Read the console output to its end: each line to ``show`` (its answer, if any, to ``say``), and a
    progress line to ``say`` whenever the terminal has been quiet for ``follower.every`` seconds.

    :param next_line: ``next_line(timeout)``: the next line; None when none came within ``timeout``
        seconds; :data:`_EOF` at the end (:func:`lines_with_timeout` makes one of a stream).
    :param show: what the terminal shows of a line (None: nothing).
    """
    while True:
        line = next_line(follower.due_in())
        if line is _EOF:
            return
        if line is not None:
            assert isinstance(line, str)
            follower.feed(line)
            if (text := show(line)) is not None:
                say(text)
                follower.said()
        if (text := follower.tick()) is not None:
            say(text)


def lines_with_timeout(stream: Iterable[str]) -> Callable[[float], object]:
    """A :func:`follow` ``next_line`` over ``stream`` (a subprocess's stdout), read on a daemon thread."""
    lines: queue.Queue[object] = queue.Queue()

    def pump() -> None:
        try:
            for line in stream:
                lines.put(line)
        finally:
            lines.put(_EOF)

    threading.Thread(target=pump, name="console-reader", daemon=True).start()

    def next_line(timeout: float) -> object:
        try:
            return lines.get(timeout=timeout) if timeout > 0 else lines.get_nowait()
        except queue.Empty:
            return None

    return next_line


class PodPhase:
    """A pod's phase as the API server reports it, with the reason a container waits: ``Pending (ContainerCreating)``.

    :param kubeconfig: the kubeconfig file the DAG's tasks use (the dev stack's ``KUBECONFIG``).
    :param timeout: seconds for the request; a probe that fails says so in the progress line.
    """

    def __init__(self, kubeconfig: str, timeout: float = 5.0) -> None:
        self.kubeconfig = kubeconfig
        self.timeout = timeout
        self._api: Any = None
        self._namespace: str | None = None

    def __call__(self, name: str, namespace: str | None) -> str | None:
        if self._api is None:
            from kubernetes import client, config

            api_client = config.new_client_from_config(config_file=self.kubeconfig)
            self._api = client.CoreV1Api(api_client)
            _, active = config.list_kube_config_contexts(config_file=self.kubeconfig)
            self._namespace = (active or {}).get("context", {}).get("namespace") or "default"
        pod = self._api.read_namespaced_pod(name, namespace or self._namespace, _request_timeout=self.timeout)
        status = pod.status
        waiting = [
            s.state.waiting.reason
            for s in (status.init_container_statuses or []) + (status.container_statuses or [])
            if s.state and s.state.waiting and s.state.waiting.reason
        ]
        return f"{status.phase}" + (f" ({', '.join(sorted(set(waiting)))})" if waiting else "")


class Heartbeat:
    """A line every ``every`` seconds while a quiet step runs (a context manager, on a daemon thread)::

        with Heartbeat("making the Airflow metadata database"):
            ui.prepare_database()

    prints ``... making the Airflow metadata database (30 s)`` at 30 s, 60 s, ... until the block ends.

    :param what: what the step does, in words.
    :param every: seconds between lines.
    :param say: where a line goes (default: stdout, flushed).
    """

    def __init__(
        self, what: str, *, every: float = EVERY_S, say: Callable[[str], None] | None = None
    ) -> None:
        if not every > 0:
            raise ValueError(f"every={every!r}: expected a number of seconds above 0")
        self.what = what
        self.every = every
        self.say = say or (lambda text: print(text, flush=True))
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def _beat(self) -> None:
        start = time.monotonic()
        while not self._done.wait(self.every):
            self.say(f"  ... {self.what} ({duration(time.monotonic() - start)})")

    def __enter__(self) -> Heartbeat:
        self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
