"""Optional experiment tracking: every training run also logged to an MLflow tracking server.

Configured by the setting ``mlflow_tracking_uri`` (Airflow Variable ``kubetrain_mlflow_tracking_uri``,
else ``KUBETRAIN_MLFLOW_TRACKING_URI``), else by an Airflow connection ``mlflow_default``
(host with scheme and port; login and password for basic auth, or ``{"token": ...}`` in its extra
for a bearer token). With neither, nothing here contacts anything and the MLflow client code is
never imported.

The Airflow side logs the run from what it left in S3 (so third-party containers are tracked
too; nothing changes in the training pod): the experiment is named after the model, the run
after the DAG run (and trial); params are the trainer's hyperparameters and the run's Params;
the per-epoch metrics of ``history.csv`` are logged with their steps; the dataset is a run input
by S3 reference; tags name the dataset version, the image digest, the Airflow run and the S3
prefix; the report is copied into the run's artifacts (a server-side S3 copy when the artifact
store is S3); the model is never uploaded again: a promoted model becomes a version of the
registered model whose source is the promoted S3 prefix, with the ``champion`` alias.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from kubetrain.run_store import RunStore

CONN_ID = "mlflow_default"
CHAMPION_ALIAS = "champion"


@dataclass(frozen=True)
class TrackingSettings:
    """Where and how to reach the MLflow tracking server.

    :param uri: the server's base URL (``http(s)://host:port[/path]``).
    :param username: basic auth user (with ``password``), if the server asks for one.
    :param token: a bearer token instead.
    """

    uri: str
    username: str | None = None
    password: str | None = None
    token: str | None = None

    def __post_init__(self) -> None:
        parts = urlsplit(self.uri)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(
                f"MLflow tracking URI {self.public_uri!r} is not valid: expected http(s)://host[:port] of a "
                "tracking server (kubetrain logs through its REST API, not to a local path or a database)"
            )

    @property
    def public_uri(self) -> str:
        """The URI without credentials, for logs and links."""
        return re.sub(r"//[^/@]*@", "//", self.uri).rstrip("/")

    def __repr__(self) -> str:
        return f"TrackingSettings(uri={self.public_uri!r})"


def configured() -> TrackingSettings | None:
    """The tracking server this deployment logs to, or ``None`` (then nothing is tracked)."""
    from kubetrain import settings

    uri = settings.get("mlflow_tracking_uri")
    if uri:
        return TrackingSettings(uri.rstrip("/"))
    conn = _connection(CONN_ID)
    if conn is None:
        return None
    host = (conn.host or "").strip()
    if not host:
        raise ValueError(
            f"the {CONN_ID} connection has no host: expected the tracking server, e.g. http://mlflow:5000"
        )
    if "://" not in host:
        scheme = conn.schema or "http"
        host = f"{scheme}://{host}"
    if conn.port and urlsplit(host).port is None:
        host = f"{host}:{conn.port}"
    extra = conn.extra_dejson or {}
    return TrackingSettings(
        host.rstrip("/"),
        username=conn.login or None,
        password=conn.password or None,
        token=extra.get("token") or None,
    )


def _connection(conn_id: str) -> Any | None:
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        return BaseHook.get_connection(conn_id)
    except AirflowNotFoundException:
        return None


def log_run(
    settings: TrackingSettings, store: RunStore, record: dict[str, Any], *, log: Any
) -> dict[str, Any]:
    """Log a run record to MLflow; return ``{"experiment_id", "run_id", "url", "model_version"}``."""
    from kubetrain.tracking.mlflow_rest import MlflowTracker

    return MlflowTracker(settings, store, log=log).log_run(record)
