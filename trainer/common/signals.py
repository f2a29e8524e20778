"""SIGTERM handling: Kubernetes sends SIGTERM, then SIGKILL after the grace period.

The handler only records the request; the training loop checks it after every step,
writes a checkpoint and leaves with EXIT_PREEMPTED. Doing the work in the handler
itself could interrupt TensorFlow half-way through a checkpoint write.
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType

log = logging.getLogger("kubetrain.trainer")


class StopRequest:
    """Remembers whether (and when) SIGTERM arrived."""

    def __init__(self) -> None:
        self.received_at: float | None = None
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        """True once SIGTERM has arrived."""
        return self.received_at is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received_at is None:
            self.received_at = time.monotonic()
            self.signum = signum
            log.warning("received %s: checkpointing after the current step, then exiting",
                        signal.Signals(signum).name)

    def install(self, signums: tuple[int, ...] = (signal.SIGTERM,)) -> StopRequest:
        """Install the handler for ``signums`` (main thread only) and return self."""
        for signum in signums:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self) -> None:
        """Put back the handlers that ``install`` replaced (matters when called in-process)."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)  # type: ignore[arg-type]
        self._previous.clear()

    def trigger(self, signum: int = signal.SIGTERM) -> None:
        """Request a stop as if the signal had arrived."""
        self._handle(signum, None)
