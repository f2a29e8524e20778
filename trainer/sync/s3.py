"""S3 access for the transfer tool.

Two paths share one set of credentials:

* ``S3.client``: a botocore client for control calls (list, head, small JSON objects,
  uploads), with botocore's standard retries.
* ``S3.get_range``: a lean GET path for object data. botocore spends about 2 ms of CPU
  per call on its event machinery, which dominates when a dataset has thousands of small
  objects; this path signs requests itself (SigV4), keeps one keep-alive connection per
  worker thread (``trainer.sync.wire``) and reads bodies straight into caller-owned buffers.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from urllib.parse import quote, urlsplit

from trainer.sync import wire

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
# errno values after which a retry cannot help
_RETRYABLE_STATUS = {429, 500, 502, 503, 504}


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


class S3RequestError(SyncError):
    """An S3 request failed with an HTTP status (after retries, where retrying made sense)."""

    def __init__(self, uri: S3Uri, status: int, code: str, message: str = "") -> None:
        self.uri, self.status, self.code = uri, status, code
        super().__init__(f"{uri}: HTTP {status} {code}{': ' + message if message else ''}")


def _error_code(body: bytes) -> tuple[str, str]:
    text = body.decode("utf-8", "replace")

    def tag(name: str) -> str:
        start = text.find(f"<{name}>")
        end = text.find(f"</{name}>")
        return text[start + len(name) + 2 : end] if start >= 0 and end > start else ""

    return tag("Code"), tag("Message")


class _StaticCredentials:
    """Keys from the standard AWS variables (what the ``kubetrain-s3`` Secret injects)."""

    def __init__(self, access_key: str, secret_key: str, token: str | None) -> None:
        self.access_key, self.secret_key, self.token = access_key, secret_key, token

    def get_frozen_credentials(self) -> _StaticCredentials:
        return self


class S3:
    """S3 access from a pod: standard AWS variables or workload identity, never literals.

    With keys in the environment and an endpoint or region set, the data path needs no
    botocore at all (importing it costs about 0.4 s of CPU); botocore's client, for
    listings and uploads, and its credential chain, for workload identity, load on demand.

    Args:
        max_attempts: attempts per request, for transient errors (5xx, 429, resets);
            default: the standard ``AWS_MAX_ATTEMPTS`` variable, else 8.
        pool: connections botocore may keep open (the data path keeps one per thread).
        read_timeout: seconds without data before a connection counts as dead.
    """

    def __init__(
        self, *, max_attempts: int | None = None, pool: int = 32, read_timeout: float = 60.0
    ) -> None:
        if max_attempts is None:
            try:
                max_attempts = max(1, int(os.environ.get("AWS_MAX_ATTEMPTS") or 8))
            except ValueError as exc:
                raise SyncError(
                    f"AWS_MAX_ATTEMPTS={os.environ['AWS_MAX_ATTEMPTS']!r} is not a whole number"
                ) from exc
        self.max_attempts = max_attempts
        self.read_timeout = read_timeout
        self._pool = pool
        self._client = None
        self._client_lock = threading.Lock()
        self._endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        key_id, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
        if key_id and secret and (self._endpoint or region):
            self._credentials = _StaticCredentials(key_id, secret, os.environ.get("AWS_SESSION_TOKEN"))
            self.region = region or "us-east-1"
            endpoint = self._endpoint or f"https://s3.{self.region}.amazonaws.com"
        else:
            client = self.client
            self._credentials = self._session.get_credentials()
            self.region = client.meta.region_name or "us-east-1"
            endpoint = client.meta.endpoint_url
        parts = urlsplit(endpoint)
        self._scheme = parts.scheme
        self._host = parts.hostname or ""
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._netloc = parts.netloc
        self._path_prefix = parts.path.rstrip("/")
        self._virtual = not self._endpoint and self._host.endswith("amazonaws.com")
        self._local = threading.local()
        self._ssl = None
        if self._scheme == "https":
            import ssl  # only for https endpoints: it takes a tenth of the start-up

            self._ssl = ssl.create_default_context(cafile=os.environ.get("AWS_CA_BUNDLE") or None)
        self._key_cache: tuple[str, str, bytes] | None = None

    @property
    def client(self):
        """botocore's S3 client, created on first use, with botocore's standard retries."""
        with self._client_lock:
            if self._client is None:
                import botocore.config
                import botocore.session

                self._session = botocore.session.get_session()
                config = botocore.config.Config(
                    retries={"mode": "standard", "max_attempts": self.max_attempts},
                    max_pool_connections=self._pool,
                    connect_timeout=10,
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
        """A small object's whole content (a manifest), retrying transient errors and broken bodies.

        Raises:
            S3RequestError: an HTTP error such as 404 or 403.
            SyncError: the request kept failing.
        """
        uri = S3Uri(bucket, key)

        return self._request("GET", uri, "", {}, lambda resp: resp.read())

    def head(
        self, bucket: str, key: str, part_number: int | None = None, *, checksum_mode: bool = False
    ) -> dict[str, str]:
        """The response headers of a HEAD (of one part, with ``part_number``), lower-cased names.

        ``checksum_mode`` asks for the object's stored checksum (``x-amz-checksum-*``).
        """
        query = f"partNumber={part_number}" if part_number else ""
        extra = {"x-amz-checksum-mode": "ENABLED"} if checksum_mode else {}
        return self._request(
            "HEAD", S3Uri(bucket, key), query, extra, lambda resp: {k.lower(): v for k, v in resp.getheaders()}
        )

    # -- signing ---------------------------------------------------------------------------

    def _signing_key(self, secret: str, day: str) -> bytes:
        cached = self._key_cache
        if cached and cached[0] == secret and cached[1] == day:
            return cached[2]
        key = ("AWS4" + secret).encode()
        for part in (day, self.region, "s3", "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        self._key_cache = (secret, day, key)
        return key

    def _address(self, bucket: str, key: str) -> tuple[str, str]:
        """Host header and request path for an object."""
        if self._virtual and bucket == bucket.lower() and "." not in bucket:
            return f"{bucket}.{self._netloc}", f"{self._path_prefix}/{quote(key, safe='/~')}"
        return self._netloc, f"{self._path_prefix}/{bucket}/{quote(key, safe='/~')}"

    def _signed_headers(
        self, method: str, host: str, path: str, query: str, extra: dict[str, str]
    ) -> dict[str, str]:
        now = datetime.now(UTC)
        amz_date = now.strftime("%Y%m%dT%H%M%SZ")
        headers = {"host": host, "x-amz-content-sha256": EMPTY_SHA256, "x-amz-date": amz_date}
        creds = self._credentials.get_frozen_credentials() if self._credentials else None
        if creds is None:
            return {**headers, **extra}
        if creds.token:
            headers["x-amz-security-token"] = creds.token
        names = sorted(headers)
        canonical = "\n".join(
            [method, path, query, *(f"{n}:{headers[n]}" for n in names), "", ";".join(names), EMPTY_SHA256]
        )
        day = amz_date[:8]
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = f"AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        signature = hmac.new(self._signing_key(creds.secret_key, day), to_sign.encode(), hashlib.sha256)
        headers["authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={creds.access_key}/{scope}, "
            f"SignedHeaders={';'.join(names)}, Signature={signature.hexdigest()}"
        )
        return {**headers, **extra}

    # -- data path -------------------------------------------------------------------------

    def _connection(self) -> wire.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = wire.Connection(self._host, self._port, timeout=self.read_timeout, context=self._ssl)
            self._local.conn = conn
        return conn

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def _backoff(self, uri: S3Uri, attempt: int, exc: BaseException, limit: int | None = None) -> None:
        self._drop_connection()
        if attempt >= (limit or self.max_attempts):
            raise SyncError(f"{uri}: giving up after {attempt} attempts: {exc}") from exc
        time.sleep(min(5.0, 0.05 * 2**attempt) * (0.5 + random.random()))

    def _request(
        self, method: str, uri: S3Uri, query: str, extra: dict[str, str], handle: Callable, attempts: int = 0
    ):
        """One request with retries: ``handle(response)`` reads a 2xx response; errors raise."""
        host, path = self._address(uri.bucket, uri.key)
        target = f"{path}?{query}" if query else path
        attempt = 0
        while True:
            attempt += 1
            conn = self._connection()
            try:
                headers = self._signed_headers(method, host, path, query, extra)
                headers["accept-encoding"] = "identity"
                try:
                    conn.request(method, target, headers)
                except ValueError as exc:  # a header value with a line break (from a manifest)
                    raise SyncError(f"{uri}: refusing to send the request: {exc}") from None
                resp = conn.getresponse()
                if resp.status >= 300:
                    body = resp.read()
                    code, message = _error_code(body)
                    if resp.status in _RETRYABLE_STATUS or code in ("RequestTimeout", "SlowDown"):
                        raise _Transient(f"HTTP {resp.status} {code}")
                    raise S3RequestError(uri, resp.status, code or resp.reason, message)
                if method == "GET" and resp.framed_by_close:
                    # S3 frames every body; one that ends where the connection does cannot be
                    # told from one cut short
                    resp.close()
                    raise _Transient(f"HTTP {resp.status} without Content-Length")
                return handle(resp)
            except (_Transient, OSError) as exc:
                self._backoff(uri, attempt, exc, attempts)

    def get_range(
        self,
        bucket: str,
        key: str,
        buf: memoryview,
        start: int,
        *,
        if_match: str | None = None,
        whole: bool = False,
        checksum_mode: bool = False,
        on_headers: Callable[[wire.Response], None] | None = None,
        length: int | None = None,
        sink: Callable[[int, memoryview], None] | None = None,
    ) -> None:
        """Fill ``buf`` with the object's bytes from offset ``start``, retrying transient errors.

        A failure part-way through a body resumes at the first byte not yet received, so a
        retry never re-reads what is already in ``buf``.

        Args:
            bucket: bucket name.
            key: object key.
            buf: where the bytes go; its length is the number of bytes wanted.
            start: offset of the first byte in the object.
            if_match: ETag the object must still have (a changed object fails with 412).
            whole: ``buf`` is the whole object: ask without a Range header, which also
                checks that the object's length equals ``len(buf)``.
            checksum_mode: ask for the object's stored checksum (sent with whole objects only).
            on_headers: called with each successful response before its body is read; a
                ``SyncError`` it raises ends the download (no retry).
            length: with ``sink``, the number of bytes wanted.
            sink: streams the body instead: ``buf`` is then a scratch buffer, refilled and
                handed to ``sink(offset, chunk)`` (object offset) while it is still in the CPU's
                cache; a ``Refused`` it raises ends the download.

        Raises:
            S3RequestError: an HTTP error that is not transient, or a transient one that
                outlived the retries.
            SyncError: the connection kept failing, or the object is shorter than expected.
        """
        uri = S3Uri(bucket, key)
        want = len(buf) if sink is None else length
        done = 0
        attempt = 0
        while True:
            extra: dict[str, str] = {}
            if not (whole and done == 0):
                extra["range"] = f"bytes={start + done}-{start + want - 1}"
            if if_match:
                extra["if-match"] = if_match
            if checksum_mode:
                extra["x-amz-checksum-mode"] = "ENABLED"

            def fill(resp: wire.Response) -> None:
                nonlocal done
                length = int(resp.getheader("content-length", "-1"))
                if length != want - done:
                    resp.close()
                    self._drop_connection()
                    raise Refused(
                        f"{uri}: the server sent {length} bytes where {want - done} were expected "
                        f"(object size differs from the manifest?)"
                    )
                if on_headers is not None:
                    try:
                        on_headers(resp)
                    except SyncError:
                        resp.close()
                        self._drop_connection()
                        raise
                if sink is not None:
                    while done < want:
                        n = resp.readinto(buf[: min(len(buf), want - done)])
                        if not n:
                            raise wire.ProtocolError(f"the body ended {want - done} bytes early")
                        sink(start + done, buf[:n])
                        done += n
                    return
                while done < want:
                    n = resp.readinto(buf[done:])
                    if not n:
                        raise wire.ProtocolError(f"the body ended {want - done} bytes early")
                    done += n

            try:
                # one attempt at a time: a retry must ask only for the bytes still missing
                self._request("GET", uri, "", extra, fill, attempts=1)
                return
            except (S3RequestError, Refused):
                raise
            except SyncError as exc:
                attempt += 1
                self._backoff(uri, attempt, exc.__cause__ or exc)


class _Transient(Exception):
    """A response that asks the client to try again."""
