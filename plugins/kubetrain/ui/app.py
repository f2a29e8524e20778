"""The Training page's routes on the Airflow API server (mounted under ``/kubetrain/training``).

HTML pages, rendered here with Jinja2 (the only script is a small file served beside them),
and the JSON API they are built from::

    GET /training/                      runs, newest first (?model, dag_id, dataset_version, status, after)
    GET /training/models/<model>        leaderboard (?metric), promoted version, promotion history
    GET /training/compare?run=..&run=.. 2 to 5 runs: curves on one chart, params side by side
    GET /training/sweeps/<dag>/<run>    a sweep's trials, best first (?model, t)
    GET /training/files/<ref>           the files of a run's S3 prefix
    GET /training/api/...               the same as JSON

Every request carries the viewer's Airflow login (the UI's cookie, or a Bearer token); the
auth manager's list of DAGs the viewer may read decides which runs exist for them.
"""

from __future__ import annotations

import threading
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

# This module is imported only by the API server (kubetrain.api.create_app), where FastAPI is;
# the routes' annotations name these types, so they are module-level names.
from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response
from fastapi.responses import HTMLResponse

from kubetrain.sweep.records import runs_compute
from kubetrain.ui.queries import (
    PAGE_SIZE,
    ModelNotVisible,
    NotVisible,
    QueryError,
    RunFilter,
    TrainingQueries,
    fold_sweeps,
    parse_ref,
    sweep_time,
)

HERE = Path(__file__).parent
STATIC = {"training.css": "text/css; charset=utf-8", "training.js": "text/javascript; charset=utf-8"}
# Scripts and styles of this origin only (the page's own two files), inline SVG, nothing from elsewhere.
PAGE_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "form-action 'self'; frame-ancestors 'self'; base-uri 'none'"
)
PREFIX = "/training"


