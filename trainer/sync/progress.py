"""Progress lines for pod logs: plain lines at a steady interval, then one summary line."""

from __future__ import annotations

import sys
import threading
import time
from datetime import UTC, datetime
from typing import TextIO


def log(message: str, stream: TextIO | None = None) -> None:
    """Write one timestamped line (pod logs keep lines, not carriage-return redraws)."""
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    out = stream or sys.stderr
    out.write(f"{stamp} {message}\n")
    out.flush()


def human_bytes(n: float) -> str:
    """Format a byte count with a decimal unit (MB/s figures then agree with the sizes)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def human_seconds(s: float) -> str:
    """Format a duration as ``1h02m``, ``3m05s`` or ``4.2s``."""
    if s >= 3600:
        return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"
    if s >= 60:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{s:.1f}s"


class Progress:
    """Counts objects and bytes done and reports them every ``interval`` seconds.

    Args:
        label: what the lines start with (``stage-in``, ``restore``, ...).
        total_objects: objects expected.
        total_bytes: bytes expected.
        interval: seconds between lines; 0 reports nothing until the summary.
    """

    def __init__(self, label: str, total_objects: int, total_bytes: int, interval: float) -> None:
        self.label = label
        self.total_objects = total_objects
        self.total_bytes = total_bytes
        self.interval = interval
        self.objects = 0
        self.bytes = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Progress:
        self._started = time.monotonic()
        if self.interval > 0:
            self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def add(self, objects: int = 0, nbytes: int = 0) -> None:
        """Count finished objects and received bytes."""
        with self._lock:
            self.objects += objects
            self.bytes += nbytes

    @property
    def elapsed(self) -> float:
        """Seconds since the transfer started."""
        return time.monotonic() - self._started

    def line(self) -> str:
        """The current progress line."""
        elapsed = max(self.elapsed, 1e-6)
        rate = self.bytes / elapsed
        remaining = self.total_bytes - self.bytes
        eta = human_seconds(remaining / rate) if rate > 0 and remaining > 0 else "-"
        return (
            f"{self.label}: {self.objects:,}/{self.total_objects:,} objects, "
            f"{human_bytes(self.bytes)}/{human_bytes(self.total_bytes)}, "
            f"{human_bytes(rate)}/s, ETA {eta}"
        )

    def summary(self, extra: str = "") -> str:
        """The one-line summary for the end of a transfer."""
        elapsed = max(self.elapsed, 1e-6)
        return (
            f"{self.label}: done: {self.objects:,} objects, {human_bytes(self.bytes)} in "
            f"{human_seconds(elapsed)} ({human_bytes(self.bytes / elapsed)}/s){extra}"
        )

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            log(self.line())
