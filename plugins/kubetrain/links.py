"""The "Training report" button on a ReportOperator task instance, served by the Airflow API server.

The report lives in the run's prefix of the training bucket, which no browser should read
directly: the bucket stays private, and S3 may not even be reachable from the user's
network (MinIO on a compose network, a VPC endpoint). The link therefore points at
``/kubetrain/reports/<dag_id>/<bucket>/<key>`` on the Airflow API server, which the user's
browser reaches by definition (the link is clicked in its UI). The route (:mod:`kubetrain.api`)
checks the viewer's Airflow login and their read access to the DAG, and streams the file from
S3 with the API server's connection; the link never expires and holds no credential.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import quote

from airflow.sdk import BaseOperatorLink

if TYPE_CHECKING:
    from airflow.sdk import BaseOperator
    from airflow.sdk.types import TaskInstanceKey

REPORT_URL_XCOM_KEY = "report_url"
URL_PREFIX = "/kubetrain"
REPORTS_PATH = "/reports"


def api_base_url() -> str:
    """The API server's public base URL (``[api] base_url``), without a trailing '/'; empty when unset."""
    from airflow.configuration import conf

    return (conf.get("api", "base_url", fallback="") or "").rstrip("/")


def report_url(dag_id: str, bucket: str, key: str, *, base_url: str | None = None) -> str:
    """The browser URL of a report file, on the Airflow API server.

    :param dag_id: the DAG the report belongs to (the viewer needs read access to it).
    :param bucket: bucket of the file.
    :param key: key of the file.
    :param base_url: the API server's public URL (default ``[api] base_url``; empty: a path on
        the UI's own origin).
    """
    base = api_base_url() if base_url is None else base_url.rstrip("/")
    return f"{base}{URL_PREFIX}{REPORTS_PATH}/{quote(dag_id, safe='')}/{quote(bucket, safe='')}/{quote(key)}"


def airflow_run_url(dag_id: str, run_id: str, *, base_url: str | None = None) -> str:
    """The browser URL of a DAG run in the Airflow 3 UI, ``<base>/dags/<dag_id>/runs/<run_id>``.

    :param dag_id: the DAG.
    :param run_id: the run.
    :param base_url: the API server's public URL (default ``[api] base_url``; empty: a path on the UI's
        own origin).
    """
    base = api_base_url() if base_url is None else base_url.rstrip("/")
    return f"{base}/dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}"


class ReportLink(BaseOperatorLink):
    """Link from a task instance to the report its ReportOperator wrote (XCom ``report_url``).

    A link carries no target: the Airflow 3 UI opens an extra link that leads to its own origin in
    its own tab, and one elsewhere in a new tab (apache/airflow#64404). The report's own pages link
    back to the DAG run, and the Training page opens reports in a new tab.
    """

    name = "Training report"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        from airflow.sdk.execution_time.xcom import XCom

        url = XCom.get_value(ti_key=ti_key, key=REPORT_URL_XCOM_KEY)
        return url if isinstance(url, str) else ""
