"""The ``gpu-pool`` line: the Airflow pool of GPU training tasks, read through Airflow's public REST API
(``GET /api/v2/pools/{name}`` on the API server), never through the ORM: a task of Airflow 3 may not open the
metadata database, and from a shell the ORM would create an empty ``airflow.db`` wherever ``AIRFLOW_HOME``
points.

One GET and, with a password, the token's POST do not justify a client library: they go through ``requests``,
already a dependency (``apache-airflow-client`` is not in the lock).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kubetrain.preflight.check import Check, short_error

# The connection to Airflow's REST API, where the pool line reads the pool.
AIRFLOW_API_CONN_ID = "airflow_api"


class AirflowApiError(Exception):
    """Airflow's REST API could not be asked: unreachable, or it refused (``unauthorized``: 401 or 403)."""

    def __init__(self, message: str, *, unauthorized: bool = False) -> None:
        super().__init__(message)
        self.unauthorized = unauthorized


@dataclass(frozen=True)
class AirflowApi:
    """Airflow's public REST API (the API server's ``/api/v2``), for the one thing the preflight reads there.

    :param url: the API server's base URL (``http://host:8080``, without ``/api/v2``).
    :param where: where the URL came from, for messages.
    :param token: a JWT (or other bearer token) the API server accepts; sent as is.
    :param username: with ``password``: exchanged for a JWT at ``POST /auth/token`` (the simple auth manager's
        and FAB's token endpoint) when no ``token`` is given.
    :param password: the user's password.
    :param timeout: seconds per request.
    """

    url: str
    where: str
    token: str = ""
    username: str = ""
    password: str = field(default="", repr=False)
    timeout: float = 10.0

    def _request(self, method: str, path: str, **kwargs: Any):
        import requests

        target = f"{self.url.rstrip('/')}{path}"
        try:
            return requests.request(method, target, timeout=self.timeout, **kwargs)
        except requests.RequestException as exc:
            raise AirflowApiError(f"does not answer: {short_error(exc)}") from exc

    def _headers(self) -> dict[str, str]:
        token = self.token
        if not token and self.username:
            answer = self._request(
                "POST", "/auth/token", json={"username": self.username, "password": self.password}
            )
            if answer.status_code in (401, 403):
                raise AirflowApiError(
                    f"refused user {self.username!r} at POST /auth/token ({answer.status_code})",
                    unauthorized=True,
                )
            if answer.status_code not in (200, 201):
                raise AirflowApiError(
                    f"answered POST /auth/token with {answer.status_code}: {answer.text[:200]}"
                )
            token = answer.json().get("access_token") or ""
        return {"Authorization": f"Bearer {token}"} if token else {}

    def pool(self, name: str) -> dict[str, Any] | None:
        """``GET /api/v2/pools/{name}``: the pool (``slots``, ``occupied_slots``, ...), None when it does not exist."""
        from urllib.parse import quote

        answer = self._request("GET", f"/api/v2/pools/{quote(name, safe='')}", headers=self._headers())
        if answer.status_code == 404:
            try:
                detail = answer.json().get("detail")
            except ValueError:
                detail = None
            # Airflow's answer for a pool it lacks: {"detail": "The Pool with name: `gpu` was not found"}; a path
            # that is no route of it (a URL with the wrong prefix) gets {"detail": "Not Found"}
            if isinstance(detail, str) and f"`{name}`" in detail:
                return None
            raise AirflowApiError(
                f"answered 404 to GET /api/v2/pools/{name} ({detail or answer.text[:100]!r}): "
                "is it the API server's URL?"
            )
        if answer.status_code in (401, 403):
            who = f"user {self.username!r}" if self.username and not self.token else "the request"
            raise AirflowApiError(
                f"refused {who} at GET /api/v2/pools ({answer.status_code})", unauthorized=True
            )
        if answer.status_code != 200:
            raise AirflowApiError(
                f"answered GET /api/v2/pools with {answer.status_code}: {answer.text[:200]}"
            )
        try:
            pool = answer.json()
        except ValueError:
            pool = None
        if not isinstance(pool, dict) or "slots" not in pool:
            raise AirflowApiError(
                f"answered GET /api/v2/pools/{name} with no pool ({answer.headers.get('content-type')}: "
                f"{answer.text[:80]!r}): is it the API server's URL?"
            )
        return pool


