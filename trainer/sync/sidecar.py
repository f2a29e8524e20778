"""The checkpoint-sync sidecar: upload new or changed files and commit each pass.

Every ``interval`` seconds a pass scans ``CHECKPOINT_DIR`` and ``OUTPUT_DIR``, uploads
files that are new or changed and quiet (unmodified for ``quiet`` seconds, and not named
like a temporary file), and then writes the pass manifest listing the whole current set.
The manifest is written strictly after every file it lists is uploaded.

What lands at a key is always a consistent snapshot whose sha256 is in the object's
metadata (:mod:`trainer.sync.sidecar_files`, the work on one file); which files a pass takes
and how its uploads went is :mod:`trainer.sync.sidecar_pass`. A file that changes while it is
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

With ``KUBETRAIN_PREPARED_URI``, a thread beside the passes uploads the prepared copies a
trainer made of the dataset version (:mod:`trainer.sync.prepared`) every ``interval`` seconds, so
that a copy of many GB never holds up a checkpoint; the final pass gives what is left of the
grace period, after its manifest, to a copy not uploaded yet.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kubetrain_contract.manifests import SyncPassError, SyncPassRecord
from kubetrain_contract.pod import DATA_DIR, Env
from kubetrain_contract.run_layout import pass_key
from kubetrain_contract.s3uri import S3Uri
from trainer.sync.median import ReportStopper
from trainer.sync.prepared import PREPARED_DIR_NAME, PreparedUploads
from trainer.sync.progress import human_bytes, log
from trainer.sync.restore import list_passes, load_pass
from trainer.sync.s3 import S3
from trainer.sync.sidecar_files import Entry, Stat, sha256_file
from trainer.sync.sidecar_pass import MANIFEST_RESERVE, PassPlan, PassSteps, Stopped, Uploads, now_iso

# Extra final passes for files caught mid-write (a trainer checkpointing on its own SIGTERM);
# bounded, so a file written without end cannot hold the pod's termination.
FINAL_PASS_RETRIES = 3
# seconds between looks at the trial's reports when it may be stopped early (a stat of two files)
STOP_CHECK_INTERVAL = 1.0


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
    prepared: S3Uri | None = None  # the dataset version's prepared copies (KUBETRAIN_PREPARED_URI)
    prepared_dir: Path = Path(DATA_DIR) / PREPARED_DIR_NAME  # where the trainer keeps them

    def __post_init__(self) -> None:
        for name in ("interval", "quiet", "settle", "grace"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} {getattr(self, name)} must not be negative")
        if self.workers < 1 or self.attempts < 1:
            raise ValueError(f"workers {self.workers} and attempts {self.attempts} must be at least 1")


class Sidecar(PassSteps):
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
        self._part_checksums = True  # until the store refuses them (put_multipart)
        self.started = False  # the run's pass numbers are known
        self.deferred: set[tuple[str, str]] = set()  # recent files an earlier pass left for later
        self._background = ThreadPoolExecutor(2, thread_name_prefix="s3")  # calls SIGTERM may abandon
        self.prepared = (
            PreparedUploads(self, config.prepared, config.prepared_dir, self.stop)
            if config.prepared
            else None
        )

    # -- start ---------------------------------------------------------------------------

    def _until_stop(self, call, deadline: float | None = None):
        """``call()`` in a background thread; its result, unless SIGTERM (or ``deadline``) comes first.

        Raises:
            Stopped: SIGTERM arrived (without a deadline) or the deadline passed; the call
                goes on in the background, bounded by the S3 timeouts.
        """
        future = self._background.submit(call)
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise Stopped()
            try:
                return future.result(timeout=0.1 if left is None else min(0.1, left))
            except TimeoutError:
                if deadline is None and self.stop.is_set():
                    raise Stopped() from None

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
                if st.size == f.size and sha256_file(path) == f.sha256 and st == Stat.of(path):
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
        if self.prepared is not None:
            log(f"checkpoint-sync: prepared copies in {cfg.prepared_dir} -> {cfg.prepared}")
            threading.Thread(target=self.upload_prepared, name="prepared", daemon=True).start()
        while not self.stop.is_set():
            try:
                if not self.started:
                    self.start()
                self.run_pass(final=False)
            except Stopped:
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

    def upload_prepared(self) -> None:
        """Upload the prepared copies every ``interval`` seconds until SIGTERM, in a thread of its own."""
        while not self.stop.is_set() and self.prepared is not None:
            try:
                self.prepared.sync()
            except Stopped:
                break
            except Exception as exc:  # S3 failed: the copy is tried again in the next round
                log(f"checkpoint-sync: WARNING: prepared copies not uploaded this round: {exc}")
            self.stop.wait(self.config.interval)

    def final_prepared(self, deadline: float) -> None:
        """The final pass's round of prepared copies, within what is left of the grace period.

        A copy cut off by the deadline has no manifest in S3, so stage-ins leave it out and the next
        pod's sidecar uploads it.
        """
        if self.prepared is None:
            return
        prepared = self.prepared

        def final() -> None:
            try:
                prepared.sync(deadline)
            except Stopped:
                log("checkpoint-sync: the grace period ended before a prepared copy was uploaded whole")
            except Exception as exc:
                log(f"checkpoint-sync: WARNING: prepared copies not uploaded in the final pass: {exc}")

        thread = threading.Thread(target=final, name="prepared-final", daemon=True)
        thread.start()
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            log("checkpoint-sync: the grace period ended while a prepared copy was being uploaded")

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
        except Stopped:
            self.abandoned = True
            log(
                f"checkpoint-sync: ERROR: final pass failed: S3 did not answer within the grace period "
                f"({cfg.grace:g}s); no final manifest"
            )
            return 1
        except Exception as exc:
            log(f"checkpoint-sync: ERROR: final pass failed: {exc}")
            return 1
        self.final_prepared(deadline)
        log(
            f"checkpoint-sync: done: {self.uploaded_files:,} uploads, {human_bytes(self.uploaded_bytes)}; "
            f"final pass {written.number if written else '-'}"
        )
        return 0 if written is not None else 1

    def run_pass(self, *, final: bool, deadline: float | None = None) -> SyncPassRecord | None:
        """One pass: scan, upload rounds, commit; returns the manifest it wrote, or None when nothing changed.

        Raises:
            Stopped: SIGTERM arrived during a periodic pass (its uploads are abandoned, and
                its pass number is not used again), or the final pass's deadline passed
                before its manifest was written.
        """
        plan = self.scan_changes(final=final)
        uploads = self.upload_rounds(plan, deadline)
        return self.commit(plan, uploads, deadline)

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
            Stopped: SIGTERM (periodic pass) or the deadline (final pass) came before the
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
            self.retry(
                lambda: self.s3.put_bytes(self.config.run.bucket, key, body, content_type="application/json"),
                f"s3://{self.config.run.bucket}/{key}",
            )

        if deadline is None:
            self._until_stop(put)
        else:  # the final manifest: until the end of the grace period, not beyond
            self._until_stop(put, deadline)
