"""include/progress.py, the runner the Makefile wraps its long set-up phases in.

Each test runs the runner as the Makefile does (a subprocess, stdout a pipe as under CI) around a
shell command. The periodic-line test's command blocks on a FIFO that the test opens only after it
has read a progress line, so the line is known to come while the command runs, not by a race.
"""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUNNER = REPO / "include" / "progress.py"
# a bound on waiting for a line the runner is due to print every fraction of a second: generous for
# a loaded CI machine; the test ends as soon as the line is there
WAIT_S = 120


def start(tmp_path: Path, *options: str, command: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """The runner around ``sh -c command`` (its $1 is tmp_path), stdout read line by line."""
    return subprocess.Popen(
        [sys.executable, str(RUNNER), "--log", str(tmp_path / "logs" / "phase.log"), *options,
         "--", "sh", "-c", command, "sh", str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


class Lines:
    """The runner's output lines as they come, read on a thread so that a wait has a bound."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.queue: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        assert proc.stdout is not None
        stream = proc.stdout

        def pump() -> None:
            for line in stream:
                self.queue.put(line.rstrip("\n"))
            self.queue.put(None)

        threading.Thread(target=pump, daemon=True).start()

    def wait_for(self, pattern: str) -> str:
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                line = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} in {WAIT_S} s; got {self.seen}") from None
            if line is None:
                raise AssertionError(f"the runner ended with no line matching {pattern!r}; got {self.seen}")
            self.seen.append(line)
            if re.search(pattern, line):
                return line

    def rest(self) -> list[str]:
        while (line := self.queue.get(timeout=WAIT_S)) is not None:
            self.seen.append(line)
        return self.seen


def test_progress_lines_come_while_the_command_runs_then_one_line_when_done(tmp_path):
    fifo = tmp_path / "go"
    os.mkfifo(fifo)
    # apt-like output, two files in a directory the phase fills, then a wait on the test
    command = (
        'mkdir "$1/out"; touch "$1/out/a" "$1/out/b"; echo "3 newly installed"; echo "Setting up one";'
        ' echo "waiting for the test"; read word < "$1/go"; echo "got $word"'
    )
    proc = start(
        tmp_path,
        "--phase", "packages", "--what", "installing", "--every", "0.2",
        "--count", "set up=^Setting up ", "--of", r"(\d+) newly installed", "--watch", str(tmp_path / "out"),
        command=command, env={"CI": "true"},
    )  # fmt: skip
    lines = Lines(proc)
    assert (
        lines.wait_for("^packages: ") == f"packages: installing... (log: {tmp_path / 'logs' / 'phase.log'})"
    )
    line = lines.wait_for(r"waiting for the test\)$")
    assert re.fullmatch(
        r"packages: installing\.\.\. \(\d+ s, 1/3 set up; 2 files 0 B in .*/out; waiting for the test\)", line
    ), line
    assert proc.poll() is None, "the command was to wait on the FIFO"
    with open(fifo, "w") as f:
        f.write("now\n")
    rest = lines.rest()
    assert proc.wait(timeout=WAIT_S) == 0
    assert re.fullmatch(r"packages: done in \d+ s", rest[-1]), rest
    assert "got now" in (tmp_path / "logs" / "phase.log").read_text()


def test_a_quiet_success_shows_none_of_the_output_and_never_waits_on_stdin(tmp_path):
    # `cat` reads stdin: the runner's stdin (a pipe this test keeps open) must not reach it
    proc = start(tmp_path, "--phase", "noisy", command='seq 1 200; cat; echo "the end"')
    out, _ = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0
    lines = out.splitlines()
    assert len(lines) == 2 and re.fullmatch(r"noisy: done in \d+ s", lines[1]), lines
    assert lines[0].startswith("noisy: sh -c seq 1 200;")
    log = (tmp_path / "logs" / "phase.log").read_text().splitlines()
    assert log[0] == "1" and log[199] == "200" and log[-1] == "the end"


def test_a_failure_prints_the_last_lines_and_the_log_path_and_passes_the_exit_status(tmp_path):
    proc = start(
        tmp_path, "--phase", "build", "--what", "building", command="seq 1 100; echo broken >&2; exit 7"
    )
    out, _ = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 7
    log = tmp_path / "logs" / "phase.log"
    assert re.search(
        rf"^build: failed after \d+ s with exit status 7; the last 30 lines of {log}:$", out, re.M
    ), out
    shown = [line.strip() for line in out.splitlines() if line.startswith("    ")]
    assert shown == [*map(str, range(72, 101)), "broken"]
    assert out.splitlines()[-1] == f"build: the whole log: {log}"


def test_a_command_killed_by_a_signal_exits_as_a_shell_would(tmp_path):
    proc = start(tmp_path, "--phase", "killed", command="kill -TERM $$")
    proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 128 + 15


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--count", "no-equals-sign"], "--count 'no-equals-sign': expected LABEL=REGEX"),
        (["--count", "steps=("], "--count 'steps=(': '(' is not a regular expression"),
        (["--of", "no group"], "--of 'no group': expected a regular expression with a group"),
        (["--every", "0"], "--every 0.0: expected a number of seconds above 0"),
    ],
)
def test_bad_options_are_refused_naming_the_value(tmp_path, options, message):
    proc = start(tmp_path, "--phase", "x", *options, command="true")
    out, _ = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 2
    assert message in out


def test_no_command_is_refused(tmp_path):
    out = subprocess.run(
        [sys.executable, str(RUNNER), "--phase", "x", "--log", str(tmp_path / "x.log")],
        capture_output=True, text=True, timeout=WAIT_S,
    )  # fmt: skip
    assert out.returncode == 2
    assert "no command given: expected '-- COMMAND [ARGS...]'" in out.stderr
