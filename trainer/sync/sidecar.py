"""The checkpoint-sync sidecar: upload new or changed files and commit each pass.

Every ``interval`` seconds a pass scans ``CHECKPOINT_DIR`` and ``OUTPUT_DIR``, uploads
files that are new or changed and quiet (unmodified for ``quiet`` seconds, and not named
like a temporary file), and then writes the pass manifest listing the whole current set.
The manifest is written strictly after every file it lists is uploaded.

What lands at a key is always a consistent snapshot whose sha256 is in the object's
metadata: a small file is read once into memory, hashed and sent from that same buffer; a
large one is hashed first and then sent as a multipart upload whose parts are checked
against that first read before the (atomic) completion. A file that changes while it is
being uploaded is not listed by that pass.

On SIGTERM a final pass runs without the quiet period; a file modified within the quiet
period must then stay unchanged for ``settle`` seconds around its upload to be listed. A
periodic pass does the same for a file that an earlier pass deferred as recent, so a file
that is rewritten more often than the quiet period (TensorFlow's ``checkpoint`` index) is
not left out of every pass. That index is uploaded after the files of the checkpoint it
names (``model_checkpoint_path``), even when the trainer saved again after the pass's scan:
a listed index never names a checkpoint that its pass does not list.

SIGTERM never waits for S3: a periodic pass (or the start-up listing) still waiting on a
request is abandoned and the final pass starts at once. Every S3 call has connect and read
timeouts and bounded retries (``trainer.sync.s3``), and the final pass ends at ``grace``
seconds whatever S3 does: a pass that ran out of time says so in its manifest
(``complete: false``, ``timed_out: true``), which readers and the promote step refuse.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import random
import re
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import NamedTuple

from kubetrain_contract.manifests import SyncPassError, SyncPassFile, SyncPassRecord
from kubetrain_contract.pod import Env
from trainer.sync.manifest import pass_key
from trainer.sync.median import ReportStopper
from trainer.sync.progress import human_bytes, log
from trainer.sync.restore import SHA256_METADATA, list_passes, load_pass
from trainer.sync.s3 import S3, S3RequestError, S3Uri, SyncError

MiB = 1024 * 1024
SINGLE_PUT_LIMIT = 16 * MiB
# TF and Keras write checkpoints as temporaries and rename them; editors and downloaders
# leave similar names behind. Any path component that matches is skipped.
TEMPORARY = re.compile(r"(\.tmp|_temp|\.partial$|\.part$|~$|^\.#|\.swp$|^\.kubetrain-)", re.IGNORECASE)


# Extra final passes for files caught mid-write (a trainer checkpointing on its own SIGTERM);
# bounded, so a file written without end cannot hold the pod's termination.
FINAL_PASS_RETRIES = 3
# seconds of the grace period kept for the final manifest after the uploads
MANIFEST_RESERVE = 2.0
# threads of a pass that takes recent files: each holds still for `settle` seconds in its own
SETTLE_THREADS = 64
# seconds between looks at the trial's reports when it may be stopped early (a stat of two files)
STOP_CHECK_INTERVAL = 1.0
# TensorFlow's checkpoint index (a CheckpointState text proto, written by rename after the
# files it names). The sync image has no TensorFlow and so no checkpoint_state_pb2 to parse
# it with; the one field read here is a quoted string on its own line.
CHECKPOINT_INDEX = "checkpoint"
LATEST_CHECKPOINT = re.compile(rb'^model_checkpoint_path:\s*"((?:[^"\\]|\\.)*)"\s*$', re.MULTILINE)


class _Stopped(Exception):
    """SIGTERM arrived while a periodic pass was waiting on S3."""


def now_iso() -> str:
    """The current UTC time as ISO 8601 with a Z suffix."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def is_temporary(relative: str) -> bool:
    """Whether a relative path looks like a file still being written."""
    return any(TEMPORARY.search(part) for part in relative.split("/"))


