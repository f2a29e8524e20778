"""Run a long, noisy set-up command quietly, saying what it is doing at least every 30 seconds.

The command's output (stdout and stderr) goes to a log file; the terminal gets one line when it
starts, a progress line every ``--every`` seconds, and one line when it ends::

    Debian image base: debootstrap bookworm...
    Debian image base: debootstrap bookworm... (30 s, 1,204 files 61 MB in .tools/images/...; I: Unpacking libc6...)
    Debian image base: done in 71 s (log: .tools/logs/image-base.log)

How far a phase is comes from what it can tell cheaply: the log's lines, lines matching a pattern
(``--count 'set up=^Setting up '``, out of a total read from the log with ``--of``), the files and
bytes under a directory the command fills (``--watch``), and always the last non-empty line of the
log, shortened. When the command fails, the last 30 lines of its log and the log's path are
printed, and the runner exits with the command's status.

The command's stdin is /dev/null, so nothing waits for a prompt; progress lines are plain lines
(no carriage returns) whether or not stdout is a terminal, so CI logs show them too. Only the
standard library is used: the Makefile runs this with the system Python before any virtual
environment exists::

    python3 include/progress.py --phase "Debian image base" --what "debootstrap bookworm" \\
        --log .tools/logs/image-base.log --watch .tools/images/bookworm-python.tar.d -- debootstrap ...
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

TAIL_LINES = 30
LAST_LINE_WIDTH = 80
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB"):
        if n < 1000:
            return f"{n:.0f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def shorten(text: str, width: int = LAST_LINE_WIDTH) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def tree_size(path: Path, budget: float) -> tuple[int, int, bool]:
    """(files, bytes, whether all were counted) under path, counting for at most ``budget`` seconds.

    Unreadable entries are skipped. The budget keeps a large tree (a virtual environment, a root
    file system) from delaying the next progress line.
    """
    files = size = 0
    stop = time.monotonic() + budget
    for root, _dirs, names in os.walk(path):
        if time.monotonic() > stop:
            return files, size, False
        for name in names:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            files += 1
            size += st.st_size
    return files, size, True


class Counter:
    """Lines of the log matching a pattern, e.g. apt's ``Setting up`` lines."""

    def __init__(self, spec: str) -> None:
        label, sep, pattern = spec.partition("=")
        if not sep or not label or not pattern:
            raise ValueError(f"--count {spec!r}: expected LABEL=REGEX, e.g. 'set up=^Setting up '")
        try:
            self.regex = re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"--count {spec!r}: {pattern!r} is not a regular expression ({exc})") from None
        self.label = label
        self.n = 0


class LogReader:
    """Follows the log file as the command writes it: counts lines, matches, the last non-empty line."""

    def __init__(self, path: Path, counters: list[Counter], total: re.Pattern[str] | None) -> None:
        self.path = path
        self.counters = counters
        self.total_pattern = total
        self.total: int | None = None
        self.offset = 0
        self.partial = b""
        self.lines = 0
        self.last = ""

    def read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        self.offset += len(data)
        chunks = (self.partial + data).split(b"\n")
        self.partial = chunks.pop()
        for raw in chunks:
            self.line(raw)

    def line(self, raw: bytes) -> None:
        self.lines += 1
        text = ANSI.sub("", raw.decode("utf-8", "replace")).strip()
        if not text:
            return
        self.last = text
        for counter in self.counters:
            if counter.regex.search(text):
                counter.n += 1
        if self.total is None and self.total_pattern is not None:
            found = self.total_pattern.search(text)
            if found:
                self.total = int(found.group(1))

    def last_line(self) -> str:
        tail = ANSI.sub("", self.partial.decode("utf-8", "replace")).strip()
        return tail or self.last


def tail(path: Path, n: int = TAIL_LINES) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return ANSI.sub("", text).splitlines()[-n:]


