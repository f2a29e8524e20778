"""SIGTERM handling: Kubernetes sends SIGTERM, then SIGKILL after the grace period.

The handler only records the request; the training loop checks it after every step,
writes a checkpoint and leaves with EXIT_PREEMPTED. Doing the work in the handler
itself could interrupt TensorFlow half-way through a checkpoint write.

A sweep's checkpoint-sync sidecar asks a trial to stop early by writing the file named by
``KUBETRAIN_STOP_FILE``; the loop looks for it at the same points, ends the run as if
training had finished (the best epoch's model exported) and the process exits with
EXIT_STOPPED.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Any

from kubetrain_contract.pod import Env

log = logging.getLogger("kubetrain.trainer")


class StopRequest:
    """Remembers whether (and when) SIGTERM arrived."""

    def __init__(self, stop_file: str | os.PathLike[str] | None = None) -> None:
        self.received_at: float | None = None
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        stop_file = stop_file if stop_file is not None else os.environ.get(Env.STOP_FILE)
        self.stop_file = Path(stop_file) if stop_file else None
        self.file_request: dict[str, Any] | None = None

    def stop_file_request(self) -> dict[str, Any] | None:
        """The stop request in ``KUBETRAIN_STOP_FILE`` (its JSON, or ``{}``) once the file exists, else ``None``."""
        if self.file_request is None and self.stop_file is not None and self.stop_file.exists():
            try:
                document = json.loads(self.stop_file.read_text())
            except (OSError, ValueError):
                document = {}
            self.file_request = document if isinstance(document, dict) else {}
            log.warning("stop requested through %s: finishing after the current step", self.stop_file)
        return self.file_request

    @property
    def requested(self) -> bool:
        """True once SIGTERM has arrived."""
        return self.received_at is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received_at is None:
            self.received_at = time.monotonic()
            self.signum = signum
            log.warning(
                "received %s: checkpointing after the current step, then exiting", signal.Signals(signum).name
            )

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
