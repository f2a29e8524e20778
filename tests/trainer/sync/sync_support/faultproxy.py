"""A loopback HTTP/1.1 proxy in front of an S3 server that fails a share of the requests.

Faults, chosen per request with a seeded generator: a 503 SlowDown or a 500
InternalError answered by the proxy itself, a connection reset before the response, and a
connection reset half-way through the response body. ``first_gets`` injects given kinds in
turn into the first object GETs, so a test sees each of them whatever the timing; ``stall``
holds requests without an answer (a server or network that hangs). The proxy also records
every request (method, path, status, body bytes relayed) so tests can count GETs.
``region`` makes the server behave as a bucket of an AWS region: no S3-protocol server that
installs here checks the region a request is signed for (include/devstack/S3.md).
"""

from __future__ import annotations

import random
import re
import socket
import struct
import threading
from dataclasses import dataclass, field
from urllib.parse import urlsplit

_SCOPE = re.compile(r"Credential=[^/,\s]+/\d{8}/([^/]+)/s3/aws4_request")
_QUERY_SCOPE = re.compile(r"X-Amz-Credential=[^&%]+(?:/|%2F)\d{8}(?:/|%2F)([^/&%]+)(?:/|%2F)s3")
_WRONG_REGION = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AuthorizationHeaderMalformed</Code><Message>The '
    b"authorization header is malformed; the region '%s' is wrong; expecting '%s'</Message><Region>%s</Region></Error>"
)
_REFUSED = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InvalidArgument</Code><Message>Unsupported '
    b"header %s received for this API call.</Message></Error>"
)
_ERROR_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>%s</Code><Message>injected by the test proxy'
    b"</Message></Error>"
)


@dataclass
class Record:
    method: str
    path: str
    status: int
    body_bytes: int
    fault: str
    headers: dict[str, str] = field(default_factory=dict)  # the request's, lower-case names


