"""The local Airflow's REST client says what the API server logged when it answers a database error."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from include.airflow_ui import AirflowUI, AirflowUIError

# Airflow's own answer to a database error (api_fastapi/common/exceptions.py) without
# [api] expose_stacktrace, and the record its API server logs under the same ID.
ANSWER = {
    "detail": {
        "reason": "Database error",
        "statement": "hidden",
        "orig_error": "hidden",
        "message": "Serious error when handling your request. Check logs for more details - "
        "you will find it in api server when you look for ID AbC123xy",
    }
}
RECORD = (
    "2026-11-28T11:08:01.000000Z [error] Error with id AbC123xy, statement: UPDATE task_instance SET state=%(state)s\n"
    '  File "/airflow/api_fastapi/core_api/routes/public/dag_run.py", line 301, in patch_dag_run\n'
)


class _Answers500(http.server.BaseHTTPRequestHandler):
    """Answers PATCHes with the database error ``failures`` times, then 200 (forever when ``None``);
    ``answer`` is the 500's body."""

    failures: int | None = None
    answer: dict = ANSWER
    seen: list[str] = []

    def do_PATCH(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).seen.append(self.path)
        failing = self.failures is None or len(self.seen) <= self.failures
        body = json.dumps(self.answer if failing else {"state": "failed"}).encode()
        self.send_response(500 if failing else 200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server(request):
    handler = type("Handler", (_Answers500,), {"seen": [], **getattr(request, "param", {})})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.handler = handler
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def test_a_database_error_quotes_the_api_servers_record_of_its_id(tmp_path, server):
    ui = AirflowUI(tmp_path, {}, port=server.server_address[1])
    ui._token = "a token"
    (tmp_path / "logs").mkdir()
    ui.log_path("api-server").write_text("an earlier line\n" + RECORD + "a later request\n")
    with pytest.raises(AirflowUIError) as caught:
        ui.api("PATCH", "/dags/d/dagRuns/r", {"state": "failed"})
    message = str(caught.value)
    assert "PATCH /api/v2/dags/d/dagRuns/r answered 500" in message
    assert "Error with id AbC123xy, statement: UPDATE task_instance" in message
    assert "in patch_dag_run" in message
    assert "an earlier line" not in message


def test_without_the_record_the_answer_alone_is_quoted(tmp_path, server):
    ui = AirflowUI(tmp_path, {}, port=server.server_address[1])
    ui._token = "a token"
    with pytest.raises(AirflowUIError, match=r"answered 500: .*look for ID AbC123xy\"\}\}$"):
        ui.api("PATCH", "/dags/d/dagRuns/r", {"state": "failed"})


@pytest.mark.parametrize("server", [{"failures": 2}], indirect=True)
def test_marking_a_run_asks_again_after_a_database_error(tmp_path, server):
    """What Postgres answers a deadlock's victim: the API server's 500 "Database error"."""
    ui = AirflowUI(tmp_path, {}, port=server.server_address[1])
    ui._token = "a token"
    ui.set_run_state("d", "manual__2026-11-28T11:07:49+00:00", "failed")
    assert server.handler.seen == ["/api/v2/dags/d/dagRuns/manual__2026-11-28T11%3A07%3A49%2B00%3A00"] * 3


@pytest.mark.parametrize("server", [{"answer": {"detail": "Internal Server Error"}}], indirect=True)
def test_marking_a_run_does_not_ask_again_after_another_error(tmp_path, server):
    ui = AirflowUI(tmp_path, {}, port=server.server_address[1])
    ui._token = "a token"
    with pytest.raises(AirflowUIError, match="answered 500: .*Internal Server Error"):
        ui.set_run_state("d", "r", "failed")
    assert len(server.handler.seen) == 1
