"""S3 access for the transfer tool, on two maintained engines that share one set of credentials.

* ``S3.client``: a botocore client for listings, HEADs and small objects under workload
  identity (its credential chain). Every call has a connect timeout, a read timeout and a
  bounded number of attempts (botocore's standard retries). With keys in the environment
  (``small_calls_on_crt``) those calls go through the CRT's plain requests instead, so that
  a pod never imports botocore (0.34 CPU-seconds: a fifth of a checkpoint's final pass,
  bench/README.md, "transfer"); each is bounded by the same read timeout.
* ``S3.get_object``: object data through the AWS Common Runtime's S3 client (awscrt), built
  for throughput: its event loop, connection pool, SigV4 signing and retries are C, it
  splits a large object into ranged GETs itself and hands the body over in object order,
  so a download costs little more client CPU than s5cmd's (bench/README.md, "transfer").
  ``S3.put_bytes`` and the multipart calls send the sidecar's uploads through it too
  (botocore's per-request CPU, not the bytes, is what a checkpoint of many small files costs).

Both engines sign every header they send (``range``, ``if-match``, ``x-amz-checksum-mode``
included), as AWS S3 requires of ``x-amz-*`` headers.
"""

from __future__ import annotations

import base64
import hashlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote_plus, urlsplit

from kubetrain_contract.pod import Env

# the sidecar's calls: a final pass has seconds, not minutes (trainer/sync/README.md)
CONNECT_TIMEOUT = 5.0
READ_TIMEOUT = 20.0
DEFAULT_ATTEMPTS = 5
# the CRT's ranged GETs: objects up to this size are one request
PART_SIZE = 8 * 1024 * 1024
MiB = 1024 * 1024
S3_XMLNS = "http://s3.amazonaws.com/doc/2006-03-01/"


class SyncError(Exception):
    """A failure with a message meant for the pod log (exit status 1)."""


@dataclass(frozen=True)
class S3Uri:
    """An ``s3://bucket/key`` address."""

    bucket: str
    key: str

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    def join(self, *parts: str) -> S3Uri:
        """Return the URI of ``parts`` below this one, separated by slashes."""
        key = (
            "/".join([self.key.rstrip("/"), *(p.strip("/") for p in parts)]) if self.key else "/".join(parts)
        )
        return S3Uri(self.bucket, key)


def parse_s3_uri(uri: str, what: str = "S3 URI") -> S3Uri:
    """Parse ``s3://bucket/key``.

    Args:
        uri: the text to parse.
        what: how the error message names the value.

    Raises:
        SyncError: ``uri`` is not of the form ``s3://bucket[/key]``.
    """
    if not uri.startswith("s3://") or not uri[5:].split("/", 1)[0]:
        raise SyncError(f"{what} {uri!r} is not an S3 URI: expected s3://<bucket>/<key>")
    bucket, _, key = uri[5:].partition("/")
    return S3Uri(bucket, key)


class Refused(SyncError):
    """A failure that retrying cannot mend: another object than the one asked for, a full disk."""


class NotAsListed(Refused):
    """The object is not the one a manifest lists: gone, another ETag, size or checksum.

    A restore that meets it falls back to an older pass; nothing else tells it apart by message.
    """


class ChecksumMismatch(NotAsListed):
    """The engine found the bytes it received do not give the checksum it was to check them against."""


class S3RequestError(SyncError):
    """An S3 request failed with an HTTP status (after the engine's retries)."""

    def __init__(self, uri: S3Uri, status: int, code: str, message: str = "") -> None:
        self.uri, self.status, self.code = uri, status, code
        super().__init__(f"{uri}: HTTP {status} {code}{': ' + message if message else ''}")


def error_code(body: bytes | None) -> tuple[str, str]:
    """The ``Code`` and ``Message`` of an S3 error document (empty strings when there is none)."""
    import xml.etree.ElementTree as ET  # here: only an error reads it, and a stage-in starts 3 ms sooner

    try:
        root = ET.fromstring(body or b"")
    except ET.ParseError:
        return "", ""
    return root.findtext("Code") or "", root.findtext("Message") or ""


