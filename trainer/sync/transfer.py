"""Concurrent, verified downloads into local files.

Small objects are fetched with one GET each, straight into a buffer of their exact size.
Large objects are split into ranged GETs written in place with ``os.pwrite`` into a
preallocated file. Every byte that is checked is hashed once, while it is in memory: ranges
are fed to the hash of their segment in offset order (a segment is the whole object, or one
part of a multipart upload, whose MD5s make up the ETag), so nothing is read back from disk.

What is checked (``verify``):

* always: the size, and that every response is the manifest's version of the object
  (``If-Match`` on each request, and the ETag of each response);
* ``auto`` (the default): the content against the store's own full-object checksum
  (``x-amz-checksum-crc64nvme``/``crc32c``/``crc32``/``sha1``/``sha256``, which S3 keeps
  for new objects) when it keeps one; otherwise the MD5 of the content against the ETag, for
  objects up to ``md5_max_size`` (64 MiB by default): MD5 costs about 1.5 CPU-seconds per GB,
  more than the whole download, so larger objects without a store checksum are checked by
  size and ETag only, as s5cmd and the AWS CLI check them;
* ``md5``: the MD5 of every object against its ETag, whatever its size;
* ``size``: sizes only.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import os
import re
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from trainer.sync.progress import Progress, log
from trainer.sync.s3 import S3, Refused, S3RequestError, S3Uri, SyncError

MiB = 1024 * 1024
RANGE_SIZE = 8 * MiB  # ranges that are hashed are held whole in memory until their turn
# ranges that are not hashed stream to the file through a small buffer, so they can be long:
# fewer requests cost the server less (against s3rver, 64 MiB ranges instead of 8 MiB cut the
# server's CPU for a 1 GiB object by a fifth), as long as every worker still gets a range
MAX_STREAM_RANGE = 64 * MiB
CHUNK_SIZE = 256 * 1024  # streamed ranges pass through a buffer this size, small enough to stay in cache
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
_SINGLE = re.compile(r"[0-9a-f]{32}")
_MULTI = re.compile(r"([0-9a-f]{32})-(\d+)")


def default_workers() -> int:
    """Worker threads: enough requests in flight to hide latency, few enough to stay cheap."""
    return min(32, 8 * (os.cpu_count() or 1))


class _Crc:
    """A CRC with the update/digest interface of a hashlib object."""

    def __init__(self, fn: Callable[[object, int], int], width: int) -> None:
        self.fn, self.width, self.value = fn, width, 0

    def update(self, data: memoryview | bytes) -> None:
        self.value = self.fn(data, self.value)

    def digest(self) -> bytes:
        return self.value.to_bytes(self.width, "big")


def checksum_factory(algorithm: str) -> Callable[[], object] | None:
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
    _remaining: int = 0
    _fd: int = -1
    _etag_is_md5: bool = True
    _md5_allowed: bool = True
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def uri(self) -> S3Uri:
        return S3Uri(self.bucket, self.key)


class _Segment:
    """A hash over ``[start, start + length)`` of an object, fed in offset order.

    Workers hand over their range and go on downloading; whichever worker finds the hash
    idle becomes the hasher and drains every contiguous buffer, outside the lock, so that
    hashing overlaps the downloads. At most ``window`` buffers wait out of order; a worker
    whose range is the next one needed never waits.
    """

    def __init__(self, start: int, length: int, new_hash: Callable[[], object], window: int = 8) -> None:
        self.start, self.length = start, length
        self.hash = new_hash()
        self.next = start
        self.pending: dict[int, tuple[memoryview, bool, Callable[[], None] | None]] = {}
        self.lock = threading.Lock()
        self.hashing = False
        self.slots = threading.Semaphore(window)

    def feed(self, offset: int, data: memoryview, release: Callable[[], None] | None = None) -> None:
        """Hash ``data`` (at ``offset``) in its turn; ``release()`` once it has been hashed."""
        held = False
        while True:
            with self.lock:
                if offset == self.next:
                    break
            if self.slots.acquire(timeout=0.05):
                held = True
                break
        with self.lock:
            self.pending[offset] = (data, held, release)
            if self.hashing:
                return
            self.hashing = True
        while True:
            with self.lock:
                item = self.pending.pop(self.next, None)
                if item is None:
                    self.hashing = False
                    return
            chunk, chunk_held, chunk_release = item
            self.hash.update(chunk)
            with self.lock:
                self.next += len(chunk)
            if chunk_held:
                self.slots.release()
            if chunk_release is not None:
                chunk_release()


class _Buffers:
    """Range buffers used again and again: a fresh 8 MiB buffer costs a page fault per 4 KiB
    and a zero fill, a tenth of the CPU of the whole download."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.free: list[bytearray] = []
        self.lock = threading.Lock()

    def get(self) -> bytearray:
        with self.lock:
            if self.free:
                return self.free.pop()
        return bytearray(self.size)

    def put(self, buf: bytearray) -> None:
        with self.lock:
            self.free.append(buf)


