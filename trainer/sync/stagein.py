"""Stage-in: a dataset snapshot into DATA_DIR, then this run's checkpoints into CHECKPOINT_DIR.

Everything is downloaded and extracted inside a hidden staging directory in DATA_DIR and
moved into place only when every object has verified and every archive has extracted, so
a failed stage-in leaves DATA_DIR as it was.

With a cache directory, verified objects are kept under ``<cache>/<version>/`` (the
dataset version is a hash of the objects' identities, so a version never changes); a
later stage-in of the same version copies them from there and reads nothing but the
manifest from S3.

With a prepared-copy prefix (``s3://<training bucket>/prepared/<dataset>/<version>/``), the
copies a trainer made of this version earlier (decoded, checked, resized records: one folder
per preprocessing key, ``manifest.json`` uploaded last) are downloaded beside the dataset, to
``DATA_DIR/.kubetrain-prepared/<key>/``, each shard checked against the sha256 its manifest
gives. They only save the trainer work: a copy that is missing, incomplete or damaged is
logged and left out, and the trainer makes it itself.
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

from kubetrain_contract.s3uri import S3Uri
from trainer.sync.archive import ExtractLimits, extract, is_archive
from trainer.sync.errors import S3RequestError, SyncError
from trainer.sync.manifest import DatasetManifest, read_dataset_manifest
from trainer.sync.prepared import PREPARED_DIR_NAME, PREPARED_KEY, PREPARED_MANIFEST, listed_shards
from trainer.sync.progress import Progress, human_bytes, log
from trainer.sync.restore import restore
from trainer.sync.s3 import S3
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
    prepared: S3Uri | None = None
    prepared_dir: Path | None = None

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
    if cfg.prepared is not None:
        stage_prepared(
            s3,
            cfg.prepared,
            cfg.prepared_dir or cfg.data_dir / PREPARED_DIR_NAME,
            workers=cfg.workers,
            progress_interval=cfg.progress_interval,
        )
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


def stage_prepared(
    s3: S3, uri: S3Uri, dest: Path, *, workers: int = 16, progress_interval: float = 5.0
) -> list[str]:
    """Download every complete prepared copy under ``uri`` into ``dest/<key>/``; return the keys staged.

    A copy is complete when its ``manifest.json`` is listed (the uploader sends it last). Each
    copy is downloaded into a temporary folder, its shards checked by size and sha256, and
    renamed into place with its manifest, replacing what was there. Nothing here fails the
    stage-in: a copy that cannot be staged is logged and left for the trainer to make.
    """
    prefix = uri.key.rstrip("/") + "/" if uri.key else ""
    try:
        listed = {o["Key"][len(prefix) :]: int(o["Size"]) for o in s3.list_objects(uri.bucket, prefix)}
    except SyncError as exc:
        log(f"stage-in: cannot list prepared copies under {uri}: {exc}; the trainer prepares its own")
        return []
    keys = sorted({rel.split("/", 1)[0] for rel in listed if rel.endswith("/" + PREPARED_MANIFEST)})
    if not keys:
        log(f"stage-in: no prepared copy under {uri} yet")
        return []
    staged = []
    for key in keys:
        try:
            _stage_prepared_copy(s3, uri.bucket, prefix, key, listed, dest, workers, progress_interval)
            staged.append(key)
        except (SyncError, OSError, ValueError) as exc:
            log(
                f"stage-in: WARNING: prepared copy {key} under {uri} not staged ({exc}); the trainer prepares it"
            )
    return staged


def _stage_prepared_copy(
    s3: S3,
    bucket: str,
    prefix: str,
    key: str,
    listed: dict[str, int],
    dest: Path,
    workers: int,
    progress_interval: float,
) -> None:
    if not PREPARED_KEY.match(key):
        raise ValueError(f"folder name {key!r} is not a preprocessing key")
    body = s3.get_bytes(bucket, f"{prefix}{key}/{PREPARED_MANIFEST}")
    shards = listed_shards(json.loads(body))
    items = []
    dest.mkdir(parents=True, exist_ok=True)
    tmp = dest / f".tmp-{key}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        for shard in shards:
            name, size = shard.name, shard.bytes
            if listed.get(f"{key}/{name}") != size:
                raise ValueError(
                    f"{name} is listed with {listed.get(f'{key}/{name}')} bytes, the manifest says {size}"
                )
            items.append(Download(bucket, f"{prefix}{key}/{name}", size, tmp / name, sha256=shard.sha256))
        total = sum(i.size for i in items)
        _check_space(dest, total)
        with Progress(f"stage-in: prepared {key}", len(items), total, progress_interval) as progress:
            Downloader(s3, workers, progress, verify="size").run(items)
            (tmp / PREPARED_MANIFEST).write_bytes(body)
            final = dest / key
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            log(progress.summary(f" into {final}"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
