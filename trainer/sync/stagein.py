"""Stage-in: a dataset snapshot into DATA_DIR, then this run's checkpoints into CHECKPOINT_DIR.

Everything is downloaded and extracted inside a hidden staging directory in DATA_DIR and
moved into place only when every object has verified and every archive has extracted, so
a failed stage-in leaves DATA_DIR as it was.

With a cache directory, verified objects are kept under ``<cache>/<version>/`` (the
dataset version is a hash of the objects' identities, so a version never changes); a
later stage-in of the same version copies them from there and reads nothing but the
manifest from S3.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from trainer.sync.archive import ExtractLimits, extract, is_archive
from trainer.sync.manifest import DatasetManifest, read_dataset_manifest
from trainer.sync.progress import Progress, human_bytes, log
from trainer.sync.restore import restore
from trainer.sync.s3 import S3, S3RequestError, S3Uri, SyncError
from trainer.sync.transfer import DEFAULT_MD5_MAX_SIZE, VERIFY_MODES, Download, Downloader

CACHE_INDEX = "index.json"


@dataclass(frozen=True)
class StageInConfig:
    """Settings of a stage-in (see ``python -m trainer.sync stage-in --help``)."""

    manifest: S3Uri
    data_dir: Path
    checkpoint_dir: Path
    run: S3Uri | None = None
    cache_dir: Path | None = None
    keep_archives: bool = False
    limits: ExtractLimits = ExtractLimits()
    workers: int = 16
    progress_interval: float = 5.0
    verify: str = "auto"
    part_size: int | None = None
    md5_max_size: int = DEFAULT_MD5_MAX_SIZE

    def __post_init__(self) -> None:
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"verify {self.verify!r} must be one of {', '.join(VERIFY_MODES)}")
        if self.workers < 1:
            raise ValueError(f"workers {self.workers} must be at least 1")


def verification_summary(items: list[Download]) -> str:
    """How the objects were checked, e.g. ``40 objects by size+etag+crc32(store), 1 by size+md5(etag)``."""
    counts: dict[str, int] = {}
    for item in items:
        counts[item.verified_by] = counts.get(item.verified_by, 0) + 1
    parts = [f"{n:,} by {how}" for how, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    if parts:
        parts[0] = parts[0].replace(" by ", " objects by ", 1)
    return ", ".join(parts) or "0 objects"


def read_manifest(s3: S3, uri: S3Uri) -> DatasetManifest:
    """Fetch and check a dataset manifest.

    Raises:
        SyncError: naming the URI when it is missing, unreadable or not a valid manifest.
    """
    try:
        body = s3.get_bytes(uri.bucket, uri.key)
    except S3RequestError as exc:
        if exc.code == "NoSuchBucket":
            raise SyncError(f"dataset manifest {uri}: the bucket {uri.bucket!r} does not exist") from exc
        if exc.status == 404:
            raise SyncError(f"dataset manifest {uri} does not exist") from exc
        raise SyncError(f"cannot read the dataset manifest {uri}: HTTP {exc.status} {exc.code}") from exc
    except SyncError as exc:
        raise SyncError(f"cannot read the dataset manifest {uri}: {exc}") from exc
    return read_dataset_manifest(body, str(uri))


def stage_in(s3: S3, cfg: StageInConfig) -> None:
    """Run a whole stage-in.

    Raises:
        SyncError: naming what failed; DATA_DIR is then left as it was.
    """
    manifest = read_manifest(s3, cfg.manifest)
    log(
        f"stage-in: dataset {manifest.dataset} version {manifest.version}: {len(manifest.objects):,} objects, "
        f"{human_bytes(manifest.total_bytes)} from {manifest.source}"
    )
    staging = _make_staging(cfg.data_dir)
    try:
        objects = staging / "objects"
        with Progress(
            "stage-in", len(manifest.objects), manifest.total_bytes, cfg.progress_interval
        ) as progress:
            source = "S3"
            if cfg.cache_dir is not None and _from_cache(
                cfg.cache_dir, manifest, objects, cfg.workers, progress
            ):
                source = f"cache {cfg.cache_dir / manifest.version} (0 bytes read from S3)"
            else:
                _check_space(cfg.data_dir, manifest.total_bytes)
                items = [
                    Download(o.bucket, o.key, o.size, objects / o.path, etag=o.etag) for o in manifest.objects
                ]
                downloader = Downloader(
                    s3,
                    cfg.workers,
                    progress,
                    verify=cfg.verify,
                    part_size=cfg.part_size,
                    md5_max_size=cfg.md5_max_size,
                )
                downloader.run(items)
                log(f"stage-in: verified {verification_summary(items)}")
                if cfg.cache_dir is not None:
                    _to_cache(cfg.cache_dir, manifest, objects, items)
            archives = [objects / o.path for o in manifest.objects if is_archive(o.path)]
            members = 0
            for archive in archives:
                members += extract(archive, cfg.limits)
                if not cfg.keep_archives:
                    archive.unlink()
            _publish(objects, cfg.data_dir)
            extracted = f"; {len(archives)} archives extracted ({members:,} members)" if archives else ""
            log(progress.summary(f" from {source}{extracted}"))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if cfg.run is None:
        log("stage-in: KUBETRAIN_RUN_URI is not set: no checkpoints to restore")
        return
    result = restore(
        s3,
        cfg.run,
        {"checkpoints": cfg.checkpoint_dir},
        workers=cfg.workers,
        progress_interval=cfg.progress_interval,
        label="stage-in: checkpoints",
    )
    if result is None:
        log("stage-in: starting without checkpoints")


def _make_staging(data_dir: Path) -> Path:
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        staging = data_dir / f".kubetrain-stage-{secrets.token_hex(6)}"
        staging.mkdir()
        (staging / "objects").mkdir()
        return staging
    except OSError as exc:
        raise SyncError(f"cannot write to DATA_DIR {data_dir}: {exc.strerror or exc}") from exc


def _check_space(directory: Path, needed: int) -> None:
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if free < needed:
        raise SyncError(
            f"DATA_DIR {directory} has {human_bytes(free)} free; the dataset needs {human_bytes(needed)} "
            f"before extraction"
        )


def _publish(objects: Path, data_dir: Path) -> None:
    """Move the staged entries into DATA_DIR, replacing what an earlier stage-in left.

    A rename replaces a file in place; only an entry the rename cannot replace (a directory, or
    a file where a directory goes) is removed first, so a fresh DATA_DIR costs one call per entry.
    """
    for name in sorted(os.listdir(objects)):
        src, dst = objects / name, data_dir / name
        try:
            os.rename(src, dst)
            continue
        except (IsADirectoryError, NotADirectoryError, FileExistsError):
            pass
        except OSError as exc:
            if exc.errno != errno.ENOTEMPTY:
                raise
        if os.path.isdir(dst) and not os.path.islink(dst):
            shutil.rmtree(dst)
        else:
            dst.unlink()
        os.rename(src, dst)


def _cache_entries(manifest: DatasetManifest) -> list[dict]:
    return [{"path": o.path, "size": o.size, "etag": o.etag} for o in manifest.objects]


def _from_cache(
    cache_dir: Path, manifest: DatasetManifest, objects: Path, workers: int, progress: Progress
) -> bool:
    entry = cache_dir / manifest.version
    try:
        index = json.loads((entry / CACHE_INDEX).read_text())
    except (OSError, ValueError):
        return False
    if index.get("version") != manifest.version or index.get("objects") != _cache_entries(manifest):
        log(f"stage-in: cache entry {entry} does not match the manifest; downloading")
        return False
    for o in manifest.objects:
        try:
            if (entry / "objects" / o.path).stat().st_size != o.size:
                log(f"stage-in: cached {o.path} has the wrong size; downloading")
                return False
        except OSError:
            log(f"stage-in: cached {o.path} is missing; downloading")
            return False
    _check_space(objects, manifest.total_bytes)

    def copy(o) -> None:
        dst = objects / o.path
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            shutil.copyfile(entry / "objects" / o.path, dst)
        except OSError as exc:
            raise SyncError(
                f"cannot copy {o.path} from the cache into {objects}: {exc.strerror or exc}"
            ) from exc
        progress.add(objects=1, nbytes=o.size)

    with ThreadPoolExecutor(min(workers, 4)) as pool:
        list(pool.map(copy, manifest.objects))
    return True


def _to_cache(cache_dir: Path, manifest: DatasetManifest, objects: Path, items: list[Download]) -> None:
    """Keep verified objects for later stage-ins; a cache that cannot be written is only a warning."""
    tmp = cache_dir / f".tmp-{manifest.version}-{secrets.token_hex(4)}"
    try:
        for o in manifest.objects:
            dst = tmp / "objects" / o.path
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(objects / o.path, dst)
        index = {
            "version": manifest.version,
            "dataset": manifest.dataset,
            "objects": _cache_entries(manifest),
            "verified_by": sorted({i.verified_by for i in items}),
        }
        (tmp / CACHE_INDEX).write_text(json.dumps(index))
        try:
            os.rename(tmp, cache_dir / manifest.version)
        except OSError:
            # another pod cached the same version first, or a stale entry is in the way
            stale = cache_dir / manifest.version
            shutil.rmtree(stale, ignore_errors=True)
            os.rename(tmp, stale)
        log(f"stage-in: cached version {manifest.version} in {cache_dir}")
    except OSError as exc:
        log(f"stage-in: WARNING: cannot cache version {manifest.version} in {cache_dir}: {exc}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
