"""Airflow plugin of kubetrain: the "Training report" link and the API server route that serves reports."""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from kubetrain.api import ReportsApp
from kubetrain.links import URL_PREFIX, ReportLink


class KubetrainPlugin(AirflowPlugin):
    """Makes the "Training report" link of ReportOperator tasks known, and serves the reports it opens."""

    name = "kubetrain"
    operator_extra_links = [ReportLink()]
    fastapi_apps = [{"app": ReportsApp(), "url_prefix": URL_PREFIX, "name": "kubetrain training reports"}]
