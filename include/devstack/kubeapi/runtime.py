"""Processes of containers: the runc shim (shim.py) started per container and per exec, signals, exit codes.

Every container runs from its image under runc (include/devstack/kubeapi/oci.py writes its bundle's
``config.json``), parented by a shim of its own that reports its PID, whether it started, and its
exit status. The server must run as root: runc creates the namespaces and cgroups, and the node's
image store mounts overlays (see KUBEAPI.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

SHIM = Path(__file__).with_name("shim.py")
KILL_REQUEST = signal.SIGRTMIN  # shim.py's: kill the container as soon as runc has created it
RUNC = "runc"


class RuntimeUnavailable(RuntimeError):
    """The OCI runtime cannot run containers for this process."""


def runc_version(runc: str) -> str:
    try:
        out = subprocess.run([runc, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    first = out.splitlines()[0] if out else ""
    return first.rsplit(" ", 1)[-1] if first else "unknown"


def shim_argv(*args: str) -> list[str]:
    return [sys.executable, "-I", "-S", str(SHIM), *args]


def find_runc() -> str:
    """The runc binary; :class:`RuntimeUnavailable` with what to do when it cannot be used."""
    runc = shutil.which(RUNC)
    if runc is None:
        raise RuntimeUnavailable(
            "runc is not installed: run `make setup` (it installs Debian's runc package)"
        )
    if os.geteuid() != 0:
        raise RuntimeUnavailable(
            "the local kubelet runs containers with runc and mounts their images' file systems, which needs root: "
            "start the dev stack as root (sudo make stack-up)"
        )
    return runc


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


# -- processes -------------------------------------------------------------------------------


class Proc:
    """A shim process and the container process (or exec'd process) it parents."""

    def __init__(self, shim: asyncio.subprocess.Process) -> None:
        self.shim = shim
        self.pid: int | None = None  # host PID of the container's PID 1 (or of the exec'd process)
        self.started: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self.exit_code: int | None = None
        self.signal: int | None = None
        self.oom = False
        self.finished = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def send_signal(self, sig: int) -> None:
        if self.finished.is_set():
            return
        if sig == signal.SIGKILL and self.pid is None:
            # runc may still be creating the container: SIGKILL to the shim would leave the container that
            # its `runc run --detach` then creates orphaned; the shim kills it as soon as it exists instead
            with contextlib.suppress(ProcessLookupError, OSError):
                self.shim.send_signal(KILL_REQUEST)
            return
        if sig == signal.SIGKILL:
            # the container's PID 1: the kernel then ends every process of its PID namespace, and the shim
            # reaps it and deletes the container's runc state (SIGKILL to the shim would leave that behind)
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGKILL)
            return
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
    """Start the shim with ``spec`` (see shim.py); the process's output goes to ``on_output(stream, data)``.

    Output is held until the shim reports that the process started: when it did not, whatever came
    is runc's complaint (reported as the start error), not the container's output, and is dropped.
    """
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
    proc = Proc(shim)
    report = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(report), os.fdopen(r, "rb", buffering=0)
    )
    held: list[tuple[str, bytes]] = []

    def deliver(stream: str, data: bytes) -> None:
        if not proc.started.done():
            held.append((stream, data))
        elif proc.started.result() is None and on_output:
            on_output(stream, data)

    def release(error: str | None) -> None:
        if not proc.started.done():
            proc.started.set_result(error)
            if error is None and on_output:
                for stream, data in held:
                    on_output(stream, data)
            held.clear()

    async def read_reports() -> None:
        try:
            async for raw in report:
                msg = json.loads(raw)
                if "pid" in msg:
                    proc.pid = msg["pid"]
                elif "started" in msg:
                    release(None)
                elif "start_error" in msg:
                    release(msg["start_error"])
                elif "exit_code" in msg:
                    proc.exit_code, proc.signal = msg["exit_code"], msg.get("signal")
                    proc.oom = bool(msg.get("oom"))
        finally:
            transport.close()

    async def pump(stream: asyncio.StreamReader, name: str) -> None:
        while True:
            data = await stream.read(65536)
            if not data:
                return
            deliver(name, data)

    async def supervise() -> None:
        await asyncio.gather(reader, pump(shim.stdout, "stdout"), pump(shim.stderr, "stderr"))
        rc = await shim.wait()
        if proc.exit_code is None:
            proc.exit_code = rc if rc >= 0 else 128 - rc
            proc.signal = -rc if rc < 0 else None
        release(f"the container process exited before it started (status {proc.exit_code})")
        proc.finished.set()

    reader = asyncio.ensure_future(read_reports())
    proc._tasks = [reader, asyncio.ensure_future(supervise())]
    return proc


def _mkstemp(directory: Path) -> tuple[int, str]:
    import tempfile

    return tempfile.mkstemp(prefix=".spec-", suffix=".json", dir=directory)