def _xml_text(body: bytes, name: str) -> str:
    """The text of the first element ``name`` (any namespace) of an S3 XML answer; empty if none."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.fromstring(body or b"")
    except ET.ParseError:
        return ""
    for element in root.iter():
        if element.tag.rpartition("}")[2] == name:
            return element.text or ""
    return ""


def _quoted(etag: str) -> str:
    """An ETag in its quotes, as S3 lists it (some servers list it without)."""
    return '"' + etag.strip('"') + '"' if etag else ""


def client_error(uri: S3Uri, exc: Exception) -> SyncError:
    """A botocore exception as a ``SyncError`` naming the URI (``S3RequestError`` for an HTTP status)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        meta = response.get("ResponseMetadata", {})
        error = response.get("Error", {})
        status = int(meta.get("HTTPStatusCode") or 0)
        return S3RequestError(uri, status, error.get("Code", ""), error.get("Message", ""))
    return SyncError(f"{uri}: {exc}")


def target_gbps() -> float:
    """The CRT's throughput target: ``KUBETRAIN_S3_TARGET_GBPS``, else one Gbit/s per core, 1 to 10.

    The CRT sizes its connections and its memory pool from it; a pool larger than the node's
    cores can feed costs page faults for nothing (on 2 cores, 10 Gbit/s took twice the CPU
    of 2 Gbit/s for a 1 GiB object; bench/README.md, "transfer").

    Raises:
        SyncError: the variable is not a number > 0.
    """
    raw = os.environ.get(Env.S3_TARGET_GBPS)
    if not raw:
        return float(min(10, max(1, os.cpu_count() or 1)))
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise SyncError(f"KUBETRAIN_S3_TARGET_GBPS={raw!r} is not valid: expected a number of Gbit/s > 0")
    return value


def max_attempts_from_env() -> int:
    """``AWS_MAX_ATTEMPTS`` (the standard variable), else the tool's default.

    Raises:
        SyncError: the variable is not a whole number >= 1.
    """
    raw = os.environ.get("AWS_MAX_ATTEMPTS")
    if not raw:
        return DEFAULT_ATTEMPTS
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise SyncError(f"AWS_MAX_ATTEMPTS={raw!r} is not valid: expected a whole number >= 1")
    return value


