"""A sync pass's scan and upload rounds: which files a pass takes, and what their uploads did.

Every ``interval`` seconds a pass scans ``CHECKPOINT_DIR`` and ``OUTPUT_DIR`` and takes the files
that are new or changed and quiet (unmodified for ``quiet`` seconds, and not named like a
temporary file); a file that an earlier pass deferred as recent is taken when it holds still
around its upload. :class:`PassSteps` is that half of :class:`trainer.sync.sidecar.Sidecar`; the
other half commits the pass (its manifest) and runs the loop.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import NamedTuple, cast

from kubetrain_contract.manifests import Area, SyncPassError
from trainer.sync.progress import human_bytes, log
from trainer.sync.sidecar_files import FileSync, Stat, is_temporary, size_of

# seconds of the grace period kept for the final manifest after the uploads
MANIFEST_RESERVE = 2.0
# threads of a pass that takes recent files: each holds still for `settle` seconds in its own
SETTLE_THREADS = 64


class Stopped(Exception):
    """SIGTERM arrived while a periodic pass was waiting on S3."""


def now_iso() -> str:
    """The current UTC time as ISO 8601 with a Z suffix."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Change(NamedTuple):
    """A file a pass found new or changed."""

    ident: tuple[str, str]  # (area, relative path)
    path: Path
    recent: bool  # modified within the quiet period


@dataclass(frozen=True)
class PassPlan:
    """What a pass's scan found: the pass's number and the files it is to upload."""

    number: int
    final: bool
    started_at: str
    began: float  # time.monotonic() when the pass began
    todo: list[Change]


@dataclass(frozen=True)
class Uploads:
    """What a pass's upload rounds did."""

    errors: list[SyncPassError]
    uploaded: int
    timed_out: bool  # uploads were still running when the final pass's grace period ended


