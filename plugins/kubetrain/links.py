"""The "Training report" button on a ReportOperator task instance in the Airflow UI."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING
from urllib.parse import quote

from airflow.sdk import BaseOperatorLink

if TYPE_CHECKING:
    from airflow.models.taskinstancekey import TaskInstanceKey
    from airflow.sdk import BaseOperator

REPORT_URL_XCOM_KEY = "report_url"


def report_url(bucket: str, key: str, *, endpoint_url: str | None = None, region: str | None = None) -> str:
    """A browser URL for an object of the report.

    ``KUBETRAIN_S3_PUBLIC_URL`` (e.g. a MinIO console or a reverse proxy) wins, then the S3
    connection's own endpoint (path-style ``<endpoint>/<bucket>/<key>``); on AWS itself the
    object's page in the S3 console, which works for anyone logged in to the account.

    :param bucket: bucket of the object.
    :param key: key of the object.
    :param endpoint_url: the S3 endpoint of the Airflow connection, if it has one.
    :param region: AWS region, for the console URL.
    """
    base = os.environ.get("KUBETRAIN_S3_PUBLIC_URL") or endpoint_url
    if base:
        return f"{base.rstrip('/')}/{bucket}/{quote(key)}"
    region_part = f"region={quote(region)}&" if region else ""
    return f"https://s3.console.aws.amazon.com/s3/object/{bucket}?{region_part}prefix={quote(key, safe='')}"


class ReportLink(BaseOperatorLink):
    """Link from a task instance to the report its ReportOperator wrote (XCom ``report_url``)."""

    name = "Training report"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        from airflow.providers.common.compat.sdk import XCom

        url = XCom.get_value(ti_key=ti_key, key=REPORT_URL_XCOM_KEY)
        return url if isinstance(url, str) else ""