class S3:
    """S3 access from a pod: standard AWS variables or workload identity, never literals.

    Args:
        max_attempts: attempts per request, for transient errors (5xx, 429, resets, timeouts);
            default: the standard ``AWS_MAX_ATTEMPTS`` variable, else 5.
        pool: connections botocore may keep open.
        connect_timeout: seconds to open a connection.
        read_timeout: seconds without data before a botocore request counts as failed; a CRT
            call's whole answer must come within it (plus a second per MiB it sends).
        small_calls_on_crt: send ``get_bytes``, ``head`` and ``list_objects`` through the CRT as
            well, so that a pod with keys in the environment never imports botocore (0.5
            CPU-seconds, a fifth of a small dataset's whole download). The CRT has no read
            timeout: each such call is bounded by ``read_timeout`` here (``_crt_call``).
    """

    def __init__(
        self,
        *,
        max_attempts: int | None = None,
        pool: int = 32,
        connect_timeout: float = CONNECT_TIMEOUT,
        read_timeout: float = READ_TIMEOUT,
        small_calls_on_crt: bool = False,
    ) -> None:
        self.max_attempts = max_attempts or max_attempts_from_env()
        self.small_calls_on_crt = small_calls_on_crt and bool(
            os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY")
        )
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._pool = pool
        self._lock = threading.RLock()  # the CRT client may create the botocore client (workload identity)
        self._client = None
        self._crts: dict[str, object] = {}  # one CRT client per signing region
        self._provider = None
        self._regions: dict[str, str] = {}  # bucket -> its region, as S3 named it
        self._region_lock = threading.Lock()
        self.region = ""
        self._endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")

    # -- botocore --------------------------------------------------------------------------

    @property
    def client(self):
        """botocore's S3 client, created on first use."""
        with self._lock:
            if self._client is None:
                import botocore.config
                import botocore.session

                self._session = botocore.session.get_session()
                config = botocore.config.Config(
                    retries={"mode": "standard", "total_max_attempts": self.max_attempts},
                    max_pool_connections=self._pool,
                    connect_timeout=self.connect_timeout,
                    read_timeout=self.read_timeout,
                    # flexible checksums use aws-chunked bodies that some S3-compatible servers
                    # reject; the tool verifies content itself (ETag, sha256 metadata)
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required",
                    s3={"addressing_style": "path" if self._endpoint else "auto"},
                )
                self._client = self._session.create_client("s3", endpoint_url=self._endpoint, config=config)
            return self._client

    def get_bytes(self, bucket: str, key: str) -> bytes:
        """A small object's whole content (a manifest).

        Raises:
            S3RequestError: an HTTP error such as 404 or 403.
            SyncError: the request kept failing.
        """
        uri = S3Uri(bucket, key)
        if self.small_calls_on_crt:
            return self._crt_call("GET", bucket, key, [])[2]
        from botocore.exceptions import IncompleteReadError, ResponseStreamingError

        # botocore retries a request until its headers arrive, not a body cut short after them
        for attempt in range(1, self.max_attempts + 1):
            try:
                return self.client.get_object(Bucket=bucket, Key=key)["Body"].read()
            except (IncompleteReadError, ResponseStreamingError) as exc:
                if attempt == self.max_attempts:
                    raise SyncError(f"{uri}: the body broke off {attempt} times: {exc}") from exc
            except Exception as exc:
                raise client_error(uri, exc) from exc
        raise AssertionError("not reached")

    def head(
        self, bucket: str, key: str, part_number: int | None = None, *, checksum_mode: bool = False
    ) -> dict[str, str]:
        """The response headers of a HEAD (of one part, with ``part_number``), lower-case names.

        ``checksum_mode`` asks for the object's stored checksum (``x-amz-checksum-*``).

        Raises:
            S3RequestError: an HTTP error such as 404 or 403.
        """
        if self.small_calls_on_crt:
            extra = [("x-amz-checksum-mode", "ENABLED")] if checksum_mode else []
            query = f"partNumber={part_number}" if part_number else ""
            return self._crt_call("HEAD", bucket, key, extra, query)[1]
        kwargs: dict = {"Bucket": bucket, "Key": key}
        if part_number:
            kwargs["PartNumber"] = part_number
        if checksum_mode:
            kwargs["ChecksumMode"] = "ENABLED"
        try:
            resp = self.client.head_object(**kwargs)
        except Exception as exc:
            raise client_error(S3Uri(bucket, key), exc) from exc
        return {k.lower(): v for k, v in resp["ResponseMetadata"]["HTTPHeaders"].items()}

    # -- AWS Common Runtime ----------------------------------------------------------------

    def _crt_client(self, region: str | None = None):
        """The CRT client that signs for ``region`` (default: the configured region)."""
        with self._lock:
            if self._provider is None:
                from awscrt.auth import AwsCredentialsProvider

                key_id, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
                if key_id and secret:
                    self._provider = AwsCredentialsProvider.new_static(
                        key_id, secret, os.environ.get("AWS_SESSION_TOKEN") or None
                    )
                    self.region = (
                        os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
                    )
                else:  # workload identity: botocore's credential chain, refreshed as it expires
                    from s3transfer.crt import BotocoreCRTCredentialsWrapper

                    client = self.client
                    self._provider = BotocoreCRTCredentialsWrapper(
                        self._session.get_credentials()
                    ).to_crt_credentials_provider()
                    self.region = client.meta.region_name or "us-east-1"
                parts = urlsplit(self._endpoint or "https://s3.amazonaws.com")
                self._scheme = parts.scheme
                self._path_prefix = parts.path.rstrip("/")
                self._virtual = not self._endpoint
            region = region or self.region
            if region not in self._crts:
                from awscrt.io import ClientBootstrap, DefaultHostResolver, EventLoopGroup
                from awscrt.s3 import S3Client, S3RequestTlsMode, S3RetryConfig

                tls_options = None
                if self._scheme == "https" and os.environ.get("AWS_CA_BUNDLE"):
                    from awscrt.io import ClientTlsContext, TlsContextOptions

                    tls = TlsContextOptions()
                    tls.override_default_trust_store_from_path(ca_filepath=os.environ["AWS_CA_BUNDLE"])
                    tls_options = ClientTlsContext(tls).new_connection_options()
                elg = EventLoopGroup(min(4, os.cpu_count() or 1))
                self._crts[region] = S3Client(
                    bootstrap=ClientBootstrap(elg, DefaultHostResolver(elg)),
                    region=region,
                    credential_provider=self._provider,
                    tls_mode=S3RequestTlsMode.ENABLED
                    if self._scheme == "https"
                    else S3RequestTlsMode.DISABLED,
                    tls_connection_options=tls_options,
                    part_size=PART_SIZE,
                    throughput_target_gbps=target_gbps(),
                    retry_config=S3RetryConfig(max_retries=self.max_attempts - 1),
                    connect_timeout_ms=int(self.connect_timeout * 1000),
                )
            return self._crts[region]

    def _payload_signing(self, region: str, sha256_hex: str):
        """Signing that covers the body: the store refuses a body whose SHA-256 is not ``sha256_hex``.

        The CRT signs ``UNSIGNED-PAYLOAD`` otherwise (it does not hash a body itself).
        """
        from awscrt.auth import AwsSignedBodyHeaderType, AwsSigningConfig

        return AwsSigningConfig(
            credentials_provider=self._provider,
            region=region,
            service="s3",
            use_double_uri_encode=False,
            should_normalize_uri_path=False,
            signed_body_value=sha256_hex,
            signed_body_header_type=AwsSignedBodyHeaderType.X_AMZ_CONTENT_SHA_256,
        )

    def _netloc(self, region: str) -> str:
        return urlsplit(self._endpoint).netloc if self._endpoint else f"s3.{region}.amazonaws.com"

    def bucket_region(self, bucket: str) -> str:
        """The region ``bucket`` lives in, asked of S3 once per bucket (a HEAD of the bucket).

        The CRT signs for one region and, unlike botocore, does not follow S3's answer to a
        request signed for another (301 PermanentRedirect, 400 AuthorizationHeaderMalformed):
        a bucket outside the configured region (``AWS_REGION``, default us-east-1) would fail
        every download. S3 names the bucket's region in ``x-amz-bucket-region`` on every answer
        to a bucket HEAD, success or not; a server that does not (an S3-compatible store with
        one region) keeps the configured one.
        """
        region = self._regions.get(bucket)
        if region:
            return region
        with self._region_lock:  # one probe per bucket, whatever the number of threads asking
            if bucket not in self._regions:
                self._crt_client()
                _status, headers, _ = self._crt_request(
                    "HEAD", bucket, "", [], "", region=self.region, operation="HeadBucket", raise_errors=False
                )
                region = headers.get("x-amz-bucket-region", "").strip() or self.region
                if region != self.region:
                    from trainer.sync.progress import log

                    log(
                        f"s3://{bucket}: the bucket is in region {region}, not {self.region}: signing for {region}"
                    )
                self._regions[bucket] = region
            return self._regions[bucket]

    def _address(self, bucket: str, key: str, region: str) -> tuple[str, str]:
        """Host header and request path for an object."""
        netloc = self._netloc(region)
        if self._virtual and bucket == bucket.lower() and "." not in bucket:
            return f"{bucket}.{netloc}", f"{self._path_prefix}/{quote(key, safe='/~')}"
        return netloc, f"{self._path_prefix}/{bucket}/{quote(key, safe='/~')}"

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
    ) -> tuple[int, dict[str, str], bytes]:
        """One plain request through the CRT (retried by it): status, lower-cased headers, body.

        The CRT has no read timeout: each attempt is bounded here by ``read_timeout`` plus a
        second per MiB sent, then cancelled. A read (GET, HEAD) that got no answer is sent
        again, ``max_attempts`` times in all, as botocore retries a read timeout; any other
        request raises, for its caller to decide (a second CreateMultipartUpload would leave
        the first one's upload behind).

        Raises:
            S3RequestError: an HTTP error after the engine's retries.
            SyncError: no answer within the bound, or a connection that kept failing.
        """
        attempts = self.max_attempts if method in ("GET", "HEAD") else 1
        for attempt in range(1, attempts + 1):
            try:
                return self._crt_request(
                    method,
                    bucket,
                    key,
                    extra,
                    query,
                    body=body,
                    region=self.bucket_region(bucket),
                    operation=operation or ("HeadObject" if method == "HEAD" else "GetObject"),
                    timeout=self.read_timeout + len(body) / MiB,
                    payload_sha256=payload_sha256,
                )
            except TimeoutError as exc:
                if attempt == attempts:
                    raise SyncError(f"{exc}; cancelled after {attempt} attempt(s)") from None
        raise AssertionError("not reached")

    def list_objects(self, bucket: str, prefix: str, *, page_size: int = 1000) -> Iterator[dict[str, Any]]:
        """Every object whose key starts with ``prefix``, as ListObjectsV2 pages them.

        Each a dict with ``Key``, ``ETag`` (in quotes, as S3 sends it; some servers list it
        without) and ``Size``, the names botocore's listing uses; ``page_size`` keys a request
        at most. Through the CRT with ``small_calls_on_crt`` (the XML read by the standard
        library's ElementTree), else botocore's paginator.

        Raises:
            S3RequestError: an HTTP error such as 403 or 404 (no such bucket).
            SyncError: the request kept failing.
        """
        if not self.small_calls_on_crt:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=prefix, PaginationConfig={"PageSize": page_size}
            )
            for page in pages:
                for item in page.get("Contents", []):
                    yield {
                        "Key": item["Key"],
                        "ETag": _quoted(item.get("ETag", "")),
                        "Size": item.get("Size", 0),
                    }
            return
        import xml.etree.ElementTree as ET

        token = None
        while True:
            # keys as S3 URL-encodes them: a key may hold characters XML 1.0 cannot
            query = f"encoding-type=url&list-type=2&max-keys={page_size}&prefix={quote(prefix, safe='')}"
            if token:
                query += f"&continuation-token={quote(token, safe='')}"
            _, _, body = self._crt_call("GET", bucket, "", [], query, operation="ListObjectsV2")
            root = ET.fromstring(body)
            ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
            encoded = root.findtext(f"{ns}EncodingType") == "url"
            for item in root.iter(f"{ns}Contents"):
                name = item.findtext(f"{ns}Key") or ""
                yield {
                    "Key": unquote_plus(name) if encoded else name,
                    "ETag": _quoted(item.findtext(f"{ns}ETag") or ""),
                    "Size": int(item.findtext(f"{ns}Size") or 0),
                }
            token = root.findtext(f"{ns}NextContinuationToken")
            if root.findtext(f"{ns}IsTruncated") != "true" or not token:
                return

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

        handle = _Download(S3Uri(bucket, key), None, lambda c, o: None)
        handle.request = crt.make_request(
            type=S3RequestType.DEFAULT,
            request=HttpRequest(
                method,
                f"{path}?{query}" if query else path,
                HttpHeaders([("host", host), ("content-length", str(len(body))), *extra]),
                io.BytesIO(body) if body else None,
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
        upload_id = _xml_text(body, "UploadId")
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
            [("x-amz-checksum-crc32c", _b64_crc32c(crc32c))] if crc32c is not None else [],
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
                ET.SubElement(part, "ChecksumCRC32C").text = _b64_crc32c(crc32cs[number - 1])
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
        handle = _Download(
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


def _b64_crc32c(value: int) -> str:
    """A CRC32C as S3 writes it: the 4 big-endian bytes in base64."""
    return base64.b64encode(value.to_bytes(4, "big")).decode()


class _Download:
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
        if self.error is not None:
            raise self.error
