"""Per-container log files, written as the kubelet's CRI log (one timestamped line per write) and read back
with the ``pods/log`` options: follow, timestamps, sinceSeconds, sinceTime, tailLines, limitBytes.

On-disk line format (private to this server): ``<epoch ns> <stream> <F|P> <bytes>\\n``; ``P`` marks a
fragment of a line longer than MAX_LINE, joined again on read.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from include.devstack.kubeapi.meta import now_ns, rfc3339_nano

MAX_LINE = 16 * 1024


@dataclass
class Entry:
    ns: int
    stream: str
    content: bytes  # without the trailing newline


class LogFile:
    """One container instance's output; ``close()`` when the process is gone."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(path, "ab")  # noqa: SIM115 - lives as long as the container
        self._partial: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        self.closed = False
        self._waiters: list[asyncio.Future] = []

    def write(self, stream: str, data: bytes) -> None:
        buf = self._partial[stream]
        buf.extend(data)
        ts = now_ns()
        while True:
            nl = buf.find(b"\n")
            if nl < 0:
                break
            line = bytes(buf[:nl])
            del buf[: nl + 1]
            self._write_line(ts, stream, line)
        while len(buf) >= MAX_LINE:
            self._fh.write(f"{ts} {stream} P ".encode() + bytes(buf[:MAX_LINE]) + b"\n")
            del buf[:MAX_LINE]
        self._fh.flush()
        self._wake()

    def _write_line(self, ts: int, stream: str, line: bytes) -> None:
        if line.endswith(b"\r"):
            line = line[:-1]
        self._fh.write(f"{ts} {stream} F ".encode() + line + b"\n")

    def close(self) -> None:
        if self.closed:
            return
        ts = now_ns()
        for stream, buf in self._partial.items():
            if buf:
                self._write_line(ts, stream, bytes(buf))
                buf.clear()
        self._fh.close()
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def wait(self, timeout: float) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            pass


def read_entries(path: Path, offset: int = 0) -> tuple[list[Entry], int]:
    """Complete entries from ``offset``; returns them and the offset after the last complete one."""
    if not path.exists():
        return [], offset
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n")
    if end < 0:
        return [], offset
    out: list[Entry] = []
    pending: Entry | None = None
    consumed = 0
    pos = 0
    for raw in data[: end + 1].split(b"\n")[:-1]:
        pos += len(raw) + 1
        ts, stream, tag, content = raw.split(b" ", 3) if raw.count(b" ") >= 3 else (*raw.split(b" ", 2), b"")
        if pending is None:
            pending = Entry(int(ts), stream.decode(), content)
        else:
            pending.content += content
        if tag == b"F":
            out.append(pending)
            pending = None
            consumed = pos
    return out, offset + consumed


@dataclass
class LogOptions:
    follow: bool = False
    timestamps: bool = False
    since_ns: int | None = None
    tail_lines: int | None = None
    limit_bytes: int | None = None


def render(entry: Entry, timestamps: bool) -> bytes:
    if timestamps:
        return rfc3339_nano(entry.ns).encode() + b" " + entry.content + b"\n"
    return entry.content + b"\n"


async def stream_log(log: LogFile | None, path: Path, opts: LogOptions, alive) -> AsyncIterator[bytes]:
    """Yield the rendered log; with ``follow``, keep yielding until the instance's log is closed.

    ``alive()`` returns False once the pod is gone, which also ends a follow.
    """
    entries, offset = read_entries(path)
    if opts.since_ns is not None:
        entries = [e for e in entries if e.ns >= opts.since_ns]
    if opts.tail_lines is not None:
        entries = entries[-opts.tail_lines :] if opts.tail_lines > 0 else []
    budget = opts.limit_bytes

    def take(chunk: bytes) -> bytes:
        nonlocal budget
        if budget is None:
            return chunk
        chunk = chunk[:budget]
        budget -= len(chunk)
        return chunk

    out = b"".join(render(e, opts.timestamps) for e in entries)
    if out:
        yield take(out)
    if not opts.follow:
        return
    while budget is None or budget > 0:
        if log is None or log.closed:
            entries, offset = read_entries(path, offset)
            out = b"".join(
                render(e, opts.timestamps) for e in entries if opts.since_ns is None or e.ns >= opts.since_ns
            )
            if out:
                yield take(out)
            return
        await log.wait(2.0)
        entries, offset = read_entries(path, offset)
        out = b"".join(
            render(e, opts.timestamps) for e in entries if opts.since_ns is None or e.ns >= opts.since_ns
        )
        if out:
            yield take(out)
        if not alive():
            return