@cache
def templates() -> Any:
    """The Training page's Jinja environment; stored URLs become links only through its ``link`` filter."""
    from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape

    from kubetrain.report.render import register_filters

    env = Environment(
        loader=FileSystemLoader(HERE / "templates"),
        autoescape=select_autoescape(["html"]),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["fold_sweeps"] = fold_sweeps
    return register_filters(env)


class Links:
    """URLs the pages link to."""

    def __init__(self, base: str) -> None:
        from kubetrain.links import api_base_url

        self.base = base
        self.airflow = api_base_url()

    def airflow_run(self, run: dict[str, Any]) -> str:
        from kubetrain.links import airflow_run_url

        return airflow_run_url(str(run["dag_id"]), str(run["run_id"]), base_url=self.airflow)

    def files(self, run: dict[str, Any]) -> str:
        return f"{self.base}/files/{run['ref']}"

    def sweep(self, run: dict[str, Any]) -> str:
        query = urlencode({"model": run["model"], "t": sweep_time(run)})
        return f"{self.base}/sweeps/{quote(run['dag_id'], safe='')}/{quote(run['run_id'], safe='')}?{query}"


def trial_params(run: dict[str, Any]) -> dict[str, Any]:
    """A trial's drawn hyperparameters (the sweep's, else the trainer's)."""
    sweep = run.get("sweep") or {}
    drawn = sweep.get("params") if isinstance(sweep.get("params"), dict) else None
    return drawn if drawn is not None else dict(run.get("hyperparameters") or {})


def varied_params(runs: list[dict[str, Any]]) -> list[str]:
    """The hyperparameters whose value differs between trials (the ones a sweep varied)."""
    import json

    names = sorted({n for run in runs for n in trial_params(run)})
    return [
        n
        for n in names
        if len({json.dumps(trial_params(r).get(n), sort_keys=True, default=str) for r in runs}) > 1
    ]


_local = threading.local()
PAGE_TEMPLATES = ("runs.html", "model.html", "sweep.html", "compare.html", "files.html", "error.html")


def run_store() -> Any:
    """This worker thread's run store on the API server's S3 connection (``aws_default``)."""
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    from kubetrain.run_store import RunStore
    from kubetrain.s3_layout import S3Layout

    # One store per worker thread, kept across requests: its boto3 client keeps its connections
    # (a page reads 50 records in parallel), and boto3 resources are not shared between threads.
    layout = S3Layout.from_environment()
    store = getattr(_local, "store", None)
    if store is None or store.layout != layout:
        store = _local.store = RunStore(
            S3Hook(aws_conn_id="aws_default", config={"max_pool_connections": 16}), layout
        )
    return store


def run_index(store: Any) -> Any:
    """The run index database of the store's bucket, cached in this process (kubetrain.store.runs_db)."""
    from kubetrain.store.runs_db import cached_index

    return cached_index(store, str(store.hook.conn.meta.endpoint_url))


def warm_up() -> None:
    """Do, before the first visit, what the first page would otherwise make its viewer wait for.

    The API server calls this in a thread of its own as it starts (kubetrain.api.ReportsApp): the
    templates compiled, the S3 connection and its client made, the run index database loaded from
    its snapshot, and matplotlib imported for the comparison chart (what the first click waited for:
    bench/notes/runs_page.md). A failure here (S3 down) only leaves the work to the first page,
    which reports it.
    """
    import logging
    import time

    log = logging.getLogger(__name__)
    started = time.monotonic()
    env = templates()
    for name in PAGE_TEMPLATES:
        env.get_template(name)
    from kubetrain.store.runs_db import IndexUnavailable

    try:
        run_index(run_store()).refresh()
    except IndexUnavailable:
        pass  # no snapshot yet: the pages walk the index keys, as they will on the first visit
    except Exception as exc:  # the first page tries again and says what is wrong
        log.warning("The Training page's run index was not loaded ahead of its first visit: %s", exc)
    from matplotlib.backends import backend_svg  # noqa: F401  (the comparison chart's, ~1 s to import)
    from matplotlib.figure import Figure  # noqa: F401

    log.info("The Training page is warmed up for its first visit (%.1f s)", time.monotonic() - started)


def create_router() -> Any:
    """The routes of the Training page, as a FastAPI router for kubetrain's app."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.core_api.security import get_user

    router = APIRouter(prefix=PREFIX)

    def queries(user: Any = Depends(get_user)) -> TrainingQueries:  # noqa: B008
        readable = get_auth_manager().get_authorized_dag_ids(user=user, method="GET")
        store = run_store()
        return TrainingQueries(store, readable, run_index(store))

    def base_of(request: Request) -> str:
        return request.scope.get("root_path", "").rstrip("/") + PREFIX

    def page(
        request: Request, q: TrainingQueries, template: str, *, status: int = 200, **values: Any
    ) -> HTMLResponse:
        base = base_of(request)
        values.setdefault("models", _models(q))
        values.setdefault("section", "")
        values.setdefault("model", None)
        html = templates().get_template(template).render(base=base, links=Links(base), **values)
        return HTMLResponse(
            html,
            status_code=status,
            headers={"Content-Security-Policy": PAGE_CSP, "Cache-Control": "private, no-store"},
        )

    def _models(q: TrainingQueries) -> list[str]:
        try:
            return q.models()
        except Exception:  # the navigation must not hide the page's own answer
            return []

    def _training_dags(q: TrainingQueries, filt: RunFilter) -> list[str]:
        try:
            dags = q.training_dags()
        except Exception:  # the filter's choices must not hide the runs
            dags = list(q.dag_ids)
        if filt.dag_id and filt.dag_id not in dags:
            dags = sorted([*dags, filt.dag_id])  # the chosen filter stays shown, whatever it matches
        return dags

    def error_page(request: Request, q: TrainingQueries, exc: Exception) -> HTMLResponse:
        if isinstance(exc, NotVisible):
            return page(
                request,
                q,
                "error.html",
                status=404,
                title="Not found",
                message=f"No run {exc} that you may read.",
            )
        if isinstance(exc, ModelNotVisible):
            return page(
                request, q, "error.html", status=404, title="Not found", message=f"{str(exc).capitalize()}."
            )
        return page(request, q, "error.html", status=400, title="Bad request", message=str(exc))

    def api_error(exc: Exception) -> HTTPException:
        if isinstance(exc, NotVisible):
            return HTTPException(status_code=404, detail=f"no run {exc} that you may read")
        if isinstance(exc, ModelNotVisible):
            return HTTPException(status_code=404, detail=str(exc))
        return HTTPException(status_code=400, detail=str(exc))

    def run_filter(
        model: str | None, dag_id: str | None, dataset_version: str | None, status: str | None
    ) -> RunFilter:
        return RunFilter(
            model=model or None,
            dag_id=dag_id or None,
            dataset_version=dataset_version or None,
            status=status or None,
        )

    Q = Depends(queries)

    # -- HTML --------------------------------------------------------------------------------------

    @router.get("/", response_class=HTMLResponse)
    def runs_page(
        request: Request,
        q: TrainingQueries = Q,
        model: str | None = None,
        dag_id: str | None = None,
        dataset_version: str | None = None,
        status: str | None = None,
        after: str | None = None,
    ) -> HTMLResponse:
        try:
            filt = run_filter(model, dag_id, dataset_version, status)
            found = q.runs(filt, after=after or None)
        except QueryError as exc:
            return error_page(request, q, exc)
        params = {k: v for k, v in request.query_params.items() if k != "after" and v}
        next_url = (
            f"{base_of(request)}/?{urlencode({**params, 'after': found.next_after})}"
            if found.next_after
            else None
        )
        return page(
            request,
            q,
            "runs.html",
            title="Training runs",
            section="runs",
            filt=filt,
            page=found,
            dags=_training_dags(q, filt),
            next_url=next_url,
        )

    @router.get("/models/{model}", response_class=HTMLResponse)
    def model_page(
        request: Request, model: str, q: TrainingQueries = Q, metric: str | None = None
    ) -> HTMLResponse:
        try:
            board = q.leaderboard(model, metric=metric)
            promotions = q.promotions(model)
        except QueryError as exc:
            return error_page(request, q, exc)
        return page(
            request,
            q,
            "model.html",
            title=f"Model {model}",
            section="model",
            model=model,
            board=board,
            promotions=promotions,
        )

    @router.get("/compare", response_class=HTMLResponse)
    def compare_page(
        request: Request,
        q: TrainingQueries = Q,
        run: list[str] = Query(default=[]),  # noqa: B008
    ) -> HTMLResponse:
        from kubetrain.ui.charts import COLORS, curves_svg

        try:
            comparison = q.compare(run)
        except (QueryError, NotVisible) as exc:
            return error_page(request, q, exc)
        labels = _labels(len(comparison.runs))
        chart = curves_svg(labels, comparison.histories)
        missing = [label for label, h in zip(labels, comparison.histories, strict=True) if h is None]
        return page(
            request,
            q,
            "compare.html",
            title=f"{len(labels)} runs compared",
            comparison=comparison,
            labels=labels,
            colors=COLORS,
            chart=chart,
            missing_history=missing,
        )

    @router.get("/sweeps/{dag_id}/{run_id}", response_class=HTMLResponse)
    def sweep_page(
        request: Request, dag_id: str, run_id: str, model: str, t: str, q: TrainingQueries = Q
    ) -> HTMLResponse:
        try:
            trials = q.sweep(model=model, dag_id=dag_id, run_id=run_id, run_time=t)
        except (QueryError, NotVisible) as exc:
            return error_page(request, q, exc)
        return page(
            request,
            q,
            "sweep.html",
            title=f"Sweep {run_id}",
            dag_id=dag_id,
            run_id=run_id,
            trials=trials,
            varied=varied_params(trials),
            trial_params=trial_params,
            compute=runs_compute(trials),
        )

    @router.get("/files/{ref:path}", response_class=HTMLResponse)
    def files_page(request: Request, ref: str, q: TrainingQueries = Q) -> HTMLResponse:
        try:
            record = q.record(ref)
        except (QueryError, NotVisible) as exc:
            return error_page(request, q, exc)
        files, truncated = _files(q, record)
        return page(
            request, q, "files.html", title="Files of the run", run=record, files=files, truncated=truncated
        )

    # -- JSON ---------------------------------------------------------------------------------------

    @router.get("/api/runs")
    def runs_api(
        q: TrainingQueries = Q,
        model: str | None = None,
        dag_id: str | None = None,
        dataset_version: str | None = None,
        status: str | None = None,
        after: str | None = None,
        limit: int = PAGE_SIZE,
    ) -> dict[str, Any]:
        try:
            found = q.runs(
                run_filter(model, dag_id, dataset_version, status), after=after or None, limit=limit
            )
        except QueryError as exc:
            raise api_error(exc) from None
        return {
            "runs": found.runs,
            "next_after": found.next_after,
            "scanned": found.scanned,
            "searched_all": found.searched_all,
            "source": found.source,
        }

    @router.get("/api/models")
    def models_api(q: TrainingQueries = Q) -> dict[str, Any]:
        return {"models": q.models()}

    @router.get("/api/models/{model}/leaderboard")
    def leaderboard_api(
        model: str, q: TrainingQueries = Q, metric: str | None = None, limit: int = PAGE_SIZE
    ) -> dict[str, Any]:
        try:
            board = q.leaderboard(model, metric=metric, limit=limit)
        except QueryError as exc:
            raise api_error(exc) from None
        return {
            "model": board.model,
            "metric": board.metric,
            "mode": board.mode,
            "metrics": board.metrics,
            "promoted": board.promoted,
            "entries": board.entries,
        }

    @router.get("/api/models/{model}/promotions")
    def promotions_api(model: str, q: TrainingQueries = Q) -> dict[str, Any]:
        try:
            return {"promotions": q.promotions(model)}
        except QueryError as exc:
            raise api_error(exc) from None

    @router.get("/api/compare")
    def compare_api(q: TrainingQueries = Q, run: list[str] = Query(default=[])) -> dict[str, Any]:  # noqa: B008
        try:
            comparison = q.compare(run)
        except (QueryError, NotVisible) as exc:
            raise api_error(exc) from None
        histories = [
            {"columns": h.columns, "rows": h.rows} if h is not None else None for h in comparison.histories
        ]
        return {"runs": comparison.runs, "histories": histories, "params": comparison.params}

    @router.get("/api/sweeps/{dag_id}/{run_id}")
    def sweep_api(dag_id: str, run_id: str, model: str, t: str, q: TrainingQueries = Q) -> dict[str, Any]:
        try:
            trials = q.sweep(model=model, dag_id=dag_id, run_id=run_id, run_time=t)
        except (QueryError, NotVisible) as exc:
            raise api_error(exc) from None
        return {"trials": trials, "varied": varied_params(trials), "compute": runs_compute(trials)}

    # -- the page's own files (no login needed: they hold no data) -----------------------------------

    @router.get("/static/{name}")
    def static(name: str) -> Response:
        if name not in STATIC:
            raise HTTPException(status_code=404, detail=f"no file {name}")
        return Response(
            (HERE / "static" / name).read_bytes(),
            media_type=STATIC[name],
            headers={"Cache-Control": "public, max-age=300", "X-Content-Type-Options": "nosniff"},
        )

    return router


def _labels(count: int) -> list[str]:
    """Short names of compared runs on the chart and in the tables: A, B, C, ..."""
    return [chr(ord("A") + i) for i in range(count)]


def _files(q: TrainingQueries, record: dict[str, Any], limit: int = 500) -> tuple[list[dict[str, Any]], bool]:
    """The files under a run's prefix (not its trials'), with links to its report files."""
    from kubetrain.links import report_url
    from kubetrain.s3_layout import RunLocation

    run = RunLocation.from_uri(record["run_uri"])
    files: list[dict[str, Any]] = []
    truncated = False
    for item in q.store.list(run.bucket, run.prefix + "/"):
        rel = item["Key"][len(run.prefix) + 1 :]
        if rel.startswith("trials/") and record.get("trial") in (None, ""):
            continue
        if len(files) == limit:
            truncated = True
            break
        url = report_url(record["dag_id"], run.bucket, item["Key"]) if rel.startswith("report/") else None
        modified = item.get("LastModified")
        files.append(
            {
                "path": rel,
                "size": item.get("Size"),
                "url": url,
                "modified": modified.strftime("%Y-%m-%dT%H:%M:%SZ") if modified else "",
            }
        )
    return files, truncated


__all__ = ["create_router", "parse_ref"]