class PassSteps(FileSync):
    """The scan and the upload rounds of a pass of :class:`trainer.sync.sidecar.Sidecar`.

    A mixin: it reads and updates the sidecar's ``config``, ``stop``, ``entries``, ``deferred``,
    ``next_pass``, ``unsettled`` and ``abandoned``, and uploads through ``_sync_file``
    (:class:`trainer.sync.sidecar_files.FileSync`).
    """

    # the sidecar's attributes this mixin uses beside FileSync's (set in Sidecar.__init__)
    deferred: set[tuple[str, str]]
    next_pass: int
    abandoned: bool

    def scan(self) -> dict[tuple[str, str], Path]:
        """Regular, non-temporary files of every area, by (area, relative path)."""
        found: dict[tuple[str, str], Path] = {}
        for area, root in self.config.dirs.items():
            if not root.is_dir():
                continue
            for dirpath, dirnames, filenames in os.walk(root):
                rel_dir = os.path.relpath(dirpath, root)
                dirnames[:] = sorted(d for d in dirnames if not is_temporary(d))
                for name in filenames:
                    rel = name if rel_dir == "." else f"{rel_dir}/{name}"
                    path = Path(dirpath) / name
                    if is_temporary(rel) or path.is_symlink() or not path.is_file():
                        continue
                    found[(area, rel.replace(os.sep, "/"))] = path
        return found

    def scan_changes(self, *, final: bool) -> PassPlan:
        """The scan: which files this pass uploads, and which the current set no longer holds.

        A file is a candidate when it is new or its stat changed since it was uploaded. A
        recent one (modified within the quiet period) waits for a later pass, unless this is
        the final pass or it was already deferred by the previous one. Files that disappeared
        leave the set, except while recent files are deferred.

        Args:
            final: the pass on SIGTERM (it takes recent files at once).
        """
        started_at = now_iso()
        began = time.monotonic()
        found = self.scan()
        now = time.time()
        candidates = []
        for ident, path in sorted(found.items()):
            try:
                st = Stat.of(path)
            except OSError:
                continue
            entry = self.entries.get(ident)
            if entry is not None and entry.stat == st:
                continue
            candidates.append(Change(ident, path, now - st.mtime_ns / 1e9 < self.config.quiet))
        recent = {c.ident for c in candidates if c.recent}
        # A file still recent in the next pass is being rewritten faster than the quiet period
        # (TensorFlow's `checkpoint` index is rewritten at every save): then this pass takes
        # every recent file that holds still around its upload, so the index goes with the
        # checkpoint files it names.
        take_recent = final or bool(recent & self.deferred)
        self.deferred = set() if take_recent else recent
        todo = [c for c in candidates if take_recent or not c.recent]
        # files that disappeared are no longer part of the set, unless this pass defers recent
        # files: a deferred index may still name them, so the older set is kept whole (their
        # objects stay in S3 until the run is cleaned up)
        if not self.deferred:
            for ident in [i for i in self.entries if i not in found]:
                del self.entries[ident]
        return PassPlan(self.next_pass, final, started_at, began, todo)

    def upload_rounds(self, plan: PassPlan, deadline: float | None) -> Uploads:
        """Upload the plan's files, in rounds, and say which could not be uploaded.

        A file that changed during its upload is tried again (twice at most) in the same
        periodic pass; the final pass has a single round, and its own loop of passes
        (:meth:`final_pass`). A failed or unfinished upload may have replaced the bytes at its
        key, so its file leaves the current set.

        Args:
            plan: what the scan found.
            deadline: the end of the final pass's grace period (``time.monotonic()``), or None
                for a periodic pass, which SIGTERM abandons instead.

        Raises:
            Stopped: SIGTERM arrived during a periodic pass; its pass number is not used again.
        """
        if plan.todo or plan.final:
            nbytes = sum(size_of(c.path) for c in plan.todo)
            log(
                f"checkpoint-sync: {'final ' if plan.final else ''}pass {plan.number} started: "
                f"{len(plan.todo)} files ({human_bytes(nbytes)}) to upload"
            )
        self.unsettled = False
        # At most `workers` files read and sent at once (this pass's permits: an upload an earlier,
        # abandoned pass left hanging holds none of them). A recent file then holds still for
        # `settle` seconds in its own thread, holding no permit: every file a trainer wrote last
        # is recent in the final pass (18 of 18 at the end of a sweep trial), and with `workers`
        # threads they settled in waves: that final pass took 1.6 s at 8 workers and a settle of
        # 0.5 s, and takes 0.6 s with a thread each.
        requests = threading.BoundedSemaphore(self.config.workers)
        recent = sum(1 for c in plan.todo if c.recent)
        threads = max(self.config.workers, min(recent, SETTLE_THREADS))
        pool = ThreadPoolExecutor(threads, thread_name_prefix="put")
        futures: dict[Future[bool], tuple[str, str]] = {}
        batch = plan.todo
        for _ in range(1 if plan.final else 3):
            round_ = {
                pool.submit(self._sync_file, c.ident, c.path, c.recent, plan.final, requests): c
                for c in batch
            }
            futures.update({fut: c.ident for fut, c in round_.items()})
            pending = self._wait_round(pool, set(round_), futures, deadline)
            batch = [
                c
                for fut, c in round_.items()
                if fut not in pending and fut.exception() is None and fut.result()
            ]
            if pending or not batch:
                break
        return self._tally(pool, futures)

    def _wait_round(
        self,
        pool: ThreadPoolExecutor,
        round_: set[Future[bool]],
        futures: dict[Future[bool], tuple[str, str]],
        deadline: float | None,
    ) -> set[Future[bool]]:
        """Wait for one round of uploads; the uploads still running when the grace period ended.

        Raises:
            Stopped: SIGTERM arrived during a periodic pass (no deadline): its uploads are
                abandoned and what they may have replaced is listed no more.
        """
        if deadline is not None:
            timeout = max(0.0, deadline - time.monotonic() - MANIFEST_RESERVE)
            return wait(round_, timeout=timeout).not_done
        pending = round_
        while pending and not self.stop.is_set():
            _, pending = wait(pending, timeout=0.2)
        if pending:
            pool.shutdown(wait=False, cancel_futures=True)
            for ident in futures.values():  # what a cut-off upload may have replaced is listed no more
                self.entries.pop(ident, None)
            self.next_pass += 1
            raise Stopped()
        return pending

    def _tally(self, pool: ThreadPoolExecutor, futures: dict[Future[bool], tuple[str, str]]) -> Uploads:
        """The errors of a pass's uploads; drops from the current set each file not uploaded."""
        done = {fut for fut in futures if fut.done()}
        pending = set(futures) - done
        errors: list[SyncPassError] = []
        for fut in done:
            area, rel = futures[fut]
            exc = fut.exception()
            if exc is not None:
                errors.append(SyncPassError(cast(Area, area), rel, str(exc)))
                log(f"checkpoint-sync: ERROR: {area}/{rel} could not be uploaded: {exc}")
        for fut in pending:
            area, rel = futures[fut]
            errors.append(SyncPassError(cast(Area, area), rel, "not uploaded before the grace period ended"))
            log(f"checkpoint-sync: ERROR: {area}/{rel} not uploaded before the grace period ended")
        pool.shutdown(wait=not pending, cancel_futures=True)
        self.abandoned = self.abandoned or bool(pending)
        # a failed or unfinished upload may have replaced the bytes at its key: list it no more
        for fut in [*pending, *(f for f in done if f.exception() is not None)]:
            self.entries.pop(futures[fut], None)
        uploaded = sum(1 for f in done if f.exception() is None)
        return Uploads(errors, uploaded, timed_out=bool(pending))
