"""Restore the files of a run's newest pass manifest whose files all verify.

A pass manifest is written only after every file it lists is uploaded, so a pass that
died early has no manifest and is never considered. A later pass may still have
overwritten a key (same path, new content) and died before its manifest: the bytes at
that key then match no manifest. Each object carries its sha256 in its metadata, so a HEAD
tells whether a key still holds the bytes a manifest lists; a manifest with any such
mismatch is skipped for the next older one, and every downloaded byte is verified against
the manifest's sha256 before it is moved into place.
"""

from __future__ import annotations

import os
import secrets
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kubetrain_contract.run_layout import PASS_NAME, pass_key, pass_prefix
from kubetrain_contract.s3uri import S3Uri
from trainer.sync.errors import NotAsListed, SyncError
from trainer.sync.manifest import PassFile, PassManifest, read_pass
from trainer.sync.progress import Progress, human_bytes, log
from trainer.sync.s3 import S3
from trainer.sync.transfer import Download, Downloader

SHA256_METADATA = "sha256"


@dataclass(frozen=True)
class RestoreResult:
    """What a restore brought back."""

    number: int
    files: int
    bytes: int


def list_passes(s3: S3, run: S3Uri) -> list[int]:
    """Pass numbers that have a manifest below ``run``, oldest first."""
    prefix = pass_prefix(run.key)
    numbers = []
    try:
        for item in s3.list_objects(run.bucket, prefix):
            match = PASS_NAME.search(item["Key"])
            if match:
                numbers.append(int(match.group(1)))
    except Exception as exc:
        raise SyncError(f"cannot list the pass manifests under {run}/sync/: {exc}") from exc
    return sorted(numbers)


def load_pass(s3: S3, run: S3Uri, number: int) -> PassManifest:
    """Read and check one pass manifest."""
    uri = S3Uri(run.bucket, pass_key(run.key, number))
    try:
        body = s3.get_bytes(uri.bucket, uri.key)
    except Exception as exc:
        raise SyncError(f"cannot read the pass manifest {uri}: {exc}") from exc
    return read_pass(body, str(uri))


def _mismatch(s3: S3, bucket: str, f: PassFile) -> str | None:
    """Why the object no longer holds the file's bytes, or None when it does (as far as a HEAD tells)."""
    try:
        head = s3.head(bucket, f.key)
    except Exception as exc:
        return f"s3://{bucket}/{f.key} cannot be read ({exc})"
    size = int(head.get("content-length", -1))
    if size != f.size:
        return f"s3://{bucket}/{f.key} has {size} bytes, the manifest says {f.size}"
    # header names are case-insensitive: S3 sends metadata lower-case, MinIO and rclone capitalized
    stored = head.get(f"x-amz-meta-{SHA256_METADATA}")
    if stored is not None and stored != f.sha256:
        return f"s3://{bucket}/{f.key} holds content with sha256 {stored}, the manifest says {f.sha256}"
    return None


def restore(
    s3: S3,
    run: S3Uri,
    targets: dict[str, Path],
    *,
    workers: int,
    progress_interval: float,
    label: str = "restore",
) -> RestoreResult | None:
    """Restore the newest verified pass of ``run`` into ``targets`` (area -> directory).

    Args:
        s3: S3 access.
        run: the run prefix (``KUBETRAIN_RUN_URI``).
        targets: the areas to restore and where (``checkpoints`` and optionally ``output``).
        workers: concurrent requests.
        progress_interval: seconds between progress lines.
        label: how log lines start.

    Returns:
        What was restored, or None when no pass manifest exists or none verifies.

    Raises:
        SyncError: a manifest of an unknown format, or a local file that cannot be written.
    """
    numbers = list_passes(s3, run)
    if not numbers:
        log(f"{label}: no pass manifest under {run}/sync/: nothing to restore")
        return None
    for number in reversed(numbers):
        manifest = load_pass(s3, run, number)
        if not manifest.complete:
            log(f"{label}: pass {number} is incomplete ({len(manifest.errors)} errors); trying an older pass")
            continue
        files = [f for f in manifest.files if f.area in targets]
        with ThreadPoolExecutor(max(1, workers)) as pool:
            problems = [p for p in pool.map(lambda f: _mismatch(s3, run.bucket, f), files) if p]
        if problems:
            log(f"{label}: pass {number} no longer verifies ({problems[0]}); trying an older pass")
            continue
        try:
            return _download(s3, run, number, files, targets, workers, progress_interval, label)
        except _Unverified as exc:
            log(f"{label}: pass {number} no longer verifies ({exc}); trying an older pass")
    log(
        f"{label}: WARNING: none of the {len(numbers)} pass manifests under {run}/sync/ verifies: nothing restored"
    )
    return None


class _Unverified(SyncError):
    """Downloaded bytes did not match the manifest."""


def _download(
    s3: S3,
    run: S3Uri,
    number: int,
    files: list[PassFile],
    targets: dict[str, Path],
    workers: int,
    progress_interval: float,
    label: str,
) -> RestoreResult:
    staging: dict[str, Path] = {}
    try:
        for area in {f.area for f in files} | set(targets):
            try:
                targets[area].mkdir(parents=True, exist_ok=True)
                staging[area] = targets[area] / f".kubetrain-restore-{secrets.token_hex(6)}"
                staging[area].mkdir()
            except OSError as exc:
                raise SyncError(f"cannot write to {targets[area]} ({area}): {exc.strerror or exc}") from exc
        items = [
            Download(run.bucket, f.key, f.size, staging[f.area] / f.path, sha256=f.sha256) for f in files
        ]
        total = sum(f.size for f in files)
        log(f"{label}: pass {number}: {len(files)} files, {human_bytes(total)} from {run}")
        with Progress(f"{label}", len(files), total, progress_interval) as progress:
            try:
                Downloader(s3, workers, progress).run(items)
            except NotAsListed as exc:
                raise _Unverified(str(exc)) from exc
            for f, item in zip(files, items, strict=True):
                final = targets[f.area] / f.path
                final.parent.mkdir(parents=True, exist_ok=True)
                os.replace(item.dest, final)
            log(progress.summary(f"; pass {number}"))
        return RestoreResult(number, len(files), total)
    finally:
        for path in staging.values():
            shutil.rmtree(path, ignore_errors=True)
