"""Airflow plugin of kubetrain: the "Training report" link, the API server routes, and the Training page.

The Training page is an external view of the Airflow UI (Airflow 3's plugin interface, stable
since 3.1): a navigation entry whose page, served by kubetrain's FastAPI app on the API server,
the UI shows in a frame at ``/plugin/training``.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from kubetrain.api import ReportsApp
from kubetrain.links import URL_PREFIX, ReportLink

TRAINING_VIEW = {
    "name": "Training",
    # Relative to the UI's base URL (its <base href>), so a deployment under a path prefix works too.
    "href": URL_PREFIX.lstrip("/") + "/training/",
    "url_route": "training",
    "destination": "nav",
    "nav_top_level": True,
}


REPORTS_APP = ReportsApp()


class KubetrainPlugin(AirflowPlugin):
    """Makes the "Training report" link of ReportOperator tasks known, serves the reports it opens, adds the Training page."""

    name = "kubetrain"
    operator_extra_links = [ReportLink()]
    fastapi_apps = [
        {"app": REPORTS_APP, "url_prefix": URL_PREFIX, "name": "kubetrain training reports and runs"}
    ]
    # changes no request: it starts building the routes above and warming the Training page as the API
    # server starts (ReportsApp.warm_up_on_start), so that the first visit does not wait for them
    fastapi_root_middlewares = [
        {
            "middleware": REPORTS_APP.warm_up_on_start,
            "name": "kubetrain: the Training page warmed up on start",
        }
    ]
    external_views = [TRAINING_VIEW]