def progress(log: LogReader, watch: list[Path], budget: float) -> str:
    parts = []
    for i, counter in enumerate(log.counters):
        total = f"/{log.total:,}" if i == 0 and log.total is not None else ""
        parts.append(f"{counter.n:,}{total} {counter.label}")
    for path in watch:
        if path.is_dir():
            files, size, complete = tree_size(path, budget / len(watch))
            more = "" if complete else "over "
            parts.append(f"{more}{files:,} files {human_bytes(size)} in {path}")
        elif path.exists():
            parts.append(f"{human_bytes(path.stat().st_size)} in {path}")
    if not log.counters and log.lines:
        parts.append(f"log {log.lines:,} lines")
    last = log.last_line()
    if last:
        parts.append(shorten(last))
    return "; ".join(parts)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="progress.py",
        description="Run a command with its output in a log file, printing a progress line every few seconds.",
    )
    parser.add_argument("--phase", required=True, help="what the phase is called, e.g. 'Debian image base'")
    parser.add_argument("--what", help="what it is doing, e.g. 'debootstrap bookworm' (default: the command)")
    parser.add_argument("--log", required=True, type=Path, help="the log file the command's output goes to")
    parser.add_argument(
        "--every", type=float, default=30.0, help="seconds between progress lines (default 30)"
    )
    parser.add_argument("--watch", type=Path, action="append", default=[], help="a directory or file to size")
    parser.add_argument("--count", action="append", default=[], help="LABEL=REGEX: log lines to count")
    parser.add_argument("--of", help="REGEX whose first group, in the log, is the total of the first --count")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command and its arguments")
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("no command given: expected '-- COMMAND [ARGS...]' after the options")
    if not args.every > 0:
        parser.error(f"--every {args.every}: expected a number of seconds above 0")
    try:
        args.counters = [Counter(spec) for spec in args.count]
    except ValueError as exc:
        parser.error(str(exc))
    try:
        args.total = re.compile(args.of) if args.of else None
    except re.error as exc:
        parser.error(f"--of {args.of!r}: not a regular expression ({exc})")
    if args.total is not None and args.total.groups < 1:
        parser.error(
            f"--of {args.of!r}: expected a regular expression with a group, e.g. '(\\d+) newly installed'"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    what = args.what or shorten(" ".join(args.command), 60)
    args.log.parent.mkdir(parents=True, exist_ok=True)
    say = lambda text: print(f"{args.phase}: {text}", flush=True)  # noqa: E731
    say(f"{what}... (log: {args.log})")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    start = time.monotonic()
    with open(args.log, "wb") as out:
        try:
            # close_fds=False: a `$(MAKE)` run through here keeps make's jobserver
            proc = subprocess.Popen(
                args.command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                close_fds=False,
            )  # fmt: skip
        except OSError as exc:
            say(f"failed: cannot run {args.command[0]!r}: {exc.strerror}")
            return 127
    # Ctrl-C reaches the command too (same process group): wait for it to end rather than leave it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
    log = LogReader(args.log, args.counters, args.total)
    # A line is due every `every` seconds. What it says is gathered in the `budget` seconds before
    # (sizing a large --watch tree takes seconds on a loaded machine), so that it comes on time.
    budget = args.every / 6
    due = start + args.every
    while True:
        try:
            rc = proc.wait(timeout=max(0.0, due - budget - time.monotonic()))
            break
        except subprocess.TimeoutExpired:
            pass
        log.read()
        status = progress(log, args.watch, budget)
        try:
            rc = proc.wait(timeout=max(0.0, due - time.monotonic()))
            break
        except subprocess.TimeoutExpired:
            pass
        say(f"{what}... ({time.monotonic() - start:.0f} s, {status})")
        due = max(due + args.every, time.monotonic() + budget)
    took = time.monotonic() - start
    if rc == 0:
        say(f"done in {took:.0f} s")
        return 0
    lines = tail(args.log)
    say(f"failed after {took:.0f} s with exit status {rc}; the last {len(lines)} lines of {args.log}:")
    for line in lines:
        print(f"    {line}", flush=True)
    say(f"the whole log: {args.log}")
    return rc if rc > 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main())
