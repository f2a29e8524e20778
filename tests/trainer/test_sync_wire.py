"""The data path's HTTP connection (trainer.sync.wire): against the real S3 server, and against a
loopback server that answers with scripted bytes, for responses S3 servers send only now and then
(chunked error bodies, ``Connection: close``, a body cut short, an idle connection closed)."""

from __future__ import annotations

import hashlib
import os
import socket
import threading

import pytest
from sync_support import s3_client

from trainer.sync import wire
from trainer.sync.s3 import S3, S3RequestError, SyncError


class ScriptedServer:
    """Answers each request with the next scripted reply (bytes, then maybe a close), recording requests."""

    def __init__(self, replies: list[tuple[bytes, bool]]) -> None:
        self.replies = list(replies)
        self.requests: list[bytes] = []
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while self.replies:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                buf = b""
                while self.replies:
                    while b"\r\n\r\n" not in buf:
                        data = conn.recv(65536)
                        if not data:
                            break
                        buf += data
                    if b"\r\n\r\n" not in buf:
                        break
                    request, buf = buf.split(b"\r\n\r\n", 1)
                    self.requests.append(request)
                    reply, close = self.replies.pop(0)
                    conn.sendall(reply)
                    if close:
                        break

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def scripted():
    servers = []

    def start(*replies: tuple[bytes, bool]) -> ScriptedServer:
        server = ScriptedServer(list(replies))
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def ok(body: bytes, *headers: str) -> bytes:
    head = "".join(f"{h}\r\n" for h in headers)
    return f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n{head}\r\n".encode() + body


def chunked(status: str, *chunks: bytes) -> bytes:
    body = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\nX-Trailer: t\r\n\r\n"
    return f"HTTP/1.1 {status}\r\nTransfer-Encoding: chunked\r\n\r\n".encode() + body


@pytest.fixture
def s3_env(monkeypatch):
    def use(port: int) -> S3:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
        monkeypatch.setenv("AWS_REGION", "us-east-1")
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")
        return S3(read_timeout=5)

    return use


def test_keep_alive_reuses_one_connection_and_reads_bodies_exactly(scripted):
    server = scripted((ok(b"first"), False), (ok(b"", "X-Empty: 1"), False), (ok(b"third", "Etag: \"e\""), False))
    conn = wire.Connection("127.0.0.1", server.port, timeout=5)
    conn.request("GET", "/a", {"host": "h"})
    resp = conn.getresponse()
    buf = bytearray(10)
    assert (resp.status, resp.readinto(buf), bytes(buf[:5]), resp.readinto(buf)) == (200, 5, b"first", 0)
    conn.request("GET", "/b", {"host": "h"})
    resp = conn.getresponse()
    assert (resp.getheader("x-empty"), resp.read()) == ("1", b"")
    conn.request("HEAD", "/c", {"host": "h"})  # HEAD: the Content-Length names a body that never comes
    resp = conn.getresponse()
    assert (resp.getheader("ETag"), resp.getheader("content-length"), resp.read()) == ('"e"', "5", b"")
    assert server.connections == 1
    assert server.requests[0] == b"GET /a HTTP/1.1\r\nhost: h"


def test_chunked_error_body_is_parsed_for_its_code(scripted, s3_env):
    error = b"<Error><Code>AccessDenied</Code><Message>no such grant</Message></Error>"
    server = scripted((chunked("403 Forbidden", error[:20], error[20:]), False), (ok(b"after"), False))
    s3 = s3_env(server.port)
    with pytest.raises(S3RequestError) as err:
        s3.get_bytes("bucket", "key")
    assert (err.value.status, err.value.code) == (403, "AccessDenied")
    assert "no such grant" in str(err.value) and "s3://bucket/key" in str(err.value)
    assert s3.get_bytes("bucket", "key") == b"after"  # the chunked body was read to its end: same connection
    assert server.connections == 1


def test_connection_close_and_http10_open_a_new_connection(scripted, s3_env):
    server = scripted(
        (ok(b"one", "Connection: close"), True),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\ntwo", True),
        # a body that ends where the connection does cannot be told from one cut short: retried
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end", True),
        (ok(b"three"), False),
        (ok(b"four"), False),
    )
    s3 = s3_env(server.port)
    assert [s3.get_bytes("b", "k") for _ in range(4)] == [b"one", b"two", b"three", b"four"]
    assert server.connections == 4


