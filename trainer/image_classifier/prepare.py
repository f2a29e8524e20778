"""The prepared copy of an image folder: every file checked and decoded once, resized, written as shards.

A training pod used to check every file of DATA_DIR with Pillow and then decode it again in
the pipeline, on every start (retries, sweep trials, replicas). Preparation does that work
once per dataset version and preprocessing (:func:`preprocessing_key`): each file's header
is checked (format, decompression bombs), its pixels are decoded once by TensorFlow, resized
by training's own :func:`~trainer.image_classifier.data.resize_image`, and appended as one
fixed-length record to a shard:

    record = int32 record number, int32 label (little-endian), then size * size * channels uint8 pixels

Fixed-length records stream with ``tf.data.FixedLengthRecordDataset``: no parsing, no per-record
framing or CRC to check (the manifest's per-shard sha256 covers the bytes), and a shard's
record count follows from its size. ``manifest.json`` names the format version, the dataset
fingerprint, the preprocessing key, the class names, the files as columns (paths, labels,
record numbers: what a restarted pod reads before its first batch, so parsed and checked as
arrays, not file by file), each shard's records, bytes and sha256, and the files left out with
the reason.

The copy is written in a temporary directory and renamed into place, manifest last; a copy
whose manifest, key, fingerprint, sizes or checksums do not match is refused (the reason is
logged) and made again, never trusted. Where it lives: ``KUBETRAIN_PREPARED_DIR`` (default
``DATA_DIR/.kubetrain-prepared``), one sub-folder per preprocessing key, so that a stage-in
can put a copy made by an earlier pod there and the checkpoint-sync sidecar can upload a
fresh one beside the dataset snapshot.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import os
import secrets
import shutil
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from kubetrain_contract.pod import Env
from trainer.common.contract import DataError
from trainer.image_classifier.data import ImageFolder, resize_image, scan_image_folder

if TYPE_CHECKING:
    from trainer.image_classifier.config import ClassifierConfig

log = logging.getLogger("kubetrain.trainer")

# 2: the file list as columns (files, labels, file_records) instead of [path, label, record] rows.
# 3: the columns as single strings (paths joined by NUL, numbers as base64 int32): parsed in milliseconds.
FORMAT_VERSION = 3
MANIFEST = "manifest.json"
# Written by the process that hashed every shard: a later start on the same files trusts the
# hashes while each shard's size, mtime and inode are unchanged (a download or a rewrite changes them).
VERIFIED_STAMP = ".verified.json"
DEFAULT_DIR_NAME = ".kubetrain-prepared"
SHARD_BYTES = 64 * 1024 * 1024
HEADER_BYTES = 8
# Files are decoded and written in this seeded order, so every shard mixes the classes and a
# small shuffle buffer over a few shards (--shuffle-buffer N) still gives class-balanced batches.
WRITE_ORDER_SEED = 0x9E3779B9
# What changes the decoded pixels besides the flags: bump when the decoder or the resize changes.
PIXELS = "tf.io.decode_image(expand_animations=False) + data.resize_image(area-antialias, round, uint8) v1"

_decodes = 0
_decodes_lock = threading.Lock()


def decodes() -> int:
    """Images decoded by this process so far (what a reused prepared copy must leave at zero)."""
    return _decodes


def _count_decode() -> None:
    global _decodes
    with _decodes_lock:
        _decodes += 1


def preprocessing_key(image_size: int, channels: int) -> str:
    """Names the pixels a copy holds: the record format, the size, the channels and the decoding."""
    text = json.dumps(
        {"format": FORMAT_VERSION, "image_size": image_size, "channels": channels, "pixels": PIXELS},
        sort_keys=True,
    )
    return f"{image_size}px-{channels}ch-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def record_bytes(image_size: int, channels: int) -> int:
    """Bytes of one record: the header and the pixels."""
    return HEADER_BYTES + image_size * image_size * channels


def dataset_fingerprint(data_dir: Path, environ: dict[str, str] | None = None) -> str:
    """What the copy was made from: the staged dataset version, else the folder's listing.

    A staged version names its content (a hash of the objects' identities), so nothing is read.
    Without one (a local folder), the relative path, size and mtime of every visible file are hashed.
    """
    env = os.environ if environ is None else environ
    version = env.get(Env.DATASET_VERSION)
    if version:
        return f"version:{version}"
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(data_dir):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            path = os.path.join(dirpath, name)
            st = os.stat(path)
            digest.update(f"{os.path.relpath(path, data_dir)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return f"listing:{digest.hexdigest()}"


@dataclass(frozen=True)
class Shard:
    """One shard file of the prepared copy."""

    name: str
    records: int
    bytes: int
    sha256: str


@dataclass
class PreparedManifest:
    """``manifest.json`` of a prepared copy (format :data:`FORMAT_VERSION`).

    ``files`` lists the scan's images by relative path, in the scan's order (class by class, names
    sorted): the split is made over this list. ``labels`` and ``file_records`` are its columns:
    each file's label and record number, -1 for a file that Pillow reads and TensorFlow does not
    decode (``undecodable``); ``skipped`` lists the files that are not readable images at all.
    Both give ``[relative path, reason]``. In the JSON the three columns are single strings: the
    paths joined by NUL characters, the numbers as base64 of little-endian int32 (what a restarted
    pod parses before its first batch: 60,000 files as lists of JSON strings and numbers took
    about 25 ms, in these forms a few).
    """

    dataset: str
    key: str
    image_size: int
    channels: int
    class_names: list[str]
    files: list[str]
    labels: list[int]
    file_records: list[int]
    shards: list[Shard]
    skipped: list[list[str]] = field(default_factory=list)
    undecodable: list[list[str]] = field(default_factory=list)
    root: str = "."
    format_version: int = FORMAT_VERSION
    pixels: str = PIXELS

    def to_json(self) -> str:
        """The manifest as JSON text."""
        doc = asdict(self)
        doc["files"] = "\0".join(self.files)
        for name in COLUMNS:
            doc[name] = encode_column(self.arrays[name])
        return json.dumps(doc, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> PreparedManifest:
        """Parse a manifest.

        Raises:
            ValueError: naming what is missing or of the wrong type.
        """
        doc = json.loads(text)
        if not isinstance(doc, dict):
            raise ValueError(f"expected a JSON object, found {type(doc).__name__}")
        if doc.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"format_version {doc.get('format_version')!r}, expected {FORMAT_VERSION}")
        files = doc.get("files")
        if not isinstance(files, str):
            raise ValueError("files: expected the relative paths joined by NUL characters")
        doc["files"] = files.split("\0") if files else []
        n = len(doc["files"])
        arrays = {}
        for name in COLUMNS:
            try:
                arrays[name] = decode_column(doc.get(name))
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from exc
            if arrays[name].size != n:
                raise ValueError(
                    f"{name}: expected {n} whole numbers, one per file, found {arrays[name].size}"
                )
            doc[name] = arrays[name].tolist()  # the fields stay lists: manifests compare equal
        try:
            shards = [Shard(**s) for s in doc.pop("shards")]
            manifest = cls(shards=shards, **doc)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a prepared-copy manifest: {exc}") from exc
        manifest.__dict__["arrays"] = arrays  # the cached property, without converting the lists back
        return manifest

    @cached_property
    def arrays(self) -> dict[str, np.ndarray]:
        """The ``labels`` and ``file_records`` columns as int64 arrays (not part of the JSON)."""
        return {name: np.asarray(getattr(self, name), dtype=np.int64) for name in COLUMNS}

    @property
    def records(self) -> int:
        """Records in all shards."""
        return sum(s.records for s in self.shards)


COLUMNS = ("labels", "file_records")


def encode_column(values: Any) -> str:
    """Whole numbers as the manifest stores a column: base64 of little-endian int32."""
    return base64.b64encode(np.asarray(values, dtype="<i4").tobytes()).decode("ascii")


def decode_column(text: object) -> np.ndarray:
    """:func:`encode_column`'s string as an int64 array.

    Raises:
        ValueError: not such a string.
    """
    if not isinstance(text, str):
        raise ValueError(f"expected base64 of little-endian int32, found {type(text).__name__}")
    try:
        raw = base64.b64decode(text, validate=True)
    except (ValueError, binascii.Error) as exc:
        raise ValueError(f"not base64: {exc}") from exc
    if len(raw) % 4:
        raise ValueError(f"{len(raw)} bytes are not whole int32s")
    return np.frombuffer(raw, dtype="<i4").astype(np.int64)


@dataclass
class PreparedImages:
    """A verified prepared copy, as the pipeline reads it.

    The per-file views are built once, with numpy and string joins rather than a Python call per file:
    a restarted pod's time to its first batch does not grow with the dataset.
    """

    path: Path
    manifest: PreparedManifest
    root: Path
    made: bool = False

    @property
    def class_names(self) -> list[str]:
        return self.manifest.class_names

    @cached_property
    def paths(self) -> list[str]:
        """The scan's files as paths under DATA_DIR's class root, in the scan's order."""
        prefix = os.path.join(self.root, "")
        return [prefix + rel for rel in self.manifest.files]

    @cached_property
    def files(self) -> list[tuple[str, int]]:
        """The scan's files as (path under DATA_DIR's class root, label), in the scan's order."""
        return list(zip(self.paths, self.manifest.labels, strict=True))

    @property
    def labels(self) -> np.ndarray:
        """Each file's label, in the scan's order (int64)."""
        return self.manifest.arrays["labels"]

    @property
    def file_records(self) -> np.ndarray:
        """Each file's record number, in the scan's order, -1 where TensorFlow could not decode it (int64)."""
        return self.manifest.arrays["file_records"]

    @cached_property
    def _record_by_path(self) -> dict[str, int]:
        return dict(zip(self.paths, self.manifest.file_records, strict=True))

    def record_of(self) -> dict[str, int]:
        """Each file's record number (-1: TensorFlow could not decode it)."""
        return self._record_by_path

    def records_of(self, paths: Iterable[str]) -> np.ndarray:
        """The record numbers of ``paths`` (files of :attr:`files`), -1 for those without a record."""
        index = self._record_by_path
        return np.fromiter((index[p] for p in paths), dtype=np.int64)

    @property
    def undecodable(self) -> list[str]:
        """Paths of the files TensorFlow could not decode although Pillow read them."""
        return [os.path.join(self.root, rel) for rel, _ in self.manifest.undecodable]

    @property
    def skipped(self) -> list[list[str]]:
        return self.manifest.skipped

    def shard_paths(self) -> list[str]:
        return [str(self.path / s.name) for s in self.manifest.shards]

    @property
    def record_bytes(self) -> int:
        return record_bytes(self.manifest.image_size, self.manifest.channels)


def prepared_dir(data_dir: Path, environ: dict[str, str] | None = None) -> Path:
    """Where prepared copies live: ``KUBETRAIN_PREPARED_DIR``, else ``DATA_DIR/.kubetrain-prepared``."""
    env = os.environ if environ is None else environ
    return Path(env.get(Env.PREPARED_DIR) or data_dir / DEFAULT_DIR_NAME)


def prepare_images(
    data_dir: Path,
    config: ClassifierConfig,
    location: Path | None = None,
    *,
    shard_bytes: int = SHARD_BYTES,
    environ: dict[str, str] | None = None,
) -> PreparedImages:
    """The prepared copy of DATA_DIR for ``config``'s preprocessing: reused when valid, else made.

    Raises:
        DataError: as the scan does (no classes, a single class, no readable image).
    """
    location = prepared_dir(data_dir, environ) if location is None else location
    key = preprocessing_key(config.image_size, config.channels)
    fingerprint = dataset_fingerprint(data_dir, environ)
    path = location / key
    if path.exists():
        try:
            copy = open_prepared(path, key, fingerprint, data_dir)
            log.info(
                "using the prepared copy %s: %d records in %d shard(s); nothing to decode",
                path,
                copy.manifest.records,
                len(copy.manifest.shards),
            )
            return copy
        except ValueError as exc:
            log.warning("refusing the prepared copy %s (%s); preparing it again", path, exc)
            _remove(path)
    return make_prepared(
        data_dir, config, location, fingerprint, shard_bytes=shard_bytes, data_limit=data_size_limit(environ)
    )


def open_prepared(path: Path, key: str, fingerprint: str, data_dir: Path) -> PreparedImages:
    """Read and check a prepared copy; every shard is hashed unless the stamp left by the process that
    last hashed these very files (same size, mtime and inode) vouches for it.

    Raises:
        ValueError: naming the first mismatch (manifest, key, dataset, size, count or checksum).
    """
    try:
        text = (path / MANIFEST).read_bytes()
        manifest = PreparedManifest.from_json(text)
    except OSError as exc:
        raise ValueError(f"no readable {MANIFEST}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise ValueError(f"{MANIFEST}: {exc}") from exc
    if manifest.key != key:
        raise ValueError(f"made for preprocessing {manifest.key!r}, expected {key!r}")
    if manifest.pixels != PIXELS:
        raise ValueError(f"pixels made by {manifest.pixels!r}, expected {PIXELS!r}")
    if manifest.dataset != fingerprint:
        raise ValueError(f"made from dataset {manifest.dataset!r}, expected {fingerprint!r}")
    if os.path.isabs(manifest.root) or ".." in Path(manifest.root).parts:
        raise ValueError(f"root {manifest.root!r} is not a folder inside DATA_DIR")
    size = record_bytes(manifest.image_size, manifest.channels)
    stats = {}
    for shard in manifest.shards:
        if shard.bytes != shard.records * size:
            raise ValueError(
                f"{shard.name}: {shard.bytes} bytes listed for {shard.records} records of {size}"
            )
        try:
            st = (path / shard.name).stat()
        except OSError as exc:
            raise ValueError(f"{shard.name}: {exc.strerror or exc}") from exc
        if st.st_size != shard.bytes:
            raise ValueError(f"{shard.name} holds {st.st_size} bytes, the manifest says {shard.bytes}")
        stats[shard.name] = [st.st_size, st.st_mtime_ns, st.st_ino]
    labels, records = manifest.arrays["labels"], manifest.arrays["file_records"]
    classes = len(manifest.class_names)
    if labels.size and (labels.min() < 0 or labels.max() >= classes):
        raise ValueError(f"labels: {sorted(set(labels.tolist()))} for {classes} classes")
    records = records[records >= 0]
    if records.size != manifest.records:
        raise ValueError(f"the file list names {records.size} records, the shards hold {manifest.records}")
    if records.size and (records.max() >= manifest.records or np.bincount(records).min() != 1):
        raise ValueError(f"file_records: expected the record numbers 0 ... {manifest.records - 1}, each once")
    manifest_sha = hashlib.sha256(text).hexdigest()
    stamp = {"manifest": manifest_sha, "shards": stats}
    if _read_stamp(path) != stamp:
        _check_hashes(path, manifest.shards)
        _write_stamp(path, stamp)
    root = data_dir / manifest.root if manifest.root != "." else data_dir
    return PreparedImages(path=path, manifest=manifest, root=root)


def _read_stamp(path: Path) -> dict | None:
    try:
        return json.loads((path / VERIFIED_STAMP).read_text())
    except (OSError, ValueError):
        return None


def _write_stamp(path: Path, stamp: dict) -> None:
    tmp = path / f"{VERIFIED_STAMP}.{secrets.token_hex(4)}"
    try:
        tmp.write_text(json.dumps(stamp))
        os.replace(tmp, path / VERIFIED_STAMP)
    except OSError as exc:
        # Only the next start's hashing is lost.
        log.info("cannot write %s in %s: %s", VERIFIED_STAMP, path, exc.strerror or exc)


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 * 1024 * 1024):
            digest.update(chunk)
    return digest.hexdigest()


def _check_hashes(path: Path, shards: Sequence[Shard]) -> None:
    # hashlib releases the GIL on large buffers: the shards hash in parallel.
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        found = list(pool.map(lambda s: _file_sha256(path / s.name), shards))
    for shard, sha in zip(shards, found, strict=True):
        if sha != shard.sha256:
            raise ValueError(f"{shard.name}: sha256 {sha[:16]}..., the manifest says {shard.sha256[:16]}...")


def _decode(path: str, size: int, channels: int) -> tuple[np.ndarray | None, str | None]:
    """Pixels of one file resized as training resizes, or why TensorFlow could not decode it."""
    import tensorflow as tf

    _count_decode()
    try:
        image = tf.io.decode_image(tf.io.read_file(path), channels=channels, expand_animations=False)
        return resize_image(image, size).numpy(), None
    except (tf.errors.InvalidArgumentError, tf.errors.NotFoundError, tf.errors.UnimplementedError) as exc:
        return None, exc.message.splitlines()[0] if exc.message else type(exc).__name__


def _pillow_loads(path: str) -> str | None:
    """None when Pillow decodes the whole file, else why not (only asked of files TensorFlow refused)."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            image.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        return f"unreadable image ({exc})"
    return None


class _ShardWriter:
    """Appends records to numbered shards of at most ``per_shard`` records, hashing as it writes."""

    def __init__(self, directory: Path, per_shard: int) -> None:
        self.directory = directory
        self.per_shard = per_shard
        self.shards: list[Shard] = []
        self._file: BinaryIO | None = None
        self._digest = hashlib.sha256()
        self._records = 0
        self._bytes = 0
        self.count = 0

    def write(self, record: bytes) -> None:
        if self._file is None:
            self._file = open(self.directory / f"shard-{len(self.shards):05d}.bin", "wb")  # noqa: SIM115
        self._file.write(record)
        self._digest.update(record)
        self._records += 1
        self.count += 1
        self._bytes += len(record)
        if self._records == self.per_shard:
            self.close()

    def close(self) -> None:
        if self._file is None:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        name = Path(self._file.name).name
        self.shards.append(Shard(name, self._records, self._bytes, self._digest.hexdigest()))
        self._file, self._digest, self._records, self._bytes = None, hashlib.sha256(), 0, 0


def _chunks(items: Sequence[int], n: int) -> Iterator[Sequence[int]]:
    for start in range(0, len(items), n):
        yield items[start : start + n]


def data_size_limit(environ: Mapping[str, str] | None = None) -> int | None:
    """Bytes DATA_DIR may hold (``KUBETRAIN_DATA_SIZE_BYTES``, its emptyDir's sizeLimit); ``None``: no limit."""
    env = os.environ if environ is None else environ
    text = env.get(Env.DATA_SIZE_BYTES)
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        log.warning(
            "%s=%r is not a byte count: the prepared copy's room is not checked", Env.DATA_SIZE_BYTES, text
        )
        return None


def _allocated_bytes(root: Path) -> int:
    """Bytes the files under ``root`` take on disk (allocated blocks, as the kubelet's du counts them)."""
    total, folders = 0, [str(root)]
    while folders:
        try:
            entries = list(os.scandir(folders.pop()))
        except OSError:
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                folders.append(entry.path)
            else:
                total += entry.stat(follow_symlinks=False).st_blocks * 512
    return total


def check_room(
    data_dir: Path, location: Path, images: int, size: int, channels: int, limit: int | None
) -> None:
    """Refuse, before decoding anything, a prepared copy that cannot fit in DATA_DIR's ``limit``.

    The kubelet evicts a pod whose /data outgrows its sizeLimit, minutes into the preparation; this
    says at once how much /data needs. A copy kept outside DATA_DIR (``KUBETRAIN_PREPARED_DIR``) is
    not checked.

    Raises:
        DataError: naming the copy's size, what /data holds and the ``data_size`` to set.
    """
    if limit is None or not location.resolve().is_relative_to(data_dir.resolve()):
        return
    needed = images * record_bytes(size, channels)
    used = _allocated_bytes(data_dir)
    if used + needed <= limit:
        return
    gib = 1 << 30
    raise DataError(
        f"the prepared copy of {images:,} images at {size} px needs {needed / gib:.1f} GiB in {data_dir}, "
        f"which already holds {used / gib:.1f} GiB of the {limit / gib:.1f} GiB it may: set the DAG's "
        f"data_size to at least {-(-(used + needed) // gib) + 1}Gi (made once per dataset version, the copy "
        "is then in S3 and later runs size /data for it)"
    )


def make_prepared(
    data_dir: Path,
    config: ClassifierConfig,
    location: Path,
    fingerprint: str,
    *,
    shard_bytes: int = SHARD_BYTES,
    data_limit: int | None = None,
) -> PreparedImages:
    """Scan DATA_DIR, decode each image once, and publish the copy at ``location/<key>`` atomically.

    Memory holds one chunk of decoded images (a few per worker thread), whatever the dataset's size.

    Raises:
        DataError: as the scan does (no classes, a single class, no readable image), or when the copy
            cannot fit in ``data_limit`` bytes of DATA_DIR (:func:`check_room`).
    """
    size, channels = config.image_size, config.channels
    key = preprocessing_key(size, channels)
    folder: ImageFolder = scan_image_folder(data_dir, config.verify_workers)
    check_room(data_dir, location, len(folder.files), size, channels, data_limit)
    try:
        location.mkdir(parents=True, exist_ok=True)
        tmp = location / f".tmp-{key}-{secrets.token_hex(4)}"
        tmp.mkdir()
    except OSError as exc:
        # DATA_DIR mounted read-only (a run outside kubetrain's pods): the copy still spares the second decode
        # of every epoch, but no later pod finds it
        fallback = Path(tempfile.gettempdir()) / "kubetrain-prepared"
        log.warning(
            "cannot write the prepared copy under %s (%s): making it under %s, where no later run finds it; "
            "set %s to a writable directory that outlives the run",
            location,
            exc.strerror or exc,
            fallback,
            Env.PREPARED_DIR,
        )
        location = fallback
        location.mkdir(parents=True, exist_ok=True)
        tmp = location / f".tmp-{key}-{secrets.token_hex(4)}"
        tmp.mkdir()
    try:
        return _write(folder, data_dir, key, fingerprint, tmp, location, config, shard_bytes)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write(
    folder: ImageFolder,
    data_dir: Path,
    key: str,
    fingerprint: str,
    tmp: Path,
    location: Path,
    config: ClassifierConfig,
    shard_bytes: int,
) -> PreparedImages:
    size, channels = config.image_size, config.channels
    per_record = record_bytes(size, channels)
    writer = _ShardWriter(tmp, max(1, shard_bytes // per_record))
    records = [-1] * len(folder.files)
    undecodable: list[list[str]] = []
    skipped = [list(s) for s in folder.skipped]
    bad: set[int] = set()
    order = np.random.default_rng(WRITE_ORDER_SEED).permutation(len(folder.files)).tolist()
    workers = config.verify_workers
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for chunk in _chunks(order, workers * 4):
            decoded = pool.map(lambda i: _decode(folder.files[i][0], size, channels), chunk)
            for index, (pixels, problem) in zip(chunk, decoded, strict=True):
                path, label = folder.files[index]
                if pixels is None:
                    rel = os.path.relpath(path, folder.root)
                    why = _pillow_loads(path)
                    if why is None:
                        undecodable.append([rel, f"TensorFlow: {problem}"])
                    else:
                        skipped.append([rel, why])
                        bad.add(index)
                    continue
                records[index] = writer.count
                header = np.array([writer.count, label], dtype="<i4").tobytes()
                writer.write(header + pixels.tobytes())
    writer.close()
    root = os.path.relpath(folder.root, data_dir)
    kept = [i for i in range(len(folder.files)) if i not in bad]
    files = [os.path.relpath(folder.files[i][0], folder.root) for i in kept]
    file_labels = [folder.files[i][1] for i in kept]
    labels = set(file_labels)
    class_names = folder.class_names
    if len(labels) < len(class_names):
        # Files Pillow could not fully read emptied a class: the scan's rules apply again.
        raise DataError(
            f"classes without a readable image in DATA_DIR {str(data_dir)!r}: "
            + ", ".join(n for i, n in enumerate(class_names) if i not in labels)
        )
    manifest = PreparedManifest(
        dataset=fingerprint,
        key=key,
        image_size=size,
        channels=channels,
        class_names=class_names,
        files=files,
        labels=file_labels,
        file_records=[records[i] for i in kept],
        shards=writer.shards,
        skipped=skipped,
        undecodable=undecodable,
        root=root,
    )
    (tmp / MANIFEST).write_text(manifest.to_json())
    final = location / key
    _publish(tmp, final)
    if skipped:
        log.warning(
            "skipped %d file(s) that are not readable images: %s%s",
            len(skipped),
            "; ".join(f"{path}: {why}" for path, why in skipped[:10]),
            " ..." if len(skipped) > 10 else "",
        )
    log.info(
        "prepared %d images (%d px, %d channel(s)) into %d shard(s) at %s; %d left out",
        manifest.records,
        size,
        channels,
        len(writer.shards),
        final,
        len(skipped) + len(undecodable),
    )
    copy = open_prepared(final, key, fingerprint, data_dir)
    copy.made = True
    return copy


def _remove(path: Path) -> None:
    """Take a refused copy out of the way at once (a rename), then delete it."""
    aside = path.with_name(f".refused-{path.name}-{secrets.token_hex(4)}")
    try:
        os.rename(path, aside)
    except OSError:
        return  # another process took it away first
    shutil.rmtree(aside, ignore_errors=True)


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished copy into place; a copy another process published first is kept instead.

    Preparation is deterministic (a fixed write order, the same decoder), so the two hold the same bytes.
    """
    try:
        os.rename(tmp, final)
    except OSError as exc:
        if not final.exists():
            raise DataError(
                f"cannot publish the prepared copy at {str(final)!r}: {exc.strerror or exc}"
            ) from exc
        log.info("another process published the prepared copy %s first; using it", final)