class Downloader:
    """Fetch many objects with a pool of threads; the first failure stops the rest.

    Args:
        s3: the S3 access object.
        workers: concurrent requests.
        progress: counts objects and bytes.
        verify: ``auto``, ``md5`` or ``size`` (see the module docstring); a sha256 given by
            the caller is always checked.
        part_size: the multipart part size of every multipart object, when the caller knows it.
        md5_max_size: in ``auto`` mode, the largest object whose MD5 is computed when the
            store keeps no checksum of it.
    """

    def __init__(
        self,
        s3: S3,
        workers: int,
        progress: Progress,
        *,
        verify: str = "auto",
        part_size: int | None = None,
        md5_max_size: int = DEFAULT_MD5_MAX_SIZE,
    ) -> None:
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify {verify!r} must be one of {', '.join(VERIFY_MODES)}")
        self.s3 = s3
        self.workers = max(1, workers)
        self.progress = progress
        self.verify = verify
        self.part_size = part_size
        self.md5_max_size = md5_max_size
        self._buffers = _Buffers(RANGE_SIZE)
        self._chunks = _Buffers(CHUNK_SIZE)
        self._failed = threading.Event()
        self._made_dirs: set[Path] = set()

    def run(self, items: list[Download]) -> None:
        """Download and verify ``items``; on failure, no partial file is left behind.

        Raises:
            SyncError: naming the object or file that failed.
        """
        with ThreadPoolExecutor(self.workers, thread_name_prefix="get") as pool:
            futures = []
            try:
                for d in items:
                    d._md5_allowed = self.verify == "md5" or (
                        self.verify == "auto" and d.size <= self.md5_max_size
                    )
                if self.verify == "auto":
                    # objects fetched in ranges: the store's checksum comes from a HEAD
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
                for d in items:
                    for task in self._plan(d):
                        futures.append(pool.submit(self._guard, task))
                done, _ = wait(futures, return_when=FIRST_EXCEPTION)
                errors = [f.exception() for f in done if f.exception() is not None]
                if errors:
                    self._failed.set()
                    wait(futures)
                    raise errors[0]
            except BaseException:
                self._failed.set()
                for d in items:
                    if d._fd >= 0:
                        os.close(d._fd)
                        d._fd = -1
                for d in items:
                    d.dest.unlink(missing_ok=True)
                raise

    def _guard(self, task: Callable[[], None]) -> None:
        if not self._failed.is_set():
            task()

    # -- planning ------------------------------------------------------------------------

    def _part_size(self, d: Download) -> tuple[int, bool]:
        """Ask S3 for part 1's length; fall back to inferring it from size and part count."""
        if self.part_size:
            return self.part_size, True
        parts = int(_MULTI.fullmatch(strip_etag(d.etag or "")).group(2))
        try:
            head = self.s3.head(d.bucket, d.key, part_number=1)
            count = int(head.get("x-amz-mp-parts-count", "0"))
            length = int(head.get("content-length", "0"))
            if count == parts and 0 < length <= d.size:
                return length, True
        except Exception as exc:  # any failure here only means "not known"
            log(f"part size of {d.uri} not available from the server ({type(exc).__name__}); inferring it")
        return infer_part_size(d.size, parts), False

    def _plan(self, d: Download) -> list[Callable[[], None]]:
        etag = strip_etag(d.etag) if d.etag else ""
        multi = _MULTI.fullmatch(etag)
        new_hash: Callable[[], object] | None = None
        if d.sha256:
            d.verified_by = "size+sha256"
            new_hash = checksum_factory("sha256")
        elif self.verify == "size":
            d.verified_by = "size"
        elif d.checksum:
            d.verified_by = f"size+etag+{d.checksum[0]}(store)"
            new_hash = checksum_factory(d.checksum[0])
        elif not d._md5_allowed:
            d.verified_by = f"size+etag (no store checksum; no MD5 above {self.md5_max_size:,} bytes)"
        elif _SINGLE.fullmatch(etag):
            d.verified_by = "size+md5(etag)"
            new_hash = hashlib.md5
        elif multi and d.part_size:
            how = "known" if d.part_size_known else "inferred"
            d.verified_by = f"size+multipart-md5(etag, {how} part size {d.part_size})"
            new_hash = hashlib.md5
        else:
            d.verified_by = "size+etag" if etag else "size"
        md5_parts = multi and d.part_size and new_hash is hashlib.md5
        if md5_parts:
            bounds = [(s, min(d.part_size, d.size - s)) for s in range(0, d.size, d.part_size)] or [(0, 0)]
        else:
            bounds = [(0, d.size)]
        d._segments = [_Segment(s, n, new_hash) for s, n in bounds] if new_hash else []
        step = RANGE_SIZE if new_hash else self._stream_range(d.size)
        ranges = [(s + o, min(step, n - o)) for s, n in bounds for o in range(0, max(n, 1), step)]
        if d.dest.parent not in self._made_dirs:
            d.dest.parent.mkdir(parents=True, exist_ok=True)
            self._made_dirs.add(d.dest.parent)
        if len(ranges) == 1 and d.size <= RANGE_SIZE:  # a larger one streams, even as one range
            d._remaining = 1
            return [lambda: self._whole(d)]
        d._remaining = len(ranges)
        d._fd = _open_for_write(d.dest)
        try:
            os.posix_fallocate(d._fd, 0, d.size)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise _write_error(d.dest, exc, d.size) from exc
            os.ftruncate(d._fd, d.size)
        return [lambda s=s, n=n: self._range(d, s, n) for s, n in ranges]

    def _stream_range(self, size: int) -> int:
        """Range length for an object that is not hashed: one range per worker, whole MiB,
        between ``RANGE_SIZE`` and ``MAX_STREAM_RANGE``."""
        share = -(-size // self.workers)
        return min(MAX_STREAM_RANGE, max(RANGE_SIZE, -(-share // MiB) * MiB))

    # -- work ----------------------------------------------------------------------------

    def _headers(self, d: Download, *, whole: bool) -> Callable:
        def check(resp) -> None:
            # a server that ignores If-Match still names the version it sends
            sent = resp.getheader("etag")
            if sent and d.etag and strip_etag(sent) != strip_etag(d.etag):
                raise Refused(
                    f"{d.uri}: ETag mismatch: the server sent ETag {sent}, the manifest says {d.etag} "
                    f"(the object changed since the manifest was written); refused"
                )
            # with SSE-KMS or SSE-C, S3's ETag is not the MD5 of the content
            sse = resp.getheader("x-amz-server-side-encryption", "")
            if sse.startswith("aws:kms") or resp.getheader("x-amz-server-side-encryption-customer-algorithm"):
                d._etag_is_md5 = False
            if whole and self.verify == "auto" and not d.sha256:
                d.checksum = store_checksum({k.lower(): v for k, v in resp.getheaders()})

        return check

    def _store_checksum(self, d: Download) -> tuple[str, str] | None:
        """The store's full-object checksum of a ranged object, from a HEAD (None if it keeps none)."""
        try:
            head = self.s3.head(d.bucket, d.key, checksum_mode=True)
        except S3RequestError as exc:
            raise self._explain(d, exc) from exc
        sent = head.get("etag")
        if sent and d.etag and strip_etag(sent) != strip_etag(d.etag):
            raise SyncError(
                f"{d.uri}: ETag mismatch: the object no longer has the manifest's ETag {d.etag} "
                f"(it changed since the manifest was written); refused"
            )
        return store_checksum(head)

    def _whole(self, d: Download) -> None:
        buf = bytearray(d.size)
        view = memoryview(buf)
        self._get(d, view, 0, whole=True)
        if d.checksum:  # the store keeps a checksum: it replaces the MD5
            d._segments = [_Segment(0, d.size, checksum_factory(d.checksum[0]))]
            d.verified_by = f"size+etag+{d.checksum[0]}(store)"
        if d._segments:
            d._segments[0].feed(0, view)
        try:
            fd = _open_for_write(d.dest)
            try:
                _pwrite_all(fd, view, 0)
            finally:
                os.close(fd)
        except OSError as exc:
            raise _write_error(d.dest, exc, d.size) from exc
        self.progress.add(nbytes=d.size)
        self._finish(d)

    def _range(self, d: Download, start: int, length: int) -> None:
        if not d._segments:
            self._stream(d, start, length)
        else:
            self._hashed_range(d, start, length)
        self.progress.add(nbytes=length)
        with d._lock:
            d._remaining -= 1
            last = d._remaining == 0
        if last:
            os.close(d._fd)
            d._fd = -1
            self._finish(d)

    def _stream(self, d: Download, start: int, length: int) -> None:
        """A range that is not hashed: each chunk goes to the file as soon as it arrives."""
        scratch = self._chunks.get()

        def sink(offset: int, chunk: memoryview) -> None:
            try:
                _pwrite_all(d._fd, chunk, offset)
            except OSError as exc:
                raise _write_error(d.dest, exc, d.size) from exc

        self._get(d, memoryview(scratch), start, whole=False, length=length, sink=sink)
        self._chunks.put(scratch)

    def _hashed_range(self, d: Download, start: int, length: int) -> None:
        """A range held whole until the hash of its segment takes it, in offset order."""
        buf = self._buffers.get()
        view = memoryview(buf)[:length]
        self._get(d, view, start, whole=False)
        try:
            _pwrite_all(d._fd, view, start)
        except OSError as exc:
            raise _write_error(d.dest, exc, d.size) from exc
        for seg in d._segments:
            if seg.start <= start < seg.start + seg.length:
                seg.feed(start, view, release=lambda: self._buffers.put(buf))
                break

    def _get(
        self,
        d: Download,
        view: memoryview,
        start: int,
        *,
        whole: bool,
        length: int | None = None,
        sink: Callable[[int, memoryview], None] | None = None,
    ) -> None:
        try:
            self.s3.get_range(
                d.bucket,
                d.key,
                view,
                start,
                if_match=d.etag if d.etag else None,
                whole=whole,
                checksum_mode=whole and self.verify == "auto" and not d.sha256,
                on_headers=self._headers(d, whole=whole) if d.etag else None,
                length=length,
                sink=sink,
            )
        except S3RequestError as exc:
            if exc.status == 200 and not whole:
                raise SyncError(f"{d.uri} is shorter than the manifest's size {d.size}") from exc
            raise self._explain(d, exc) from exc

    def _explain(self, d: Download, exc: S3RequestError) -> Exception:
        if exc.status == 404:
            return SyncError(f"{d.uri} does not exist ({exc.code}): the manifest lists it")
        if exc.status == 412:
            return SyncError(
                f"{d.uri}: ETag mismatch: the object no longer has the manifest's ETag {d.etag} "
                f"(it changed since the manifest was written); refused"
            )
        if exc.status == 416:
            return SyncError(f"{d.uri} is shorter than the manifest's size {d.size}")
        return exc

    def _finish(self, d: Download) -> None:
        if d.checksum and d._segments:
            algorithm, want = d.checksum
            got = base64.b64encode(d._segments[0].hash.digest()).decode()
            if got != want:
                d.dest.unlink(missing_ok=True)
                raise SyncError(
                    f"{d.uri}: {algorithm} mismatch: the content gives {got}, the store's checksum is "
                    f"{want}; refused"
                )
        elif d.sha256:
            digest = d._segments[0].hash.hexdigest()
            if digest != d.sha256:
                d.dest.unlink(missing_ok=True)
                raise SyncError(f"{d.uri}: sha256 mismatch: got {digest}, expected {d.sha256}; refused")
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
                raise SyncError(
                    f'{d.uri}: ETag mismatch: content hashes to "{got}", expected {d.etag}{hint}; refused'
                )
        self.progress.add(objects=1)


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
