"""Concurrent, verified downloads into local files.

Each object is one download of the AWS Common Runtime's S3 client (``S3.get_object``), which
fetches it in ranged GETs of 8 MiB (in parallel for a large object). An object of one GET (up
to 8 MiB) is written to its file by the engine, and hashed, where it is checked by a hash, from
that file once it has arrived (still in the page cache). A larger one is written by the engine
with direct I/O; where the store keeps its checksum (from a HEAD first), or the caller gave its
sha256, the engine checks the bytes against it as they arrive, across all ranges. One hashed by
an MD5 arrives in object order through Python: each piece is written in place with ``os.pwrite`` and
fed to the hash while it is in memory.
A segment is the whole object, or one part of a multipart upload, whose MD5s make up the ETag.

What is checked (``verify``):

* always: the size, and that every response is the manifest's version of the object
  (``If-Match`` on each request, and the ETag of the response);
* ``auto`` (the default): the content against the store's own full-object checksum
  (``x-amz-checksum-crc64nvme``/``crc32c``/``crc32``/``sha1``/``sha256``, which S3 keeps
  for new objects) when it keeps one; otherwise the MD5 of the content against the ETag, for
  objects up to ``md5_max_size`` (64 MiB by default): MD5 costs about 1.5 CPU-seconds per GB,
  more than the whole download, so larger objects without a store checksum are checked by
  size and ETag only, as s5cmd and the AWS CLI check them. The small objects checked by MD5 are
  hashed together, side by side in a vector register's lanes (``trainer.sync.md5many``);
* ``md5``: the MD5 of every object against its ETag, whatever its size;
* ``size``: sizes only.
"""

from __future__ import annotations

import base64
import errno
import functools
import gc
import hashlib
import os
import queue
import re
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kubetrain_contract.s3uri import S3Uri
from trainer.sync.errors import NotAsListed, Refused, S3RequestError, SyncError
from trainer.sync.md5many import md5_many
from trainer.sync.progress import Progress, log
from trainer.sync.s3 import PART_SIZE, S3

MiB = 1024 * 1024
RANGE_SIZE = PART_SIZE  # an object up to this size is one GET (with its store checksum, if any)
DEFAULT_MD5_MAX_SIZE = 64 * MiB
VERIFY_MODES = ("auto", "md5", "size")
# store checksums, cheapest to compute first
STORE_CHECKSUMS = ("crc64nvme", "crc32c", "crc32", "sha1", "sha256")
# part sizes that common uploaders use, tried in this order when S3 will not say
COMMON_PART_SIZES = [
    8 * MiB,
    5 * MiB,
    16 * MiB,
    50 * MiB,
    64 * MiB,
    100 * MiB,
    128 * MiB,
    256 * MiB,
    512 * MiB,
]
# The checker hashes the small objects it checks by MD5 together (trainer/sync/md5many.py), up to
# this many at once or this many bytes: enough to keep 16 lanes busy (bench/notes/md5many.md).
MD5_BATCH = 64
MD5_BATCH_BYTES = 32 * MiB
_SINGLE = re.compile(r"[0-9a-f]{32}")
_MULTI = re.compile(r"([0-9a-f]{32})-(\d+)")


def default_workers() -> int:
    """Worker threads: enough requests in flight to hide latency, few enough to stay cheap."""
    return min(32, 8 * (os.cpu_count() or 1))


class Hasher(Protocol):
    """What a segment's hash offers: hashlib's objects, :class:`_Crc` and :class:`_Digest`."""

    def update(self, data: Any, /) -> None: ...

    def digest(self) -> bytes: ...

    def hexdigest(self) -> str: ...


class _Handle(Protocol):
    """A transfer in flight: a CRT request's handle or :class:`_EmptyObject`."""

    def cancel(self) -> None: ...

    def wait(self) -> Any: ...


class _Crc:
    """A CRC with the update/digest interface of a hashlib object."""

    def __init__(self, fn: Callable[[Any, int], int], width: int) -> None:
        self.fn, self.width, self.value = fn, width, 0

    def update(self, data: memoryview | bytes) -> None:
        self.value = self.fn(data, self.value)

    def digest(self) -> bytes:
        return self.value.to_bytes(self.width, "big")

    def hexdigest(self) -> str:
        return self.digest().hex()