def connection_url(conn: Any) -> str:
    """The base URL of an http connection: its host (with a scheme, or the schema/type's), and port."""
    host = (conn.host or "").rstrip("/")
    if not host:
        return ""
    if "://" not in host:
        scheme = (
            conn.schema
            if conn.schema in ("http", "https")
            else "https"
            if conn.conn_type == "https"
            else "http"
        )
        host = f"{scheme}://{host}"
    return f"{host}:{conn.port}" if conn.port else host


def configured_api_url() -> str:
    """Airflow's ``[api] base_url`` (AIRFLOW__API__BASE_URL), empty when not set."""
    from airflow.configuration import conf

    return conf.get("api", "base_url", fallback="") or ""


@dataclass(frozen=True)
class AirflowChecks:
    """The Airflow side of the preflight: the pool that bounds concurrent GPU pods.

    :param pool: the Airflow pool of GPU training tasks.
    :param airflow_api_conn_id: the connection to Airflow's REST API (where the pool is read).
    :param airflow_api_url: the API server's URL, over the connection's host (the CLI's ``--airflow-api-url``).
    :param airflow_api_default_url: the URL when neither gives one (the CLI: Airflow's ``[api] base_url``).
    """

    pool: str = "gpu"
    airflow_api_conn_id: str = AIRFLOW_API_CONN_ID
    airflow_api_url: str | None = None
    airflow_api_default_url: str | None = None

    def airflow_api(self) -> AirflowApi | None:
        """Where Airflow's REST API is and how to sign in: the ``airflow_api_conn_id`` connection, its URL
        ``airflow_api_url``, else its host, else ``airflow_api_default_url`` or ``[api] base_url``; when the
        connection is not defined, ``airflow_api_url`` or ``airflow_api_default_url`` with no credentials;
        None when there is no URL either."""
        from airflow.sdk import BaseHook

        try:
            conn = BaseHook.get_connection(self.airflow_api_conn_id)
        except Exception as exc:  # noqa: BLE001 - AirflowNotFoundException: not defined
            if type(exc).__name__ != "AirflowNotFoundException":
                raise
            conn = None
        if conn is None:
            url = self.airflow_api_url or self.airflow_api_default_url
            if not url:
                return None
            return AirflowApi(url, f"no credentials: connection {self.airflow_api_conn_id!r} is not defined")
        extra = conn.extra_dejson
        url = (
            self.airflow_api_url
            or connection_url(conn)
            or self.airflow_api_default_url
            or configured_api_url()
        )
        if not url:
            raise ValueError(
                f"connection {self.airflow_api_conn_id!r} has no host and [api] base_url is not set: "
                "expected the API server's URL, e.g. http://airflow-api-server:8080"
            )
        return AirflowApi(
            url,
            f"connection {self.airflow_api_conn_id!r}",
            token=str(extra.get("token") or ""),
            username=conn.login or "",
            password=conn.password or "",
        )

    def check_pool(self) -> Check:
        """The Airflow pool of GPU training tasks, read through Airflow's REST API (never the ORM)."""
        manual = f"check with `airflow pools get {self.pool}`"
        setup = (
            f"define connection {self.airflow_api_conn_id} (type http: the API server's URL with a user's login "
            'and password, or extra {"token": ...})'
        )
        try:
            api = self.airflow_api()
        except Exception as exc:  # noqa: BLE001 - a connection that does not parse
            return Check("gpu-pool", "WARN", f"pool {self.pool!r} not checked: {short_error(exc)}; {manual}")
        if api is None:
            return Check(
                "gpu-pool",
                "INFO",
                f"pool {self.pool!r} not checked: no Airflow API configured ({setup}); {manual}",
            )
        try:
            pool = api.pool(self.pool)
        except AirflowApiError as exc:
            return Check(
                "gpu-pool",
                "WARN",
                f"pool {self.pool!r} not checked: the Airflow API at {api.url} ({api.where}) {exc}; "
                + (f"{setup}; " if exc.unauthorized else "")
                + manual,
            )
        if pool is None:
            return Check(
                "gpu-pool",
                "FAIL",
                f"Airflow pool {self.pool!r} does not exist (API {api.url}): GPU training tasks would not be "
                "scheduled",
                f"airflow pools set {self.pool} <number of GPUs> 'GPU training pods'",
            )
        return Check(
            "gpu-pool", "PASS", f"Airflow pool {self.pool!r} has {pool.get('slots')} slot(s) (API {api.url})"
        )
