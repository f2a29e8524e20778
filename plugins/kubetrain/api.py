"""kubetrain's routes on the Airflow API server: training reports and the Training page, for a logged-in viewer.

Mounted at ``/kubetrain`` by the kubetrain plugin. ``/kubetrain/training/`` is the Training page
(:mod:`kubetrain.ui.app`), which the plugin adds to the Airflow UI's navigation.

``GET /kubetrain/reports/<dag_id>/<bucket>/<key>``
answers with a report file of a run of that DAG when the DAG exists in this Airflow and the
viewer's Airflow session (the UI's cookie, or a Bearer token) may read its runs. Only files of
the report area of that DAG's runs in the training bucket are served:
``runs/<dag_id>/.../report/<file>``. A report of a DAG this Airflow does not know (one deleted
since, or another deployment's sharing the bucket) or that the viewer may not read answers as a
missing report does: the auth manager's check of a DAG id alone lets a viewer through for an id
no DAG has (multi-team mode), so the route also asks for the DAGs that exist and the viewer may read.

The report's HTML is served from Airflow's own origin, so it goes out with a Content Security
Policy that allows no scripts, no network access and no forms: it is a sandboxed document
whose only content is what the report renderer wrote (inline styles and data: images).
"""

from __future__ import annotations

import logging
import posixpath
import re
import threading
from typing import Any

from kubetrain.run_store import CONTENT_TYPES

log = logging.getLogger(__name__)
REPORT_CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; sandbox"
_REPORT_KEY = re.compile(r"^runs/(?P<dag>[^/]+)/(?:[^/]+/)+report/[^/]+$")


def allowed_report_key(dag_id: str, bucket: str, key: str) -> bool:
    """Whether ``s3://bucket/key`` is a report file of a run of ``dag_id`` in the training bucket."""
    from kubetrain.s3_layout import S3Layout, safe_segment

    if bucket != S3Layout.from_environment().training_bucket:
        return False
    if posixpath.normpath(key) != key or any(part in ("", ".", "..") for part in key.split("/")):
        return False
    match = _REPORT_KEY.match(key)
    return match is not None and match.group("dag") == safe_segment(dag_id)


def create_app() -> Any:
    """The FastAPI app of kubetrain's routes (imported only by the API server, on first use)."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
    from airflow.api_fastapi.core_api.security import get_user, requires_access_dag
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook
    from fastapi import Depends, FastAPI, HTTPException, Request, Response
    from fastapi.exception_handlers import http_exception_handler

    from kubetrain.run_store import RunStore
    from kubetrain.s3_layout import S3Layout
    from kubetrain.ui.app import create_router

    app = FastAPI(
        title="kubetrain", description="Training reports and the Training page of kubetrain's DAGs."
    )
    app.include_router(create_router())

    @app.exception_handler(HTTPException)
    async def login_first(request: Request, exc: HTTPException) -> Response:
        params = request.path_params
        if exc.status_code == 403 and {"dag_id", "bucket", "key"} <= params.keys():
            # a report of a DAG the viewer may not read answers as a missing one: the answer does not
            # tell another team's DAG ids apart from ids no DAG has
            exc = HTTPException(
                status_code=404, detail=f"no report at s3://{params['bucket']}/{params['key']}"
            )
        # A browser that opens a page without a login is sent to Airflow's, and back here after it.
        if exc.status_code == 401 and _wants_html(request):
            from fastapi.responses import RedirectResponse

            here = request.url.path
            if request.url.query:
                here += "?" + request.url.query
            return RedirectResponse(get_auth_manager().get_url_login(next_url=here), status_code=303)
        return await http_exception_handler(request, exc)

    @app.get(
        "/reports/{dag_id}/{bucket}/{key:path}",
        dependencies=[Depends(requires_access_dag(method="GET", access_entity=DagAccessEntity.RUN))],
        response_class=Response,
    )
    def report(dag_id: str, bucket: str, key: str, user: Any = Depends(get_user)) -> Response:  # noqa: B008
        if not allowed_report_key(dag_id, bucket, key):
            raise HTTPException(status_code=404, detail=f"s3://{bucket}/{key} is not a report of {dag_id}")
        # the DAGs that exist and that this user may read, as the Training page lists them
        if dag_id not in get_auth_manager().get_authorized_dag_ids(user=user, method="GET"):
            raise HTTPException(status_code=404, detail=f"no report at s3://{bucket}/{key}")
        store = RunStore(S3Hook(aws_conn_id="aws_default"), S3Layout.from_environment())
        body = store.read(bucket, key)
        if body is None:
            raise HTTPException(status_code=404, detail=f"no report at s3://{bucket}/{key}")
        suffix = key[key.rfind(".") :]
        return Response(
            body,
            media_type=CONTENT_TYPES.get(suffix, "application/octet-stream"),
            headers={
                "Content-Security-Policy": REPORT_CSP,
                "X-Content-Type-Options": "nosniff",
                "Cache-Control": "private, max-age=60",
            },
        )

    return app


def _wants_html(request: Any) -> bool:
    """A page of the Training page asked for by a browser (not the JSON API, not a report file)."""
    path = request.url.path
    accept = request.headers.get("accept", "")
    return "/training/" in path and "/training/api/" not in path and "text/html" in accept


class ReportsApp:
    """An ASGI app that builds :func:`create_app` when the API server starts, or on its first request.

    The plugin is loaded by every Airflow component; only the API server ever calls this, so
    only it imports FastAPI and the API server's security module.
    """

    def __init__(self) -> None:
        self._app: Any = None
        self._lock = threading.Lock()

    def app(self) -> Any:
        with self._lock:
            if self._app is None:
                self._app = create_app()
            return self._app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await (self._app or self.app())(scope, receive, send)

    def warm_up_on_start(self, app: Any) -> Any:
        """A root middleware of the API server's app that leaves it as it is (it returns ``app``) and
        starts a thread that builds this app and warms the Training page (:func:`kubetrain.ui.app.warm_up`).

        Starlette makes its middleware when the server starts (the lifespan's first event), so the
        first click on "Training" finds the page ready instead of waiting seconds for imports, the
        S3 client and the run index. Mounted apps get no lifespan events of their own.
        """

        def warm() -> None:
            try:
                self.app()
                from kubetrain.ui.app import warm_up

                warm_up()
            except Exception:  # the first request builds what is missing, and reports what fails
                log.warning("kubetrain's routes were not warmed up on start", exc_info=True)

        threading.Thread(target=warm, name="kubetrain-warm-up", daemon=True).start()
        return app