@dataclass(frozen=True)
class Stat:
    """What tells a file version apart without reading it."""

    size: int
    mtime_ns: int
    ino: int

    @classmethod
    def of(cls, path: Path) -> Stat:
        st = os.stat(path, follow_symlinks=False)
        return cls(st.st_size, st.st_mtime_ns, st.st_ino)


@dataclass
class Entry:
    """A file as the bucket holds it."""

    stat: Stat
    file: SyncPassFile


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


class _Changed(Exception):
    """The file changed while it was read or sent."""


@dataclass
class SyncConfig:
    """Settings of the sidecar (see ``python -m trainer.sync checkpoint-sync --help``)."""

    run: S3Uri
    dirs: dict[str, Path]
    interval: float = 30.0
    quiet: float = 2.0
    settle: float = 0.5
    grace: float = 25.0
    workers: int = 8
    attempts: int = 2
    pod: str = field(default_factory=lambda: os.environ.get(Env.HOSTNAME, "unknown"))

    def __post_init__(self) -> None:
        for name in ("interval", "quiet", "settle", "grace"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} {getattr(self, name)} must not be negative")
        if self.workers < 1 or self.attempts < 1:
            raise ValueError(f"workers {self.workers} and attempts {self.attempts} must be at least 1")


class Sidecar:
    """Runs sync passes until SIGTERM, then a final pass.

    Args:
        s3: S3 access.
        config: the sidecar's settings.
        stopper: a sweep trial's early stopping (median, asha or hyperband), checked in a thread beside the passes.
    """

    def __init__(self, s3: S3, config: SyncConfig, stopper: ReportStopper | None = None) -> None:
        self.s3 = s3
        self.config = config
        self.stopper = stopper  # a sweep trial's early stopping (trainer.sync.median, trainer.sync.asha)
        self.stop = threading.Event()
        self.entries: dict[tuple[str, str], Entry] = {}
        self.next_pass = 1
        self.last_written: str | None = None
        self.uploaded_files = 0
        self.uploaded_bytes = 0
        self.abandoned = False  # uploads still running when the grace period ended
        self.unsettled = False  # a pass found files still being written
        self._part_checksums = True  # until the store refuses them (_put_multipart)
        self.started = False  # the run's pass numbers are known
        self.deferred: set[tuple[str, str]] = set()  # recent files an earlier pass left for later
        self._background = ThreadPoolExecutor(2, thread_name_prefix="s3")  # calls SIGTERM may abandon

    # -- start ---------------------------------------------------------------------------

    def _until_stop(self, call, deadline: float | None = None):
        """``call()`` in a background thread; its result, unless SIGTERM (or ``deadline``) comes first.

        Raises:
            _Stopped: SIGTERM arrived (without a deadline) or the deadline passed; the call
                goes on in the background, bounded by the S3 timeouts.
        """
        future = self._background.submit(call)
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise _Stopped()
            try:
                return future.result(timeout=0.1 if left is None else min(0.1, left))
            except TimeoutError:
                if deadline is None and self.stop.is_set():
                    raise _Stopped() from None

    def start(self, deadline: float | None = None) -> None:
        """Continue the run's pass numbers and adopt the files the newest manifest already has."""
        numbers = self._until_stop(lambda: list_passes(self.s3, self.config.run), deadline)
        self.next_pass = (numbers[-1] + 1) if numbers else 1
        self.started = True
        if not numbers:
            return
        newest = self._until_stop(lambda: load_pass(self.s3, self.config.run, numbers[-1]), deadline)
        adopted = 0
        for f in newest.files:
            path = self.config.dirs.get(f.area, Path("/nonexistent")) / f.path
            try:
                st = Stat.of(path)
                if st.size == f.size and _sha256_file(path) == f.sha256 and st == Stat.of(path):
                    self.entries[(f.area, f.path)] = Entry(st, f)
                    adopted += 1
            except OSError:
                continue
        if newest.complete and adopted == len(newest.files):
            self.last_written = self._fingerprint([])  # nothing new to commit yet
        log(f"checkpoint-sync: continuing after pass {numbers[-1]}; {adopted} local files already uploaded")

    def _fingerprint(self, errors: list[SyncPassError]) -> str:
        files = sorted((e.file for e in self.entries.values()), key=lambda f: (f.area, f.path))
        return json.dumps(
            [[dataclasses.asdict(f) for f in files], [dataclasses.asdict(e) for e in errors]], sort_keys=True
        )

    # -- loop ----------------------------------------------------------------------------

    def run(self, stopped: bool = False) -> int:
        """Sync until SIGTERM/SIGINT, then run the final pass; the exit status.

        Args:
            stopped: a SIGTERM already arrived while the process was starting.
        """
        signal.signal(signal.SIGTERM, lambda *_: self.stop.set())
        signal.signal(signal.SIGINT, lambda *_: self.stop.set())
        if stopped:
            self.stop.set()
        cfg = self.config
        log(
            f"checkpoint-sync: {', '.join(f'{a}={d}' for a, d in cfg.dirs.items())} -> {cfg.run} "
            f"every {cfg.interval:g}s (quiet {cfg.quiet:g}s, grace {cfg.grace:g}s)"
        )
        if self.stopper is not None:
            threading.Thread(target=self.watch, name="median-stop", daemon=True).start()
        while not self.stop.is_set():
            try:
                if not self.started:
                    self.start()
                self.run_pass(final=False)
            except _Stopped:
                log("checkpoint-sync: SIGTERM while waiting on S3: that pass is abandoned")
                break
            except Exception as exc:  # the sidecar outlives any single failed pass
                log(f"checkpoint-sync: ERROR: pass {self.next_pass} failed: {exc}")
            self.wait(cfg.interval)
        return self.final_pass()

    def wait(self, seconds: float) -> None:
        """Wait for the next pass, or SIGTERM."""
        self.stop.wait(seconds)

    def watch(self) -> None:
        """Apply the early-stopping rule every STOP_CHECK_INTERVAL seconds until it stops the trial or SIGTERM.

        It runs in a thread of its own, beside the passes: a pass that waits on a slow S3 (or
        uploads a large checkpoint) must not delay a decision that a few files' stat can take,
        or a short trial ends inside one pass without ever being judged.
        """
        while not self.stop.is_set() and self.stopper is not None and self.stopper.decision is None:
            try:
                self.stopper.check()
            except Exception as exc:  # a rule that cannot be applied now never stops the sync
                log(f"checkpoint-sync: WARNING: early stopping not checked: {exc}")
            self.stop.wait(STOP_CHECK_INTERVAL)

    def final_pass(self) -> int:
        """The pass on SIGTERM, within ``grace`` seconds whatever S3 does; the exit status."""
        cfg = self.config
        deadline = time.monotonic() + cfg.grace
        log(f"checkpoint-sync: SIGTERM: final pass, {cfg.grace:g}s at most")
        written = None
        try:
            if not self.started:
                self.start(deadline=deadline - MANIFEST_RESERVE)
            written = self.run_pass(final=True, deadline=deadline)
            # A trainer that checkpoints on its own SIGTERM may still be writing: go again
            # while files were caught mid-write, so its last checkpoint makes the final pass.
            for _ in range(FINAL_PASS_RETRIES):
                if not self.unsettled or time.monotonic() + cfg.settle + MANIFEST_RESERVE >= deadline:
                    break
                time.sleep(cfg.settle)
                written = self.run_pass(final=True, deadline=deadline) or written
        except _Stopped:
            self.abandoned = True
            log(
                f"checkpoint-sync: ERROR: final pass failed: S3 did not answer within the grace period "
                f"({cfg.grace:g}s); no final manifest"
            )
            return 1
        except Exception as exc:
            log(f"checkpoint-sync: ERROR: final pass failed: {exc}")
            return 1
        log(
            f"checkpoint-sync: done: {self.uploaded_files:,} uploads, {human_bytes(self.uploaded_bytes)}; "
            f"final pass {written.number if written else '-'}"
        )
        return 0 if written is not None else 1

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

    def run_pass(self, *, final: bool, deadline: float | None = None) -> SyncPassRecord | None:
        """One pass: scan, upload rounds, commit; returns the manifest it wrote, or None when nothing changed.

        Raises:
            _Stopped: SIGTERM arrived during a periodic pass (its uploads are abandoned, and
                its pass number is not used again), or the final pass's deadline passed
                before its manifest was written.
        """
        plan = self.scan_changes(final=final)
        uploads = self.upload_rounds(plan, deadline)
        return self.commit(plan, uploads, deadline)

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
            _Stopped: SIGTERM arrived during a periodic pass; its pass number is not used again.
        """
        if plan.todo or plan.final:
            nbytes = sum(_size(c.path) for c in plan.todo)
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
            _Stopped: SIGTERM arrived during a periodic pass (no deadline): its uploads are
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
            raise _Stopped()
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
                errors.append(SyncPassError(area, rel, str(exc)))
                log(f"checkpoint-sync: ERROR: {area}/{rel} could not be uploaded: {exc}")
        for fut in pending:
            area, rel = futures[fut]
            errors.append(SyncPassError(area, rel, "not uploaded before the grace period ended"))
            log(f"checkpoint-sync: ERROR: {area}/{rel} not uploaded before the grace period ended")
        pool.shutdown(wait=not pending, cancel_futures=True)
        self.abandoned = self.abandoned or bool(pending)
        # a failed or unfinished upload may have replaced the bytes at its key: list it no more
        for fut in [*pending, *(f for f in done if f.exception() is not None)]:
            self.entries.pop(futures[fut], None)
        uploaded = sum(1 for f in done if f.exception() is None)
        return Uploads(errors, uploaded, timed_out=bool(pending))

    def commit(self, plan: PassPlan, uploads: Uploads, deadline: float | None) -> SyncPassRecord | None:
        """Write the pass manifest: the whole current set, strictly after every file it lists is uploaded.

        Every listed file is in the current set only once its upload finished and it held
        still (``_sync_existing``), so writing the set now is the commit. A periodic pass
        whose set and errors equal the last manifest's writes none.

        Args:
            plan: what the scan found.
            uploads: what the upload rounds did.
            deadline: the end of the final pass's grace period, or None for a periodic pass.

        Returns:
            The manifest written, or None when nothing changed.

        Raises:
            _Stopped: SIGTERM (periodic pass) or the deadline (final pass) came before the
                manifest was written.
        """
        files = sorted((e.file for e in self.entries.values()), key=lambda f: (f.area, f.path))
        fingerprint = self._fingerprint(uploads.errors)
        if not plan.final and fingerprint == self.last_written:
            if plan.todo:
                log(f"checkpoint-sync: pass {plan.number}: nothing changed in S3's copy; no manifest")
            return None
        manifest = SyncPassRecord(
            number=plan.number,
            final=plan.final,
            complete=not uploads.errors,
            started_at=plan.started_at,
            finished_at=now_iso(),
            pod=self.config.pod,
            files=files,
            errors=uploads.errors,
            timed_out=uploads.timed_out,
        )
        self.next_pass += 1  # used even if the write below fails: a late write cannot clash
        self._write_manifest(manifest, deadline)
        self.last_written = fingerprint
        log(
            f"checkpoint-sync: {'final ' if plan.final else ''}pass {plan.number} committed in "
            f"{time.monotonic() - plan.began:.1f}s: {uploads.uploaded}/{len(plan.todo)} files uploaded, "
            f"{len(files)} listed ({human_bytes(sum(f.size for f in files))}), "
            + ("complete" if manifest.complete else f"INCOMPLETE: {len(uploads.errors)} errors")
            + (" (ran out of the grace period)" if uploads.timed_out else "")
        )
        return manifest

    def _write_manifest(self, manifest: SyncPassRecord, deadline: float | None) -> None:
        """Put the pass manifest at ``<run>/sync/pass-<number>.json``, giving up at SIGTERM or ``deadline``."""
        key = pass_key(self.config.run.key, manifest.number)
        body = manifest.to_json(indent=1).encode()

        def put() -> None:
            self._retry(
                lambda: self.s3.put_bytes(self.config.run.bucket, key, body, content_type="application/json"),
                f"s3://{self.config.run.bucket}/{key}",
            )

        if deadline is None:
            self._until_stop(put)
        else:  # the final manifest: until the end of the grace period, not beyond
            self._until_stop(put, deadline)

    def _retry(self, call, what: str):
        # the CRT (and botocore under workload identity, standard mode, ``S3.max_attempts``)
        # already retry each request on 5xx, throttling and connection errors; this loop,
        # ``config.attempts`` times around them, retries what they cannot: a multipart upload
        # as a whole (a part or the completion that still fails leaves an aborted UploadId,
        # recovered only by a new create/parts/complete), a single put refused for its
        # Content-MD5 (a body damaged on the way) or whose ETag is not the MD5 sent, and a put
        # that got no answer in time. Around the pass manifest's one put it only adds attempts.
        delay = 0.2
        for attempt in range(1, self.config.attempts + 1):
            try:
                return call()
            except _Changed:
                raise
            except Exception as exc:
                if attempt == self.config.attempts:
                    raise SyncError(f"{what}: failed after {attempt} attempts: {exc}") from exc
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 5.0)

    # -- one file ------------------------------------------------------------------------

    def _sync_file(
        self, ident: tuple[str, str], path: Path, recent: bool, final: bool, requests: threading.Semaphore
    ) -> bool:
        """Upload one file; True when it changed while it was read or sent (then it is not listed).

        ``requests``: the pass's permits, ``workers`` of them: a file holds one from its read to the
        end of its upload.
        """
        if self.stop.is_set() and not final:
            return False
        try:
            return self._sync_existing(ident, path, recent, final, requests)
        except FileNotFoundError:
            # deleted since the scan (trainers prune old checkpoints): no longer part of the set
            self.entries.pop(ident, None)
            return False

    def _sync_existing(
        self, ident: tuple[str, str], path: Path, recent: bool, final: bool, requests: threading.Semaphore
    ) -> bool:
        area, rel = ident
        key = f"{self.config.run.key.rstrip('/')}/{area}/{rel}"
        began = time.monotonic()
        before = Stat.of(path)
        entry = self.entries.get(ident)
        data: bytes | None = None
        # a permit of the pass's `requests` from the read to the end of the upload: at most
        # `workers` files read, held in memory and sent at once, as with `workers` threads
        requests.acquire()
        holding = True
        try:
            if before.size <= SINGLE_PUT_LIMIT:
                data = _read_all(path, before.size)
                if Stat.of(path) != before:
                    raise _Changed()
                if path.name == CHECKPOINT_INDEX:
                    # the files it names take permits of their own: this one is not held meanwhile
                    requests.release()
                    holding = False
                    self._sync_named_checkpoint(ident, path, data, final, requests)
                    requests.acquire()
                    holding = True
                sha = hashlib.sha256(data).hexdigest()
                if entry is not None and entry.file.sha256 == sha:
                    self.entries[ident] = Entry(before, entry.file)  # touched, not changed
                    return False
                md5 = hashlib.md5(data).digest()
                self._retry(lambda: self._put(key, data, sha, md5), f"s3://{self.config.run.bucket}/{key}")
            else:
                sha, part_crcs = _hash_file(path, _part_size(before.size))
                if Stat.of(path) != before:
                    raise _Changed()
                if entry is not None and entry.file.sha256 == sha:
                    self.entries[ident] = Entry(before, entry.file)
                    return False
                self._retry(
                    lambda: self._put_multipart(key, path, before.size, sha, part_crcs),
                    f"s3://{self.config.run.bucket}/{key}",
                )
        except _Changed:
            self.unsettled = True
            log(f"checkpoint-sync: {area}/{rel} is still being written; not listed in this pass")
            return True
        finally:
            if holding:
                requests.release()
        data = None  # sent: a thread that waits for the file to settle below holds no copy of it
        if recent:
            # a file written just before SIGTERM (or in a pass that takes recent files) is
            # listed only if it then holds still
            time.sleep(max(0.0, self.config.settle - (time.monotonic() - began)))
        if Stat.of(path) != before:
            # the key now holds a consistent but possibly half-written snapshot: list nothing
            self.entries.pop(ident, None)
            self.unsettled = True
            log(f"checkpoint-sync: {area}/{rel} changed during its upload; not listed in this pass")
            return True
        self.entries[ident] = Entry(before, SyncPassFile(area, rel, key, before.size, sha))
        self.uploaded_files += 1
        self.uploaded_bytes += before.size
        return False

    def _sync_named_checkpoint(
        self, ident: tuple[str, str], path: Path, data: bytes, final: bool, requests: threading.Semaphore
    ) -> None:
        """Upload (if needed) the files of the checkpoint that an index version names, before the index.

        The trainer may save again between this pass's scan and the read of its index: the
        index read then names a checkpoint the scan did not see. Listing that index without
        those files would give a retried pod an index naming a checkpoint it does not have.

        Raises:
            _Changed: the named checkpoint's files are gone or changed (the index is not
                listed in this pass).
        """
        match = LATEST_CHECKPOINT.search(data)
        if match is None:
            return
        named = match.group(1).decode("utf-8", "replace")
        area, rel = ident
        root = self.config.dirs[area]
        prefix = Path(named) if os.path.isabs(named) else path.parent / named
        try:
            prefix_rel = prefix.relative_to(root).as_posix()
        except ValueError:
            return  # a checkpoint outside the synced directory: not ours to upload
        files = sorted(prefix.parent.glob(f"{prefix.name}.*")) if prefix.parent.is_dir() else []
        if not any(f.name == f"{prefix.name}.index" for f in files):
            log(
                f"checkpoint-sync: {area}/{rel} names {prefix_rel}, whose files are gone; not listed in this pass"
            )
            raise _Changed()
        sent: list[tuple[tuple[str, str], Path]] = []
        for dep in files:
            dep_ident = (area, dep.relative_to(root).as_posix())
            if is_temporary(dep_ident[1]):
                continue
            entry = self.entries.get(dep_ident)
            try:
                if entry is not None and entry.stat == Stat.of(dep):
                    continue
            except OSError:
                raise _Changed() from None
            # a checkpoint's files are complete once an index names them: no quiet period; they
            # hold still for `settle` seconds around their uploads all together, below (one after
            # the other, each in turn, the data and index files took a second of every final pass)
            try:
                if self._sync_existing(dep_ident, dep, False, final, requests):
                    raise _Changed()
            except FileNotFoundError:
                raise _Changed() from None
            if dep_ident not in self.entries:
                raise _Changed()
            if entry is None or self.entries[dep_ident].file is not entry.file:
                sent.append((dep_ident, dep))  # uploaded now (not only touched since its last upload)
        if not sent:
            return
        # every file's upload began before now, and each must be unchanged `settle` seconds after
        time.sleep(self.config.settle)
        for dep_ident, dep in sent:
            entry = self.entries.get(dep_ident)
            try:
                held = entry is not None and Stat.of(dep) == entry.stat
            except OSError:
                held = False
            if not held:
                self.entries.pop(dep_ident, None)
                self.unsettled = True
                log(
                    f"checkpoint-sync: {area}/{dep_ident[1]} changed after its upload; not listed in this pass"
                )
                raise _Changed()

    def _put(self, key: str, data: bytes, sha: str, md5: bytes) -> None:
        # through the CRT: botocore's per-request CPU is most of a small file's upload
        headers = self.s3.put_bytes(
            self.config.run.bucket,
            key,
            data,
            content_md5=base64.b64encode(md5).decode(),
            metadata={SHA256_METADATA: sha},
        )
        etag = headers.get("etag", "").strip('"')
        if re.fullmatch(r"[0-9a-f]{32}", etag) and etag != md5.hex():
            raise SyncError(
                f"s3://{self.config.run.bucket}/{key}: the server's ETag {etag} is not the MD5 {md5.hex()} sent"
            )

    def _put_multipart(self, key: str, path: Path, size: int, sha: str, crcs: list[int]) -> None:
        s3, bucket = self.s3, self.config.run.bucket
        # each part goes with the CRC32C its two reads were compared by, which the store checks
        # (no SHA-256 of every part to sign); a store that refuses part checksums gets the
        # parts signed with their SHA-256 instead
        with_crcs = self._part_checksums
        try:
            upload_id = s3.create_multipart_upload(
                bucket, key, {SHA256_METADATA: sha}, part_checksums=with_crcs
            )
        except S3RequestError as exc:
            if not with_crcs or exc.status not in (400, 501):
                raise
            log(
                f"checkpoint-sync: the store refused part checksums ({exc.code}); "
                "signing each part's SHA-256 instead"
            )
            self._part_checksums = with_crcs = False
            upload_id = s3.create_multipart_upload(bucket, key, {SHA256_METADATA: sha})
        part_size = _part_size(size)
        etags = []
        try:
            with open(path, "rb") as f:
                for number, expected in enumerate(crcs, start=1):
                    data = os.pread(f.fileno(), part_size, (number - 1) * part_size)
                    if _part_crc(data) != expected:
                        raise _Changed()
                    etags.append(
                        s3.upload_part(
                            bucket, key, upload_id, number, data, crc32c=expected if with_crcs else None
                        )
                    )
            s3.complete_multipart_upload(bucket, key, upload_id, etags, crc32cs=crcs if with_crcs else None)
        except BaseException:
            try:
                s3.abort_multipart_upload(bucket, key, upload_id)
            except Exception as exc:
                log(f"checkpoint-sync: WARNING: could not abort the multipart upload of {key}: {exc}")
            raise


def _size(path: Path) -> int:
    try:
        return os.stat(path, follow_symlinks=False).st_size
    except OSError:
        return 0


def _part_size(size: int) -> int:
    # S3 allows at most 10,000 parts
    return max(16 * MiB, -(-size // (10_000 * MiB)) * MiB)


def _read_all(path: Path, size: int) -> bytes:
    with open(path, "rb") as f:
        data = f.read(size + 1)
    if len(data) != size:
        raise _Changed()
    return data


def _part_crc(data: bytes) -> int:
    """What a part's second read is checked against the first by (a file rewritten in between),
    and the checksum the store checks the part by.

    A CRC32C (awscrt, hardware-accelerated: 0.05 to 0.15 CPU-seconds per GB, where an MD5
    costs 1.5, and twice, once per read).
    """
    from awscrt.checksums import crc32c

    return crc32c(data)


def _hash_file(path: Path, part_size: int) -> tuple[str, list[int]]:
    """The sha256 of a large file and the CRC of each of its parts, from one read."""
    sha = hashlib.sha256()
    crcs = []
    with open(path, "rb") as f:
        while data := f.read(part_size):
            sha.update(data)
            crcs.append(_part_crc(data))
    return sha.hexdigest(), crcs


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while data := f.read(8 * MiB):
            h.update(data)
    return h.hexdigest()