def test_idle_connection_closed_by_the_server_is_retried(scripted, s3_env):
    # the server answers, then closes the kept-alive connection without saying so
    server = scripted((ok(b"one"), True), (ok(b"two"), False))
    s3 = s3_env(server.port)
    assert s3.get_bytes("b", "k") == b"one"
    assert s3.get_bytes("b", "k") == b"two"
    assert server.connections == 2


def test_a_body_cut_short_is_an_error_and_the_range_resumes(scripted, s3_env):
    data = os.urandom(1000)
    server = scripted(
        (b"HTTP/1.1 206 Partial Content\r\nContent-Length: 1000\r\n\r\n" + data[:400], True),
        (b"HTTP/1.1 206 Partial Content\r\nContent-Length: 600\r\n\r\n" + data[400:], False),
    )
    s3 = s3_env(server.port)
    buf = bytearray(1000)
    s3.get_range("b", "k", memoryview(buf), 0)
    assert hashlib.sha256(buf).digest() == hashlib.sha256(data).digest()
    ranges = [r.split(b"range: ")[1].split(b"\r\n")[0] for r in server.requests]
    assert ranges == [b"bytes=0-999", b"bytes=400-999"]  # the retry asks only for what is missing

    cut = scripted((b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", True))
    conn = wire.Connection("127.0.0.1", cut.port, timeout=5)
    conn.request("GET", "/", {"host": "h"})
    with pytest.raises(wire.ProtocolError, match="7 bytes before its Content-Length"):
        conn.getresponse().read()


@pytest.mark.parametrize(
    "reply, message",
    [
        (b"SPDY/3 200 OK\r\n\r\n", "bad status line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n", "bad Content-Length"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "bad header line"),
        (b"HTTP/1.1 200 OK\r\nContent-Len", "ended inside its headers"),
        (b"HTTP/1.1 500 Oops\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size line"),
    ],
)
def test_malformed_responses_are_protocol_errors(scripted, reply, message):
    server = scripted((reply, True))
    conn = wire.Connection("127.0.0.1", server.port, timeout=5)
    conn.request("GET", "/", {"host": "h"})
    with pytest.raises(wire.ProtocolError, match=message):
        conn.getresponse().read()


@pytest.mark.parametrize(
    "reply",
    [
        b"SPDY/3 200 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc",
        b"HTTP/1.1 200 OK\r\nContent-Len",
        b"HTTP/1.1 500 Oops\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ],
)
def test_malformed_responses_are_retried_then_named(scripted, s3_env, reply):
    server = scripted(*[(reply, True)] * 3)  # AWS_MAX_ATTEMPTS=3
    s3 = s3_env(server.port)
    with pytest.raises(SyncError, match=r"s3://b/k: giving up after 3 attempts"):
        s3.get_bytes("b", "k")
    assert len(server.requests) == 3


def test_line_breaks_in_headers_are_refused_before_sending(scripted, s3_env):
    server = scripted((ok(b"never"), False))
    s3 = s3_env(server.port)
    with pytest.raises(SyncError, match="refusing to send the request: .*holds a line break") as err:
        s3.get_range("b", "k", memoryview(bytearray(5)), 0, if_match='"etag"\r\nx-injected: 1')
    assert "s3://b/k" in str(err.value)
    assert server.requests == []


def test_objects_round_trip_through_the_real_server(s3_server, monkeypatch):
    client = s3_client(s3_server)
    data = os.urandom(3 * 1024 * 1024 + 17)
    client.put_object(Bucket="datasets", Key="wire/blob.bin", Body=data)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_access_key)
    monkeypatch.setenv("AWS_REGION", s3_server.region)
    s3 = S3()
    assert s3.get_bytes("datasets", "wire/blob.bin") == data
    buf = bytearray(len(data) - 1000)
    s3.get_range("datasets", "wire/blob.bin", memoryview(buf), 1000)
    assert bytes(buf) == data[1000:]
    head = s3.head("datasets", "wire/blob.bin")
    assert int(head["content-length"]) == len(data)
    with pytest.raises(S3RequestError) as err:
        s3.get_bytes("datasets", "wire/missing.bin")
    assert err.value.status == 404 and err.value.code == "NoSuchKey"
