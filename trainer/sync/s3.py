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

This module builds the clients and sends the small requests; the uploads and downloads through
the CRT are :mod:`trainer.sync.s3_crt`, the errors every command reports :mod:`trainer.sync.errors`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, unquote_plus, urlsplit

from kubetrain_contract.pod import Env
from kubetrain_contract.s3uri import S3Uri
from trainer.sync.errors import SyncError, client_error, quoted_etag
from trainer.sync.s3_crt import CrtTransfers

# the sidecar's calls: a final pass has seconds, not minutes (trainer/sync/README.md)
CONNECT_TIMEOUT = 5.0
READ_TIMEOUT = 20.0
DEFAULT_ATTEMPTS = 5
# the CRT's ranged GETs: objects up to this size are one request
PART_SIZE = 8 * 1024 * 1024
MiB = 1024 * 1024


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


class S3(CrtTransfers):
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
                        "ETag": quoted_etag(item.get("ETag", "")),
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
                    "ETag": quoted_etag(item.findtext(f"{ns}ETag") or ""),
                    "Size": int(item.findtext(f"{ns}Size") or 0),
                }
            token = root.findtext(f"{ns}NextContinuationToken")
            if root.findtext(f"{ns}IsTruncated") != "true" or not token:
                return