class FaultProxy:
    """Proxy ``upstream`` (``http://host:port``) on a free loopback port.

    Args:
        upstream: the S3 endpoint.
        fail_rate: share of requests that get a fault.
        seed: seed of the fault generator.
        drop_headers: request headers to remove (as a server that ignores them would).
        always_fail: every request whose path contains this text gets a 503 (a persistent fault).
        corrupt: GET responses whose path contains this text arrive with one body byte flipped
            (headers intact), as a faulty network or disk would deliver them.
        first_gets: fault kinds given in turn to the first GETs of object data (a
            ``reset-body`` waits for a response that has a body to cut).
        stall: ``stall(method, path)`` is called once per request before it is relayed; when it
            returns an event, the request gets no answer (the proxy holds the connection open)
            until the event is set, and then the connection is closed.
        region: answer as AWS S3 does for buckets in this region: a request signed for another
            region gets 400 ``AuthorizationHeaderMalformed`` naming the right one, and every
            answer to a bucket HEAD carries ``x-amz-bucket-region``.
        refuse_header: a request that carries this header gets 400 ``InvalidArgument``, as from
            a store that does not know it (an S3-compatible store without flexible checksums).
    """

    def __init__(
        self,
        upstream: str,
        fail_rate: float = 0.2,
        seed: int = 0,
        drop_headers: tuple[str, ...] = (),
        always_fail: str | None = None,
        corrupt: str | None = None,
        first_gets: tuple[str, ...] = (),
        stall=None,
        region: str | None = None,
        refuse_header: str | None = None,
    ) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.fail_rate = fail_rate
        self.drop_headers = {h.lower() for h in drop_headers}
        self.always_fail = always_fail
        self.corrupt = corrupt
        self._script = list(first_gets)
        self.stall = stall
        self.region = region
        self.refuse_header = refuse_header.lower() if refuse_header else None
        self.stalled = threading.Event()  # set once a request has been held
        self._rng = random.Random(seed)
        self._local = threading.local()
        self._lock = threading.Lock()
        self.records: list[Record] = []
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed.set()
        self._sock.close()

    def faults(self) -> int:
        return sum(1 for r in self.records if r.fault)

    def object_gets(self, exclude_prefix: str = "/training/manifests/") -> list[Record]:
        """GETs of object data (not listings, not dataset manifests)."""
        return [
            r
            for r in self.records
            if r.method == "GET" and "?" not in r.path and not r.path.startswith(exclude_prefix)
        ]

    # -- plumbing --------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _fault(self, method: str, path: str) -> str:
        with self._lock:
            if self._script and method == "GET" and "?" not in path:
                return self._script.pop(0)
            r = self._rng.random()
        if r >= self.fail_rate:
            return ""
        r /= self.fail_rate
        return "503" if r < 0.35 else "500" if r < 0.6 else "reset" if r < 0.8 else "reset-body"

    def _serve(self, client: socket.socket) -> None:
        upstream = None
        reader = client.makefile("rb")
        try:
            while True:
                head = _read_head(reader)
                if head is None:
                    return
                request_line, headers = head
                self._local.headers = dict(headers)
                method, path, _ = request_line.split(" ", 2)
                hold = self.stall(method, path) if self.stall is not None else None
                if hold is not None:
                    self._record(method, path, 0, 0, "stall")
                    self.stalled.set()
                    while not hold.wait(0.05) and not self._closed.is_set():
                        pass
                    return
                fault = "503" if self.always_fail and self.always_fail in path else self._fault(method, path)
                expect = headers.pop("expect", None)
                for name in self.drop_headers:
                    headers.pop(name, None)
                if expect and fault in ("503", "500"):
                    self._record(method, path, int(fault), 0, fault)
                    _send_error(client, fault, close=True)
                    return
                if expect:
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                body = _read_body(reader, headers)
                signed = self._signed_region(headers, path)
                if signed and signed != self.region:
                    self._record(method, path, 400, 0, "region")
                    xml = (
                        b""
                        if method == "HEAD"
                        else _WRONG_REGION % (signed.encode(), self.region.encode(), self.region.encode())
                    )
                    client.sendall(
                        _encode_response(
                            "HTTP/1.1 400 Bad Request",
                            {
                                "content-type": "application/xml",
                                "content-length": str(len(xml)),
                                "x-amz-bucket-region": self.region,
                            },
                            xml,
                        )
                    )
                    continue
                if self.refuse_header and self.refuse_header in headers:
                    self._record(method, path, 400, 0, "refused")
                    xml = _REFUSED % self.refuse_header.encode()
                    client.sendall(
                        _encode_response(
                            "HTTP/1.1 400 Bad Request",
                            {"content-type": "application/xml", "content-length": str(len(xml))},
                            xml,
                        )
                    )
                    continue
                if fault in ("503", "500"):
                    self._record(method, path, int(fault), 0, fault)
                    _send_error(client, fault, close=False)
                    continue
                if fault == "reset":
                    self._record(method, path, 0, 0, fault)
                    _reset(client)
                    return
                if upstream is None:
                    upstream = socket.create_connection(self.upstream)
                    up_reader = upstream.makefile("rb")
                upstream.sendall(_encode_request(request_line, headers, body))
                status_line, resp_headers = _read_head(up_reader)
                status = int(status_line.split(" ", 2)[1])
                resp_body = (
                    b"" if method == "HEAD" or status in (204, 304) else _read_body(up_reader, resp_headers)
                )
                if self.corrupt and self.corrupt in path and method == "GET" and resp_body and status < 300:
                    flipped = bytearray(resp_body)
                    flipped[len(flipped) // 2] ^= 0x40
                    resp_body = bytes(flipped)
                    fault = "corrupt"
                if self.region and method == "HEAD" and path.split("?")[0].strip("/").count("/") == 0:
                    resp_headers["x-amz-bucket-region"] = self.region
                raw = _encode_response(status_line, resp_headers, resp_body)
                if fault == "reset-body" and len(resp_body) > 1:
                    client.sendall(raw[: len(raw) - len(resp_body) // 2])
                    self._record(method, path, status, len(resp_body) // 2, fault)
                    _reset(client)
                    return
                if fault == "reset-body":  # nothing to cut here: the next GET gets it
                    with self._lock:
                        self._script.insert(0, fault)
                    fault = ""
                # recorded before it is sent: a client that has its answer finds the request recorded
                self._record(method, path, status, len(resp_body), fault if fault == "corrupt" else "")
                client.sendall(raw)
                if resp_headers.get("connection", "").lower() == "close":
                    return
        except (OSError, ValueError):
            return
        finally:
            client.close()
            if upstream is not None:
                upstream.close()

    def _signed_region(self, headers: dict[str, str], path: str) -> str | None:
        if not self.region:
            return None
        found = _SCOPE.search(headers.get("authorization", "")) or _QUERY_SCOPE.search(path)
        return found.group(1) if found else None

    def _record(self, method: str, path: str, status: int, nbytes: int, fault: str) -> None:
        with self._lock:
            self.records.append(Record(method, path, status, nbytes, fault, dict(self._local.headers)))


def _read_head(reader) -> tuple[str, dict[str, str]] | None:
    line = reader.readline(65537)
    if not line:
        return None
    first = line.decode("latin-1").rstrip("\r\n")
    headers: dict[str, str] = {}
    while True:
        line = reader.readline(65537)
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return first, headers


def _read_body(reader, headers: dict[str, str]) -> bytes:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        chunks = []
        while True:
            size = int(reader.readline().split(b";")[0].strip(), 16)
            if size == 0:
                while reader.readline() not in (b"\r\n", b"\n", b""):
                    pass
                break
            chunks.append(reader.read(size))
            reader.readline()
        headers.pop("transfer-encoding")
        body = b"".join(chunks)
        headers["content-length"] = str(len(body))
        return body
    length = int(headers.get("content-length", "0"))
    return reader.read(length) if length else b""


def _encode_request(request_line: str, headers: dict[str, str], body: bytes) -> bytes:
    lines = [request_line, *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _encode_response(status_line: str, headers: dict[str, str], body: bytes) -> bytes:
    lines = [status_line, *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _send_error(client: socket.socket, fault: str, close: bool) -> None:
    code, reason, name = (
        (503, "Slow Down", b"SlowDown") if fault == "503" else (500, "Internal Error", b"InternalError")
    )
    body = _ERROR_BODY % name
    head = (
        f"HTTP/1.1 {code} {reason}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
        f"{'Connection: close' + chr(13) + chr(10) if close else ''}\r\n"
    )
    client.sendall(head.encode() + body)


def _reset(client: socket.socket) -> None:
    # SO_LINGER with a zero timeout turns close() into a TCP reset
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()