def checksum_factory(algorithm: str) -> Callable[[], Hasher] | None:
    """A constructor of the hash for a store checksum algorithm; ``None`` if not available here.

    CRC32C and CRC64NVME come from awscrt (hardware-accelerated); CRC32 from zlib.
    """
    if algorithm == "crc32":
        return lambda: _Crc(zlib.crc32, 4)
    if algorithm in ("crc32c", "crc64nvme"):
        try:
            from awscrt import checksums
        except ImportError:
            return None
        fn = checksums.crc32c if algorithm == "crc32c" else checksums.crc64nvme
        width = 4 if algorithm == "crc32c" else 8
        return lambda: _Crc(fn, width)
    if algorithm in ("sha1", "sha256"):
        return lambda: hashlib.new(algorithm)
    return None


def store_checksum(headers: dict[str, str]) -> tuple[str, str] | None:
    """The usable full-object checksum among response headers (lower-case names), as (algorithm, base64).

    A multipart upload's checksum is usually COMPOSITE (a checksum of the parts' checksums),
    which only its part boundaries can verify: it counts only when the store says
    ``x-amz-checksum-type: FULL_OBJECT``. Without that header, only single-part objects
    (an ETag without ``-N``) count.
    """
    kind = headers.get("x-amz-checksum-type", "").upper()
    if kind and kind != "FULL_OBJECT":
        return None
    if not kind and _MULTI.fullmatch(strip_etag(headers.get("etag", ""))):
        return None
    for algorithm in STORE_CHECKSUMS:
        value = headers.get(f"x-amz-checksum-{algorithm}", "").strip()
        # a composite checksum ends in -<parts>; base64 never holds "-"
        if value and "-" not in value and checksum_factory(algorithm) is not None:
            return algorithm, value
    return None


def strip_etag(etag: str) -> str:
    """An ETag without its quotes, lower-cased."""
    return etag.strip().strip('"').lower()


