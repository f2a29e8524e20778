"""Processes of containers: isolation detection, start through the shim, signals, exit codes, exec.

Isolation modes (``--isolation``, default ``auto`` picks the first that works):

* ``namespaces``: new mount + PID + UTS namespaces per container (needs CAP_SYS_ADMIN, e.g. root);
* ``rootless``: the same inside a new user namespace (unprivileged users on most Linux systems);
* ``none``: plain processes; mount paths are remapped to the volume directories in env values,
  command, args, workingDir and exec commands, and exec'd ``kill``/``pgrep`` see only the
  container's processes, PID 1 standing for the container's main process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

SHIM = Path(__file__).with_name("shim.py")
ISOLATIONS = ("namespaces", "rootless", "none")


def shim_argv(*args: str) -> list[str]:
    return [sys.executable, "-I", "-S", str(SHIM), *args]


def detect_isolation(requested: str) -> str:
    """The isolation mode to use: ``requested`` when it works, or the first that works for ``auto``."""
    candidates = ISOLATIONS[:-1] if requested == "auto" else ((requested,) if requested != "none" else ())
    for mode in candidates:
        try:
            ok = subprocess.run(shim_argv("--probe", mode), capture_output=True, timeout=20).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return mode
        if requested != "auto":
            raise RuntimeError(f"--isolation {requested} is not available to this process (unshare failed)")
    return "none"


# -- $(VAR) expansion, as k8s.io/kubernetes/third_party/forked/golang/expansion ----------------


def expand(text: str, env: dict[str, str]) -> str:
    out, i, n = [], 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "$" and i + 1 < n:
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                end = text.find(")", i + 2)
                if end > 0:
                    name = text[i + 2 : end]
                    out.append(env[name] if name in env else text[i : end + 1])
                    i = end + 1
                    continue
        out.append(ch)
        i += 1
    return "".join(out)


# -- mount-path remapping for isolation "none" -----------------------------------------------


class Remapper:
    """Rewrites container mount paths to host directories inside strings."""

    def __init__(self, mounts: dict[str, str]) -> None:
        self.mounts = sorted(mounts.items(), key=lambda kv: -len(kv[0]))
        self._re = (
            re.compile(
                r"(?<![\w.\-/])("
                + "|".join(re.escape(p.rstrip("/")) for p, _ in self.mounts)
                + r")(?=$|[/\s:;,'\"=)\]}])"
            )
            if self.mounts
            else None
        )
        self._table = {p.rstrip("/"): h for p, h in self.mounts}

    def __call__(self, text: str) -> str:
        if not self._re:
            return text
        return self._re.sub(lambda m: self._table[m.group(1)], text)


def guard_prelude(main_pid: int) -> str:
    """Shell functions that keep an exec'd ``kill``/``pgrep`` inside the container (isolation ``none``)."""
    return (
        f'kill() {{ _kt_a=""; for _kt_x in "$@"; do [ "$_kt_x" = 1 ] && _kt_x={main_pid}; '
        f'_kt_a="$_kt_a $_kt_x"; done; command kill $_kt_a; }}; '
        f'pgrep() {{ command pgrep -g {main_pid} "$@"; }}; '
    )


def guard_exec_argv(argv: list[str], main_pid: int) -> tuple[list[str], bytes]:
    """Wrap an exec command so PID 1 means the container's main process; returns (argv, stdin prefix)."""
    shells = ("sh", "bash", "dash", "ash")
    base = os.path.basename(argv[0]) if argv else ""
    if base in shells and len(argv) >= 3 and argv[1] == "-c":
        return [argv[0], "-c", guard_prelude(main_pid) + argv[2], *argv[3:]], b""
    if base in shells and len(argv) == 1:
        return argv, (guard_prelude(main_pid) + "\n").encode()
    if base == "kill":
        return [a if a != "1" else str(main_pid) for a in argv], b""
    if base == "pgrep":
        return [argv[0], "-g", str(main_pid), *argv[1:]], b""
    return argv, b""


# -- processes -------------------------------------------------------------------------------


class Proc:
    """A shim process and the container process it parents."""

    def __init__(self, shim: asyncio.subprocess.Process, isolation: str) -> None:
        self.shim = shim
        self.isolation = isolation
        self.pid: int | None = None  # host PID of the container's PID 1
        self.started: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self.exit_code: int | None = None
        self.signal: int | None = None
        self.finished = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def send_signal(self, sig: int) -> None:
        if self.finished.is_set():
            return
        if sig == signal.SIGKILL and self.pid:
            with contextlib.suppress(OSError):
                if self.isolation == "none":
                    os.killpg(self.pid, signal.SIGKILL)
                else:
                    os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, OSError):
            self.shim.send_signal(sig)

    async def wait(self) -> int:
        await self.finished.wait()
        assert self.exit_code is not None
        return self.exit_code


async def spawn(
    spec: dict,
    spec_dir: Path,
    on_output: Callable[[str, bytes], None] | None,
    *,
    stdin: bool = False,
) -> Proc:
    """Start the shim with ``spec`` (see shim.py); output goes to ``on_output(stream, data)``."""
    loop = asyncio.get_running_loop()
    r, w = os.pipe()
    spec = {**spec, "report_fd": w}
    spec_dir.mkdir(parents=True, exist_ok=True)
    fd, name = _mkstemp(spec_dir)
    with os.fdopen(fd, "w") as f:
        json.dump(spec, f)
    try:
        shim = await asyncio.create_subprocess_exec(
            *shim_argv(name),
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(w,),
            start_new_session=True,
        )
    finally:
        os.close(w)
    proc = Proc(shim, spec["isolation"])
    report = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(report), os.fdopen(r, "rb", buffering=0)
    )

    async def read_reports() -> None:
        try:
            async for raw in report:
                msg = json.loads(raw)
                if "pid" in msg:
                    proc.pid = msg["pid"]
                elif "started" in msg and not proc.started.done():
                    proc.started.set_result(None)
                elif "start_error" in msg and not proc.started.done():
                    proc.started.set_result(msg["start_error"])
                elif "exit_code" in msg:
                    proc.exit_code, proc.signal = msg["exit_code"], msg.get("signal")
        finally:
            transport.close()

    async def pump(stream: asyncio.StreamReader, name: str) -> None:
        while True:
            data = await stream.read(65536)
            if not data:
                return
            if on_output:
                on_output(name, data)

    async def supervise() -> None:
        await asyncio.gather(reader, pump(shim.stdout, "stdout"), pump(shim.stderr, "stderr"))
        rc = await shim.wait()
        if proc.exit_code is None:
            proc.exit_code = rc if rc >= 0 else 128 - rc
            proc.signal = -rc if rc < 0 else None
        if not proc.started.done():
            proc.started.set_result(
                f"the container process exited before it started (status {proc.exit_code})"
            )
        proc.finished.set()

    reader = asyncio.ensure_future(read_reports())
    proc._tasks = [reader, asyncio.ensure_future(supervise())]
    return proc


def _mkstemp(directory: Path) -> tuple[int, str]:
    import tempfile

    return tempfile.mkstemp(prefix=".spec-", suffix=".json", dir=directory)
