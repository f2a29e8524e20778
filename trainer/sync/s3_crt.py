"""The S3 client's uploads and downloads through the AWS Common Runtime (awscrt).

:class:`CrtTransfers` is the half of :class:`trainer.sync.s3.S3` that moves object data: the
single PUT, the multipart calls and the whole-object GET, each one CRT request followed by a
:class:`CrtHandle`. The other half (:mod:`trainer.sync.s3`) builds the CRT clients, finds each
bucket's region, and sends the small requests (HEAD, listings, manifests).
"""

from __future__ import annotations

import base64
import hashlib
import io
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from kubetrain_contract.s3uri import S3Uri
from trainer.sync.errors import ChecksumMismatch, S3RequestError, SyncError, error_code, xml_text

S3_XMLNS = "http://s3.amazonaws.com/doc/2006-03-01/"


class CrtTransfers:
    """The CRT requests of :class:`trainer.sync.s3.S3`: one-shot PUTs, multipart uploads, downloads.

    A mixin: it relies on the client half for ``_crt_client(region)``, ``_address(bucket, key,
    region)``, ``_payload_signing(region, sha256)``, ``bucket_region(bucket)`` and
    ``_crt_call(...)`` (the bounded, retried plain request built on ``_crt_request``).
    """

    if TYPE_CHECKING:  # the client half's methods this half calls (trainer.sync.s3.S3)

        def _crt_client(self, region: str | None = None) -> Any: ...

        def _address(self, bucket: str, key: str, region: str) -> tuple[str, str]: ...

        def _payload_signing(self, region: str, sha256_hex: str) -> Any: ...

        def bucket_region(self, bucket: str) -> str: ...

        def _crt_call(
            self,
            method: str,
            bucket: str,
            key: str,
            extra: list[tuple[str, str]],
            query: str = "",
            *,
            body: bytes = b"",
            operation: str = "",
            payload_sha256: str | None = None,
        ) -> tuple[int, dict[str, str], bytes]: ...

    def _crt_request(
        self,
        method: str,
        bucket: str,
        key: str,
        extra: list[tuple[str, str]],
        query: str,
        *,
        region: str,
        operation: str,
        raise_errors: bool = True,
        body: bytes = b"",
        timeout: float | None = None,
        payload_sha256: str | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        import io

        from awscrt.http import HttpHeaders, HttpRequest
        from awscrt.s3 import S3RequestType

        crt = self._crt_client(region)
        host, path = self._address(bucket, key, region)
        got: dict = {"status": 0, "headers": {}}
        received = bytearray()

        def on_headers(status_code, headers, **_kwargs) -> None:
            got["status"], got["headers"] = status_code, {k.lower(): v for k, v in headers}

        def on_body(chunk, offset, **_kwargs) -> None:
            received[offset : offset + len(chunk)] = chunk

        handle = CrtHandle(S3Uri(bucket, key), None, lambda c, o: None)
        handle.sent = io.BytesIO(body) if body else None
        handle.request = crt.make_request(
            type=S3RequestType.DEFAULT,
            request=HttpRequest(
                method,
                f"{path}?{query}" if query else path,
                HttpHeaders([("host", host), ("content-length", str(len(body))), *extra]),
                handle.sent,
            ),
            operation_name=operation,
            signing_config=self._payload_signing(region, payload_sha256) if payload_sha256 else None,
            on_headers=on_headers,
            on_body=on_body,
            on_done=handle.done,
        )
        if not raise_errors:
            try:
                handle.wait()
            except SyncError:
                pass
            if handle.status:
                return handle.status, handle.error_headers, b""
            if handle.error is not None and not isinstance(handle.error, S3RequestError):
                raise handle.error
            return got["status"], got["headers"], bytes(received)
        try:
            handle.wait(timeout)
        except TimeoutError:
            handle.cancel()
            raise TimeoutError(f"{handle.uri}: no answer to {operation} within {timeout:.0f}s") from None
        return got["status"], got["headers"], bytes(received)

    def put_bytes(
        self,
        bucket: str,
        key: str,
        data: bytes,
        *,
        content_md5: str | None = None,
        metadata: dict[str, str] | None = None,
        content_type: str | None = None,
    ) -> dict[str, str]:
        """Upload a small object in one PUT through the CRT; the response headers, lower-case names.

        About a tenth of the client CPU of botocore's ``put_object`` per request, which is what a
        checkpoint of many small files costs. The store refuses a body damaged on the way
        (``Content-MD5``, 400 BadDigest). The CRT has no read timeout: the wait is bounded here
        instead, by ``read_timeout`` plus a second per MiB, after which the request is cancelled.

        Args:
            bucket: bucket name.
            key: object key.
            data: the whole content.
            content_md5: the base64 MD5 of ``data`` (computed when not given).
            metadata: user metadata (``x-amz-meta-<name>``).
            content_type: the object's ``Content-Type``.

        Raises:
            S3RequestError: an HTTP error after the engine's retries.
            SyncError: no answer within the bound, or a connection that kept failing.
        """
        if content_md5 is None:
            content_md5 = base64.b64encode(hashlib.md5(data).digest()).decode()
        headers = [
            ("content-md5", content_md5),
            *((("content-type", content_type),) if content_type else ()),
            *((f"x-amz-meta-{name}", value) for name, value in (metadata or {}).items()),
        ]
        return self._crt_call("PUT", bucket, key, headers, body=data, operation="PutObject")[1]

    # -- multipart uploads, through the CRT's plain requests (the sidecar's large files) -----

    def create_multipart_upload(
        self, bucket: str, key: str, metadata: dict[str, str], *, part_checksums: bool = False
    ) -> str:
        """Start a multipart upload; its UploadId.

        With ``part_checksums``, each part is to be sent with its CRC32C
        (``x-amz-checksum-algorithm: CRC32C``, a COMPOSITE checksum): ``upload_part`` with
        ``crc32c`` and ``complete_multipart_upload`` with ``crc32cs``.

        Raises:
            S3RequestError, SyncError: as ``put_bytes``.
        """
        headers = [(f"x-amz-meta-{name}", value) for name, value in metadata.items()]
        if part_checksums:
            headers.append(("x-amz-checksum-algorithm", "CRC32C"))
        _, _, body = self._crt_call(
            "POST", bucket, key, headers, "uploads", operation="CreateMultipartUpload"
        )
        upload_id = xml_text(body, "UploadId")
        if not upload_id:
            raise SyncError(f"s3://{bucket}/{key}: CreateMultipartUpload answered without an UploadId")
        return upload_id

    def upload_part(
        self, bucket: str, key: str, upload_id: str, number: int, data: bytes, *, crc32c: int | None = None
    ) -> str:
        """Send one part; its ETag, with its quotes.

        The store refuses a part damaged on the way: with ``crc32c`` (the part's CRC32C, for an
        upload started with ``part_checksums``) by that checksum (``x-amz-checksum-crc32c``, a
        signed header; the body itself is sent as ``UNSIGNED-PAYLOAD``), as the AWS SDKs send
        parts; without, by the part's SHA-256, which the signature covers
        (``x-amz-content-sha256``, as botocore signs a body over plain HTTP). A CRC32C the
        caller has costs nothing more; a SHA-256 costs 0.5 to 2.5 CPU-seconds a GB, on CPUs
        without SHA extensions the most (bench/notes/transfer-profile.md, "Sixth round").

        Raises:
            S3RequestError, SyncError: as ``put_bytes``.
        """
        query = f"partNumber={number}&uploadId={quote(upload_id, safe='')}"
        _, headers, _ = self._crt_call(
            "PUT",
            bucket,
            key,
            [("x-amz-checksum-crc32c", b64_crc32c(crc32c))] if crc32c is not None else [],
            query,
            body=data,
            operation="UploadPart",
            payload_sha256=None if crc32c is not None else hashlib.sha256(data).hexdigest(),
        )
        return headers.get("etag", "")

    def complete_multipart_upload(
        self, bucket: str, key: str, upload_id: str, etags: list[str], *, crc32cs: list[int] | None = None
    ) -> None:
        """Join the parts, numbered from 1 in the order of ``etags`` (with ``crc32cs``, each part's CRC32C).

        S3 may answer 200 and then an error document (the join failed after the answer began):
        that is raised as the error it names, as botocore does.

        Raises:
            S3RequestError, SyncError: as ``put_bytes``.
        """
        import xml.etree.ElementTree as ET

        root = ET.Element("CompleteMultipartUpload", xmlns=S3_XMLNS)
        for number, etag in enumerate(etags, start=1):
            part = ET.SubElement(root, "Part")
            ET.SubElement(part, "PartNumber").text = str(number)
            ET.SubElement(part, "ETag").text = etag
            if crc32cs is not None:
                ET.SubElement(part, "ChecksumCRC32C").text = b64_crc32c(crc32cs[number - 1])
        _, _, body = self._crt_call(
            "POST",
            bucket,
            key,
            [("content-type", "application/xml")],
            f"uploadId={quote(upload_id, safe='')}",
            body=ET.tostring(root),
            operation="CompleteMultipartUpload",
        )
        code, message = error_code(body)
        if code:
            raise S3RequestError(S3Uri(bucket, key), 200, code, message)

    def abort_multipart_upload(self, bucket: str, key: str, upload_id: str) -> None:
        """Abort a multipart upload, so that its parts are no longer stored.

        Raises:
            S3RequestError, SyncError: as ``put_bytes``.
        """
        self._crt_call(
            "DELETE",
            bucket,
            key,
            [],
            f"uploadId={quote(upload_id, safe='')}",
            operation="AbortMultipartUpload",
        )

    def get_object(
        self,
        bucket: str,
        key: str,
        *,
        if_match: str | None = None,
        checksum_mode: bool = False,
        expected_checksum: tuple[str, str] | None = None,
        expected_is: str | None = None,
        on_headers: Callable[[int, dict[str, str]], None] | None = None,
        on_body: Callable[[memoryview, int], None] | None = None,
        to_file: str | None = None,
        direct_io: bool = True,
        on_progress: Callable[[int], None] | None = None,
        on_finished: Callable[[], None] | None = None,
    ):
        """Start a download of a whole object; returns a handle with ``wait()`` and ``cancel()``.

        The body arrives in object order as ``on_body(chunk, offset)``, in ranged GETs of
        ``PART_SIZE`` that the engine retries and sends in parallel; every request carries
        ``If-Match`` (the engine adds the first response's ETag to the later ranges itself).

        Args:
            bucket: bucket name.
            key: object key.
            if_match: ETag the object must still have (a changed object fails with 412).
            checksum_mode: ask for the object's stored checksum (``x-amz-checksum-*``).
            expected_checksum: the whole object's checksum (algorithm, base64), from a HEAD: the
                engine checks the bytes against it as they arrive, across all ranges, and the
                download fails with ``ChecksumMismatch`` if they differ. Meant for a large object
                written by the engine (``to_file``): its body never passes through Python.
            expected_is: what the expected checksum is, as a mismatch names it (default: "the
                store's checksum <value>").
            on_headers: called with the status and the (lower-cased) headers of the first
                response; a ``SyncError`` it raises ends the download.
            on_body: called with each piece of the body and its offset in the object; a
                ``SyncError`` it raises ends the download.
            to_file: instead of ``on_body``, the engine writes the object into this file itself
                (no copy of the body through Python: about half the client CPU of a large object).
            direct_io: with ``to_file``, write past the page cache: cheaper for a large object;
                a small one costs less through the cache, where the caller may read it back.
            on_progress: with ``to_file``, called with the number of bytes each time some arrive.
            on_finished: called (in the engine's thread) once the download ended, whatever its
                outcome, when ``wait()`` no longer blocks.
        """
        from awscrt.http import HttpHeaders, HttpRequest
        from awscrt.s3 import S3ChecksumAlgorithm, S3ChecksumConfig, S3FileIoOptions, S3RequestType

        region = self.bucket_region(bucket)
        crt = self._crt_client(region)
        host, path = self._address(bucket, key, region)
        headers = [("host", host), ("content-length", "0")]
        # written as it arrives, with direct I/O where the file system has it (the CRT falls back
        # where it has not): the page cache's copy and write-back cost more than the download
        fio = S3FileIoOptions(should_stream=True, direct_io=True) if to_file and direct_io else None
        if if_match:
            headers.append(("if-match", if_match))
        if checksum_mode:
            headers.append(("x-amz-checksum-mode", "ENABLED"))
        checksum_config = None
        if expected_checksum:
            algorithm, value = expected_checksum
            checksum_config = S3ChecksumConfig(
                expected_checksum=value, expected_checksum_algorithm=S3ChecksumAlgorithm[algorithm.upper()]
            )
        handle = CrtHandle(
            S3Uri(bucket, key), on_headers, on_body, on_finished, expected_checksum, expected_is
        )
        handle.request = crt.make_request(
            type=S3RequestType.GET_OBJECT,
            request=HttpRequest("GET", path, HttpHeaders(headers)),
            operation_name="GetObject",
            checksum_config=checksum_config,
            on_headers=handle.headers,
            on_body=handle.body if to_file is None else None,
            recv_filepath=to_file,
            fio_options=fio,
            on_progress=on_progress,
            on_done=handle.done,
        )
        return handle


def b64_crc32c(value: int) -> str:
    """A CRC32C as S3 writes it: the 4 big-endian bytes in base64."""
    return base64.b64encode(value.to_bytes(4, "big")).decode()


class CrtHandle:
    """One CRT request: keeps the first error a callback raised, and the outcome.

    The CRT completes the request's future before it calls ``done``, which records the
    error: ``wait`` and ``on_finished`` therefore follow ``done``, not the future.
    """

    def __init__(
        self,
        uri: S3Uri,
        on_headers,
        on_body,
        on_finished: Callable[[], None] | None = None,
        expected_checksum: tuple[str, str] | None = None,
        expected_is: str | None = None,
    ) -> None:
        self.uri = uri
        self.expected_checksum = expected_checksum
        self.expected_is = expected_is or (
            f"the store's checksum {expected_checksum[1]}" if expected_checksum else ""
        )
        self._on_headers, self._on_body = on_headers, on_body
        self._on_finished = on_finished
        # held until the request ends: a plain lock costs a tenth of an Event (a Condition and
        # its lock), which showed in stage-in's profile at one download per small object
        self._running = threading.Lock()
        self._running.acquire()
        self.error: BaseException | None = None
        self.request = None
        self.sent: io.BytesIO | None = None  # the body a request sends, closed as it ends
        self._seen_headers = False
        self.status = 0  # of a failed response
        self.error_headers: dict[str, str] = {}

    def headers(self, status_code: int, headers: list[tuple[str, str]], **_kwargs) -> None:
        if self._seen_headers or self.error is not None or self._on_headers is None or status_code >= 300:
            return
        self._seen_headers = True
        try:
            self._on_headers(status_code, {k.lower(): v for k, v in headers})
        except BaseException as exc:  # noqa: BLE001 - kept, then raised by wait()
            self._fail(exc)

    def body(self, chunk: bytes, offset: int, **_kwargs) -> None:
        if self.error is not None:
            return
        try:
            self._on_body(memoryview(chunk), offset)
        except BaseException as exc:  # noqa: BLE001 - kept, then raised by wait()
            self._fail(exc)

    def done(
        self,
        error=None,
        status_code=None,
        error_body=None,
        error_headers=None,
        did_validate_checksum=False,
        **_kwargs,
    ) -> None:
        try:
            if error is not None and status_code:
                self.status = status_code
                self.error_headers = {k.lower(): v for k, v in error_headers or []}
            if error is not None and self.error is None:
                # the engine names the last response's status (200) with a checksum mismatch
                if (
                    getattr(error, "name", "") == "AWS_ERROR_S3_RESPONSE_CHECKSUM_MISMATCH"
                    and self.expected_checksum
                ):
                    self.error = ChecksumMismatch(
                        f"{self.uri}: {self.expected_checksum[0]} mismatch: the content does not give "
                        f"{self.expected_is}; refused"
                    )
                elif status_code:
                    code, message = error_code(error_body)
                    self.error = S3RequestError(self.uri, status_code, code or "HTTPError", message)
                elif getattr(error, "name", "") == "AWS_ERROR_S3_SLOW_DOWN":  # the CRT names no status
                    self.error = S3RequestError(self.uri, 503, "SlowDown", "the store kept throttling")
                else:
                    self.error = SyncError(f"{self.uri}: {getattr(error, 'name', '')} {error}".strip())
            elif (
                error is None and self.error is None and self.expected_checksum and not did_validate_checksum
            ):
                # the engine skips its check where it cannot make one: never a silent pass
                self.error = SyncError(
                    f"{self.uri}: the engine did not check the content's {self.expected_checksum[0]} "
                    f"against {self.expected_is}"
                )
        finally:
            self._running.release()
            if self._on_finished is not None:
                self._on_finished()

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        if self.request is not None:
            self.request.cancel()

    def cancel(self) -> None:
        if self.request is not None:
            self.request.cancel()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the end of the request.

        Raises:
            S3RequestError: an HTTP error after the engine's retries.
            SyncError: what a callback raised, or a connection that kept failing.
            TimeoutError: not finished within ``timeout`` seconds.
        """
        if not self._running.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError(f"{self.uri}: not finished within {timeout}s")
        self._running.release()  # for any other waiter
        # The request holds its callbacks (this handle's methods) and its body stream: a cycle that only the
        # collector would break, and it runs by object counts, not bytes (56 parts of 16 MiB stayed alive: the
        # sidecar's memory grew with the files it uploaded). Dropping the request frees the body now.
        self.request = None
        # The CRT keeps the request's Python parts (its body stream among them) until its own clean-up on
        # its event-loop thread, which a loaded machine delays; once in CI a part's request was still alive
        # a minute after its call had returned. The request is over: the engine reads no more of the body,
        # and closing the stream lets its bytes go whatever still holds the stream.
        if self.sent is not None:
            self.sent.close()
            self.sent = None
        if self.error is not None:
            raise self.error