def infer_part_size(size: int, parts: int) -> int:
    """The part size a multipart upload of ``size`` bytes in ``parts`` parts most likely used.

    The common sizes come first; otherwise the smallest whole number of MiB that fits.
    """
    if parts <= 1:
        return max(size, 1)

    def fits(p: int) -> bool:
        return (parts - 1) * p < size <= parts * p

    for p in COMMON_PART_SIZES:
        if fits(p):
            return p
    p = -(-size // parts)
    p = -(-p // MiB) * MiB
    return p if fits(p) else -(-size // parts)


@dataclass
class Download:
    """One object to fetch and verify.

    Exactly one of ``etag`` and ``sha256`` says how to verify the bytes; ``size`` is always
    checked. ``part_size`` is the multipart part size when the ETag has a ``-N`` suffix;
    ``checksum`` the store's full-object checksum (algorithm, base64), when it keeps one.
    """

    bucket: str
    key: str
    size: int
    dest: Path
    etag: str | None = None
    sha256: str | None = None
    part_size: int | None = None
    part_size_known: bool = True
    checksum: tuple[str, str] | None = None
    verified_by: str = ""
    digest: str = ""  # md5 (single-part ETag) or sha256 of the whole object, when computed
    _segments: list[_Segment] = field(default_factory=list, repr=False)
    _fd: int = -1
    _next: int = 0
    _to_file: bool = False  # nothing to hash in Python as it arrives: the engine writes the file itself
    _engine_checks: bool = False  # a whole object the engine writes, hashed from its file afterwards
    _file_hash: Callable[[], Hasher] | None = None  # its hash, planned (a store checksum found later wins)
    _expected: tuple[str, str] | None = None  # a large object's store checksum, checked by the engine
    _etag_is_md5: bool = True
    _md5_allowed: bool = True

    @property
    def uri(self) -> S3Uri:
        return S3Uri(self.bucket, self.key)


class _Segment:
    """A hash over ``[start, start + length)`` of an object; the body arrives in offset order."""

    def __init__(self, start: int, length: int, new_hash: Callable[[], Hasher]) -> None:
        self.start, self.length = start, length
        self.hash = new_hash()


class _Digest:
    """A digest computed elsewhere (``md5_many``), where a segment's hash object is asked for it."""

    def __init__(self, digest: bytes) -> None:
        self._digest = digest

    def update(self, data: Any, /) -> None:
        raise TypeError("a digest computed elsewhere takes no data")

    def digest(self) -> bytes:
        return self._digest

    def hexdigest(self) -> str:
        return self._digest.hex()


@dataclass
class Downloader:
    """Fetch many objects, ``workers`` at a time; the first failure stops the rest.

    Args:
        s3: the S3 access object.
        workers: objects in flight at once (the engine adds ranged GETs within large ones).
        progress: counts objects and bytes.
        verify: ``auto``, ``md5`` or ``size`` (see the module docstring); a sha256 given by
            the caller is always checked.
        part_size: the multipart part size of every multipart object, when the caller knows it.
        md5_max_size: in ``auto`` mode, the largest object whose MD5 is computed when the
            store keeps no checksum of it.
    """

    s3: S3
    workers: int
    progress: Progress
    verify: str = field(default="auto", kw_only=True)
    part_size: int | None = field(default=None, kw_only=True)
    md5_max_size: int = field(default=DEFAULT_MD5_MAX_SIZE, kw_only=True)
    _made_dirs: set[str] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"verify {self.verify!r} must be one of {', '.join(VERIFY_MODES)}")
        self.workers = max(1, self.workers)

    def run(self, items: list[Download]) -> None:
        """Download and verify ``items``; on failure, no partial file is left behind.

        The engine's completions come back through one queue: this thread starts a download
        whenever one of the ``workers`` slots is free and finishes (checks) each download that
        the queue hands back, so nothing is polled and no lock is taken per object.

        Raises:
            SyncError: naming the object or file that failed.
        """
        done: queue.SimpleQueue = queue.SimpleQueue()
        running: dict[int, tuple[Download, _Handle]] = {}
        # A small object's check reads its file back and hashes it: done by one more thread (the
        # read and the hash let go of the GIL), so this one goes on starting downloads meanwhile.
        checker = _Checker(self._finish, self._finish_md5, done) if self.verify == "auto" else None

        def next_event() -> None:
            event = done.get()
            if type(event) is not int:  # the checker's first failure
                raise event
            d, handle = running.pop(event)
            if checker is not None and d._engine_checks:
                checker.check(d, handle)
            else:
                self._finish(d, handle)

        # what exists now (modules, classes, the manifest) lives to the end: keep the collector
        # from walking it again every few thousand objects (gc_collect showed in the profile)
        gc.freeze()
        try:
            for d in items:
                d._md5_allowed = self.verify == "md5" or (
                    self.verify == "auto" and d.size <= self.md5_max_size
                )
            self._plan_ranged(items)
            for i, d in enumerate(items):
                while len(running) >= self.workers:
                    next_event()
                self._plan(d)
                running[i] = (d, self._start(d, i, done) if d.size else _EmptyObject(self, d, i, done))
            while running:
                next_event()
            if checker is not None:
                checker.finish()
        except BaseException:
            if checker is not None:  # no check may still read a file about to be removed
                checker.finish(cancel=True)
            for _, handle in running.values():
                handle.cancel()
            for _, handle in running.values():
                try:
                    handle.wait()
                except BaseException:  # noqa: BLE001 - the first failure is the one raised
                    pass
            for d in items:
                if d._fd >= 0:
                    os.close(d._fd)
                    d._fd = -1
                d.dest.unlink(missing_ok=True)
            raise

    # -- planning ------------------------------------------------------------------------

    def _plan_ranged(self, items: list[Download]) -> None:
        """HEADs that objects fetched in several ranges need: their store checksum, or their part size."""
        with ThreadPoolExecutor(min(self.workers, 16), thread_name_prefix="head") as pool:
            if self.verify == "auto":
                ranged = [d for d in items if d.etag and not d.sha256 and d.size > RANGE_SIZE]
                for d, checksum in zip(ranged, pool.map(self._store_checksum, ranged), strict=True):
                    d.checksum = checksum
            multipart = [
                d
                for d in items
                if d.etag
                and _MULTI.fullmatch(strip_etag(d.etag))
                and d._md5_allowed
                and not d.checksum
                and self.verify != "size"
            ]
            for d, part_size in zip(multipart, pool.map(self._part_size, multipart), strict=True):
                d.part_size, d.part_size_known = part_size

    def _part_size(self, d: Download) -> tuple[int, bool]:
        """Ask S3 for part 1's length; fall back to inferring it from size and part count."""
        if self.part_size:
            return self.part_size, True
        multi = _MULTI.fullmatch(strip_etag(d.etag or ""))
        assert multi is not None  # only multipart ETags are planned here
        parts = int(multi.group(2))
        try:
            head = self.s3.head(d.bucket, d.key, part_number=1)
            count = int(head.get("x-amz-mp-parts-count", "0"))
            length = int(head.get("content-length", "0"))
            if count == parts and 0 < length <= d.size:
                return length, True
        except Exception as exc:  # any failure here only means "not known"
            log(f"part size of {d.uri} not available from the server ({type(exc).__name__}); inferring it")
        return infer_part_size(d.size, parts), False

    def _store_checksum(self, d: Download) -> tuple[str, str] | None:
        """The store's full-object checksum of a ranged object, from a HEAD (None if it keeps none)."""
        try:
            head = self.s3.head(d.bucket, d.key, checksum_mode=True)
        except S3RequestError as exc:
            raise self._explain(d, exc) from exc
        sent = head.get("etag")
        if sent and d.etag and strip_etag(sent) != strip_etag(d.etag):
            raise NotAsListed(
                f"{d.uri}: ETag mismatch: the object no longer has the manifest's ETag {d.etag} "
                f"(it changed since the manifest was written); refused"
            )
        return store_checksum(head)

    def _hash_for(self, d: Download) -> Callable[[], Hasher] | None:
        etag = strip_etag(d.etag) if d.etag else ""
        if d.sha256:
            d.verified_by = "size+sha256"
            return checksum_factory("sha256")
        if self.verify == "size":
            d.verified_by = "size"
            return None
        if d.checksum:
            d.verified_by = f"size+etag+{d.checksum[0]}(store)"
            return checksum_factory(d.checksum[0])
        if not d._md5_allowed:
            d.verified_by = f"size+etag (no store checksum; no MD5 above {self.md5_max_size:,} bytes)"
            return None
        if _SINGLE.fullmatch(etag):
            d.verified_by = "size+md5(etag)"
            return hashlib.md5
        if _MULTI.fullmatch(etag) and d.part_size:
            how = "known" if d.part_size_known else "inferred"
            d.verified_by = f"size+multipart-md5(etag, {how} part size {d.part_size})"
            return hashlib.md5
        d.verified_by = "size+etag" if etag else "size"
        return None

    def _plan(self, d: Download) -> None:
        new_hash = self._hash_for(d)
        multi = d.etag and _MULTI.fullmatch(strip_etag(d.etag))
        # A whole object (one GET) whose check is the store's checksum, the MD5 of a single-part
        # ETag, or none is written by the engine itself, and its hash taken from the file
        # afterwards, still in the page cache: measured on 2,000 objects of 20-200 KB
        # (bench/notes/transfer-profile.md), the body's hop through Python and a file opened
        # and closed in this thread per object cost more than reading the file back.
        # (The engine's own checksum validation would ask the store for `x-amz-checksum-mode:
        # enabled` in lower case, which not every S3 server honours, and in its FULL_OBJECT
        # mode sends a HEAD per object first.)
        d._engine_checks = (
            0 < d.size <= RANGE_SIZE
            and not d.sha256
            and self.verify != "md5"
            and (new_hash is None or (new_hash is hashlib.md5 and not multi))
        )
        if d._engine_checks:
            d._file_hash, new_hash = new_hash, None
        # A large object whose store checksum the HEAD found is checked by the engine as it writes
        # the file with direct I/O: its body never passes through Python (about 3 CPU-s a GB less;
        # bench/notes/transfer-profile.md, "Sixth round"). The engine checks the bytes it
        # received against the value given, whatever the ranges' own headers say.
        if d.checksum and d.size > RANGE_SIZE and not d.sha256 and self.verify == "auto":
            d._expected, new_hash = d.checksum, None
        # So is a large object with the caller's sha256 (restore's checkpoints): measured on 1 GiB
        # (bench/notes/transfer-profile.md, "Eighth round"), 1.60 CPU-s against 2.47 through Python.
        elif d.sha256 and d.size > RANGE_SIZE:
            d._expected, new_hash = ("sha256", base64.b64encode(bytes.fromhex(d.sha256)).decode()), None
        if multi and d.part_size and new_hash is hashlib.md5:
            bounds = [(s, min(d.part_size, d.size - s)) for s in range(0, d.size, d.part_size)] or [(0, 0)]
        else:
            bounds = [(0, d.size)]
        d._segments = [_Segment(s, n, new_hash) for s, n in bounds] if new_hash else []
        parent = os.path.dirname(d.dest)  # a str: cheaper to hash than a Path, once per object
        if parent not in self._made_dirs:
            os.makedirs(parent, exist_ok=True)
            self._made_dirs.add(parent)
        d._next = 0
        d._to_file = d._engine_checks or (not d._segments and d.size > RANGE_SIZE)
        if not d._to_file:
            d._fd = _open_for_write(d.dest)

    # -- work ----------------------------------------------------------------------------

    def _start(self, d: Download, index: int, done: queue.SimpleQueue):
        def on_headers(status: int, headers: dict[str, str]) -> None:
            # a server that ignores If-Match still names the version it sends
            sent = headers.get("etag")
            if sent and d.etag and strip_etag(sent) != strip_etag(d.etag):
                raise NotAsListed(
                    f"{d.uri}: ETag mismatch: the server sent ETag {sent}, the manifest says {d.etag} "
                    f"(the object changed since the manifest was written); refused"
                )
            total = _object_size(headers)
            if total is not None and total != d.size:
                raise NotAsListed(
                    f"{d.uri}: the server has {total} bytes where the manifest says {d.size} "
                    f"(object size differs from the manifest); refused"
                )
            # with SSE-KMS or SSE-C, S3's ETag is not the MD5 of the content
            sse = headers.get("x-amz-server-side-encryption", "")
            if sse.startswith("aws:kms") or headers.get("x-amz-server-side-encryption-customer-algorithm"):
                d._etag_is_md5 = False
            if whole and self.verify == "auto" and not d.sha256 and not d.checksum:
                checksum = store_checksum(headers)
                if checksum:  # the store keeps a checksum: it replaces the MD5
                    d.checksum = checksum
                    if not d._to_file:  # else hashed from the file the engine writes
                        factory = checksum_factory(checksum[0])
                        assert factory is not None  # store_checksum names only algorithms it has
                        d._segments = [_Segment(0, d.size, factory)]
                    d.verified_by = f"size+etag+{checksum[0]}(store)"

        def on_body(chunk: memoryview, offset: int) -> None:
            if offset != d._next or offset + len(chunk) > d.size:
                raise SyncError(
                    f"{d.uri}: body piece at offset {offset} out of order or past the size {d.size}"
                )
            try:
                _pwrite_all(d._fd, chunk, offset)
            except OSError as exc:
                raise _write_error(d.dest, exc, d.size) from exc
            for seg in d._segments:
                lo, hi = max(seg.start, offset), min(seg.start + seg.length, offset + len(chunk))
                if lo < hi:
                    seg.hash.update(chunk[lo - offset : hi - offset])
            d._next = offset + len(chunk)
            self.progress.add(nbytes=len(chunk))

        def on_progress(nbytes: int) -> None:
            d._next += nbytes
            self.progress.add(nbytes=nbytes)

        whole = d.size <= RANGE_SIZE
        handle = self.s3.get_object(
            d.bucket,
            d.key,
            if_match=d.etag or None,
            checksum_mode=whole and self.verify == "auto" and not d.sha256,
            expected_checksum=d._expected,
            expected_is=f"the manifest's sha256 {d.sha256}" if d.sha256 and d._expected else None,
            on_headers=on_headers,
            on_body=None if d._to_file else on_body,
            to_file=str(d.dest) if d._to_file else None,
            direct_io=not whole,
            on_progress=on_progress if d._to_file and not whole else None,
            on_finished=lambda: done.put(index),
        )
        return handle

    def _wait(self, d: Download, handle) -> None:
        try:
            handle.wait()
        except S3RequestError as exc:
            raise self._explain(d, exc) from exc
        finally:
            if d._fd >= 0:
                os.close(d._fd)
                d._fd = -1

    @staticmethod
    def md5_from_file(d: Download) -> bool:
        """Whether ``d`` is checked by the MD5 of the file the engine wrote (the checker batches those)."""
        return d._engine_checks and not d.checksum and d._file_hash is hashlib.md5

    def _finish(self, d: Download, handle) -> None:
        self._wait(d, handle)
        if d._to_file:
            # the store's checksum, from the response's headers, else the hash planned for it
            new_hash = checksum_factory(d.checksum[0]) if d._engine_checks and d.checksum else d._file_hash
            try:
                d._next = self._hash_file(d, new_hash) if new_hash else os.stat(d.dest).st_size
            except OSError as exc:
                raise _write_error(d.dest, exc, d.size) from exc
            if d._engine_checks:  # no progress callback per piece: counted once here
                self.progress.add(nbytes=d._next)
        self._check(d)

    def _finish_md5(self, batch: list[tuple[Download, object]]) -> None:
        """Finish downloads checked by the MD5 of their files, hashed together (``md5_many``)."""
        contents = []
        for d, handle in batch:
            self._wait(d, handle)
            try:
                contents.append(_read_file(d.dest, d.size))
            except OSError as exc:
                raise _write_error(d.dest, exc, d.size) from exc
        for (d, _), content, digest in zip(batch, contents, md5_many(contents), strict=True):
            d._next = len(content)
            self.progress.add(nbytes=d._next)
            d._segments = [_Segment(0, d.size, functools.partial(_Digest, digest))]
            self._check(d)

    @staticmethod
    def _hash_file(d: Download, new_hash: Callable[[], Hasher]) -> int:
        """Hash the file the engine wrote (just written: in the page cache) as one segment; its length."""
        seg = _Segment(0, d.size, new_hash)
        fd = os.open(d.dest, os.O_RDONLY | os.O_CLOEXEC)
        length = 0
        try:
            while chunk := os.read(fd, min(d.size + 1, RANGE_SIZE)):  # one read for a small object
                seg.hash.update(chunk)
                length += len(chunk)
        finally:
            os.close(fd)
        d._segments = [seg]
        return length

    def _explain(self, d: Download, exc: S3RequestError) -> Exception:
        if exc.status == 404:
            return NotAsListed(f"{d.uri} does not exist ({exc.code}): the manifest lists it")
        if exc.status == 412:
            return NotAsListed(
                f"{d.uri}: ETag mismatch: the object no longer has the manifest's ETag {d.etag} "
                f"(it changed since the manifest was written); refused"
            )
        if exc.status == 416:
            return SyncError(f"{d.uri} is shorter than the manifest's size {d.size}")
        return exc

    def _check(self, d: Download) -> None:
        if d._next != d.size:
            raise SyncError(f"{d.uri} is shorter than the manifest's size {d.size}: {d._next} bytes arrived")
        if d.checksum and d._segments:
            algorithm, want = d.checksum
            got = base64.b64encode(d._segments[0].hash.digest()).decode()
            if got != want:
                d.dest.unlink(missing_ok=True)
                raise NotAsListed(
                    f"{d.uri}: {algorithm} mismatch: the content gives {got}, the store's checksum is "
                    f"{want}; refused"
                )
        elif d.sha256 and d._expected:
            d.digest = d.sha256
        elif d.sha256:
            digest = d._segments[0].hash.hexdigest()
            if digest != d.sha256:
                d.dest.unlink(missing_ok=True)
                raise NotAsListed(f"{d.uri}: sha256 mismatch: got {digest}, expected {d.sha256}; refused")
            d.digest = digest
        elif d._segments:
            digests = [s.hash.digest() for s in d._segments]
            etag = strip_etag(d.etag or "")
            multi = _MULTI.fullmatch(etag)
            got = (
                f"{hashlib.md5(b''.join(digests)).hexdigest()}-{len(digests)}" if multi else digests[0].hex()
            )
            if not multi:
                d.digest = got
            if not d._etag_is_md5:
                d.verified_by = "size (server-side encryption: ETag is not an MD5)"
            elif got != etag:
                d.dest.unlink(missing_ok=True)
                hint = ""
                if multi and not d.part_size_known:
                    hint = (
                        f" (the part size {d.part_size} was inferred; if the object was uploaded with "
                        f"another part size, pass --part-size or --verify size)"
                    )
                raise NotAsListed(
                    f'{d.uri}: ETag mismatch: content hashes to "{got}", expected {d.etag}{hint}; refused'
                )
        self.progress.add(objects=1)


class _Checker:
    """One thread that finishes (checks) the downloads handed to it.

    It answers the thread that started the downloads only with its first failure (put on that
    thread's queue of completions), not once per object: a queue put, a wake-up and a GIL hand-off
    per object less than a ``ThreadPoolExecutor`` with a result per check (bench/notes/transfer-profile.md).
    Those checked by the MD5 of their files wait until ``MD5_BATCH`` of them (or ``MD5_BATCH_BYTES``)
    or the last have come, and are hashed together; the others are checked as they come.
    """

    def __init__(
        self,
        finish: Callable[[Download, object], None],
        finish_md5: Callable[[list[tuple[Download, object]]], None],
        done: queue.SimpleQueue,
    ) -> None:
        self._finish = finish
        self._finish_md5 = finish_md5
        self._done = done
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="check", daemon=True)
        self._thread.start()

    def check(self, d: Download, handle: object) -> None:
        self._work.put((d, handle))

    def finish(self, cancel: bool = False) -> None:
        """Wait for every check handed over (or, with ``cancel``, only the one under way)."""
        if cancel:
            self._failed = True  # the rest are skipped
        self._work.put(None)
        self._thread.join()
        if not cancel:  # a failure the main thread has not taken from its queue yet
            while not self._done.empty():
                event = self._done.get()
                if type(event) is not int:
                    raise event

    def _run(self) -> None:
        batch: list[tuple[Download, object]] = []
        size = 0
        while (item := self._work.get()) is not None:
            if self._failed:
                continue
            d = item[0]
            if not Downloader.md5_from_file(d):
                self._attempt(self._finish, *item)
                continue
            batch.append(item)
            size += d.size
            if len(batch) >= MD5_BATCH or size >= MD5_BATCH_BYTES:
                self._attempt(self._finish_md5, batch)
                batch, size = [], 0
        if batch and not self._failed:
            self._attempt(self._finish_md5, batch)

    def _attempt(self, finish: Callable[..., None], *args: object) -> None:
        try:
            finish(*args)
        except BaseException as exc:  # noqa: BLE001 - raised by Downloader.run, in its thread
            self._failed = True
            self._done.put(exc)


class _EmptyObject:
    """An empty object: one GET through botocore (a ranged GET, as the CRT sends, gets 416 from S3)."""

    def __init__(self, downloader: Downloader, d: Download, index: int, done: queue.SimpleQueue) -> None:
        self.error: BaseException | None = None
        try:
            s3 = downloader.s3
            if s3.small_calls_on_crt:
                _, headers, data = s3._crt_call(
                    "GET", d.bucket, d.key, [("if-match", d.etag)] if d.etag else []
                )
                sent = headers.get("etag")
            else:
                kwargs = {"Bucket": d.bucket, "Key": d.key, **({"IfMatch": d.etag} if d.etag else {})}
                resp = s3.client.get_object(**kwargs)
                data, sent = resp["Body"].read(), resp.get("ETag")
            if sent and d.etag and strip_etag(sent) != strip_etag(d.etag):
                raise NotAsListed(
                    f"{d.uri}: ETag mismatch: the server sent ETag {sent}, the manifest says {d.etag}; refused"
                )
            if data:
                raise NotAsListed(
                    f"{d.uri}: the server has {len(data)} bytes where the manifest says 0; refused"
                )
            for seg in d._segments:
                seg.hash.update(b"")
        except Exception as exc:  # noqa: BLE001 - raised by wait()
            from trainer.sync.errors import client_error

            self.error = exc if isinstance(exc, SyncError) else client_error(d.uri, exc)
        done.put(index)

    def cancel(self) -> None:
        pass

    def wait(self) -> None:
        if self.error is not None:
            raise self.error


def _object_size(headers: dict[str, str]) -> int | None:
    """The whole object's size from a response: the total of a Content-Range, else the Content-Length."""
    content_range = headers.get("content-range", "")
    if "/" in content_range:
        total = content_range.rpartition("/")[2]
        return int(total) if total.isdigit() else None
    length = headers.get("content-length", "")
    return int(length) if length.isdigit() else None


def _read_file(path: Path, size: int) -> bytes:
    """The file the engine wrote (still in the page cache), up to one byte past ``size``."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        content = os.read(fd, size + 1)  # one read for a whole file
        while len(content) <= size and (more := os.read(fd, size + 1 - len(content))):
            content += more
    finally:
        os.close(fd)
    return content


def _open_for_write(path: Path) -> int:
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise _write_error(path, exc, 0) from exc


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def _write_error(path: Path, exc: OSError, size: int) -> SyncError:
    # Refused: a full or unwritable disk is not a transient S3 error to retry
    if exc.errno == errno.ENOSPC:
        return Refused(f"cannot write {path} ({size:,} bytes): no space left on its file system")
    return Refused(f"cannot write {path}: {exc.strerror or exc}")
