"""The pool line's REST client and where it finds the API, against a stand-in for the API server's two routes
(test_preflight_airflow_api.py runs a real ``airflow api-server``)."""

from __future__ import annotations

import http.server
import json
import threading
from types import SimpleNamespace

import pytest

from kubetrain.preflight.airflow_api import AirflowApi, AirflowApiError, AirflowChecks, connection_url

TOKEN = "jwt-of-admin"


class _ApiServer(http.server.BaseHTTPRequestHandler):
    """``POST /auth/token`` for admin/secret, and ``GET /api/v2/pools/gpu`` with that token."""

    def _answer(self, status: int, body: object, content_type: str = "application/json") -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):  # noqa: N802 - http.server's name
        sent = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/auth/token":
            return self._answer(404, {"detail": "Not Found"})
        if sent == {"username": "admin", "password": "secret"}:
            return self._answer(201, {"access_token": TOKEN})
        return self._answer(401, {"detail": "Invalid credentials"})

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._answer(401, {"detail": "Not authenticated"})
        if self.path == "/api/v2/pools/gpu":
            return self._answer(200, {"name": "gpu", "slots": 4, "occupied_slots": 1})
        if self.path.startswith("/api/v2/pools/"):
            name = self.path.rsplit("/", 1)[1]
            return self._answer(404, {"detail": f"The Pool with name: `{name}` was not found"})
        if self.path.startswith("/ui/api/v2/pools/"):
            return self._answer(200, "<html>the UI</html>", "text/html")
        return self._answer(404, {"detail": "Not Found"})

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ApiServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_a_pool_is_read_with_a_password_exchanged_for_a_token_or_with_the_token(url):
    assert AirflowApi(url, "test", username="admin", password="secret").pool("gpu")["slots"] == 4
    assert AirflowApi(url, "test", token=TOKEN).pool("gpu")["slots"] == 4
    assert AirflowApi(url, "test", token=TOKEN).pool("gpu-missing") is None


@pytest.mark.parametrize(
    ("api", "message", "unauthorized"),
    [
        (dict(username="admin", password="wrong"), "refused user 'admin' at POST /auth/token (401)", True),
        (dict(), "refused the request at GET /api/v2/pools (401)", True),
        (dict(token=TOKEN, path="/airflow"), "answered 404 to GET /api/v2/pools/gpu ('Not Found')", False),
        (dict(token=TOKEN, path="/ui"), "answered GET /api/v2/pools/gpu with no pool (text/html", False),
    ],
    ids=["wrong password", "no credentials", "not the api server's prefix", "a page, not the api"],
)
def test_what_the_api_refuses_or_answers_wrongly_is_one_error(url, api, message, unauthorized):
    path = api.pop("path", "")
    with pytest.raises(AirflowApiError) as raised:
        AirflowApi(url + path, "test", **api).pool("gpu")
    assert str(raised.value).startswith(message), raised.value
    assert raised.value.unauthorized is unauthorized


def test_an_api_that_does_not_answer_says_so():
    from include.devstack.stack import free_port

    with pytest.raises(AirflowApiError, match=r"^does not answer: ConnectionError"):
        AirflowApi(f"http://127.0.0.1:{free_port()}", "test", token=TOKEN, timeout=2).pool("gpu")


@pytest.mark.parametrize(
    ("conn", "url"),
    [
        (dict(host="airflow-api", port=8080, schema="", conn_type="http"), "http://airflow-api:8080"),
        (dict(host="airflow-api", port=None, schema="https", conn_type="http"), "https://airflow-api"),
        (dict(host="airflow-api", port=443, schema="", conn_type="https"), "https://airflow-api:443"),
        (dict(host="http://127.0.0.1/", port=8080, schema="", conn_type="http"), "http://127.0.0.1:8080"),
        (dict(host="", port=8080, schema="", conn_type="http"), ""),
    ],
)
def test_a_connections_url(conn, url):
    assert connection_url(SimpleNamespace(**conn)) == url


def set_connection(monkeypatch, **fields) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_AIRFLOW_API", json.dumps({"conn_type": "http", **fields}))


def test_where_the_api_is_found(url, monkeypatch):
    monkeypatch.delenv("AIRFLOW_CONN_AIRFLOW_API", raising=False)
    monkeypatch.delenv("AIRFLOW__API__BASE_URL", raising=False)
    assert AirflowChecks().airflow_api() is None
    anonymous = AirflowChecks(airflow_api_default_url=url).airflow_api()
    assert anonymous == AirflowApi(url, "no credentials: connection 'airflow_api' is not defined")

    set_connection(
        monkeypatch, host="127.0.0.1", port=1, login="admin", password="secret", extra={"token": "t"}
    )
    api = AirflowChecks(airflow_api_url=url).airflow_api()  # the CLI's URL over the connection's host
    assert (api.url, api.where, api.token, api.username, api.password) == (
        url,
        "connection 'airflow_api'",
        "t",
        "admin",
        "secret",
    )
    assert "secret" not in repr(api)

    set_connection(monkeypatch, login="admin")
    with pytest.raises(
        ValueError, match="connection 'airflow_api' has no host and \\[api\\] base_url is not set"
    ):
        AirflowChecks().airflow_api()


def test_the_pool_line(url, monkeypatch):
    set_connection(monkeypatch, host=url, login="admin", password="secret")
    assert (
        AirflowChecks().check_pool().line() == f"PASS  gpu-pool: Airflow pool 'gpu' has 4 slot(s) (API {url})"
    )
    missing = AirflowChecks(pool="gpus").check_pool()
    assert (
        missing.status == "FAIL"
        and missing.fix == "airflow pools set gpus <number of GPUs> 'GPU training pods'"
    )
    set_connection(monkeypatch, host=url, login="admin", password="wrong")
    refused = AirflowChecks().check_pool()
    assert refused.status == "WARN" and "define connection airflow_api (type http" in refused.detail
    set_connection(monkeypatch, login="admin")
    monkeypatch.delenv("AIRFLOW__API__BASE_URL", raising=False)
    unparsed = AirflowChecks().check_pool()
    assert unparsed.status == "WARN" and unparsed.detail.startswith(
        "pool 'gpu' not checked: ValueError: connection"
    )
