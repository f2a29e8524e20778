"""Airflow plugin of kubetrain: registers the operator extra link to training reports."""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from kubetrain.links import ReportLink


class KubetrainPlugin(AirflowPlugin):
    """Makes the "Training report" link of ReportOperator tasks known to the API server."""

    name = "kubetrain"
    operator_extra_links = [ReportLink()]
