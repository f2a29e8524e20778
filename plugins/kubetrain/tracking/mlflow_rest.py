"""MLflow's REST API (``/api/2.0/mlflow/...``), through requests, and the logging of one kubetrain run.

Why not the ``mlflow`` client: ``mlflow-skinny`` does not install beside Airflow's pins without
moving two of Airflow core's dependencies (cachetools 8 -> 7, importlib-metadata 10 -> 9) and
brings databricks-sdk, google-auth and GitPython; the few REST calls below need only requests,
which Airflow already has. Connection failures and 429/503 answers are retried by urllib3's
``Retry``; every call here is safe to repeat (runs are found again by a tag before one is
created, metric points carry fixed timestamps so MLflow drops the duplicates, model versions are
found by run before one is created).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from kubetrain.tracking import CHAMPION_ALIAS, TrackingSettings

if TYPE_CHECKING:
    import requests

    from kubetrain.run_store import RunStore

TIMEOUT = (10, 60)
MAX_PARAMS, MAX_TAGS, MAX_METRICS = 100, 100, 1000  # per log-batch request
MAX_PARAM_CHARS = 6000
RUN_KEY_TAG = "kubetrain.run_key_hash"
REPORT_FILES = ("report.html", "report.md")


class MlflowError(RuntimeError):
    """The tracking server refused a request; the message names the call and MLflow's error code."""

    def __init__(self, message: str, code: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


class MlflowRestClient:
    """The calls kubetrain makes to an MLflow tracking server.

    :param settings: the server and its credentials.
    """

    def __init__(self, settings: TrackingSettings) -> None:
        self.settings = settings

    @cached_property
    def session(self) -> requests.Session:
        import requests
        from requests.adapters import HTTPAdapter
        from urllib3.util.retry import Retry

        session = requests.Session()
        retry = Retry(
            total=5,
            connect=5,
            read=0,
            status=4,
            backoff_factor=0.5,
            status_forcelist=(429, 503),
            allowed_methods=None,
            respect_retry_after_header=True,
            raise_on_status=False,
        )
        session.mount("http://", HTTPAdapter(max_retries=retry))
        session.mount("https://", HTTPAdapter(max_retries=retry))
        if self.settings.token:
            session.headers["Authorization"] = f"Bearer {self.settings.token}"
        elif self.settings.username:
            session.auth = (self.settings.username, self.settings.password or "")
        return session

    def call(
        self,
        method: str,
        endpoint: str,
        body: dict[str, Any] | None = None,
        *,
        params: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One request to ``/api/2.0/mlflow/<endpoint>``; the decoded answer, or :class:`MlflowError`."""
        url = f"{self.settings.uri}/api/2.0/mlflow/{endpoint}"
        response = self.session.request(method, url, json=body, params=params, timeout=TIMEOUT)
        return self._answer(response, f"{method} {endpoint}")

    def _answer(self, response: requests.Response, what: str) -> dict[str, Any]:
        if response.ok:
            return response.json() if response.content else {}
        try:
            error = response.json()
        except ValueError:
            error = {"message": response.text[:500]}
        code = error.get("error_code") if isinstance(error, dict) else None
        message = error.get("message") if isinstance(error, dict) else str(error)
        raise MlflowError(
            f"MLflow at {self.settings.public_uri} refused {what}: HTTP {response.status_code} {code or ''} {message}".strip(),
            code,
            response.status_code,
        )

    def upload_artifact(self, artifact_path: str, body: bytes, content_type: str) -> None:
        """Upload through the server's artifact proxy (``mlflow-artifacts:`` artifact roots)."""
        url = f"{self.settings.uri}/api/2.0/mlflow-artifacts/artifacts/{quote(artifact_path)}"
        response = self.session.put(url, data=body, headers={"Content-Type": content_type}, timeout=TIMEOUT)
        self._answer(response, f"PUT mlflow-artifacts/{artifact_path}")

    # -- experiments and runs ------------------------------------------------------------------

    def experiment_id(self, name: str) -> str:
        """The id of the experiment ``name``, created when missing."""
        try:
            return self.call("GET", "experiments/get-by-name", params={"experiment_name": name})[
                "experiment"
            ]["experiment_id"]
        except MlflowError as exc:
            if exc.code != "RESOURCE_DOES_NOT_EXIST":
                raise
        try:
            return self.call("POST", "experiments/create", {"name": name})["experiment_id"]
        except MlflowError as exc:  # created meanwhile by another run's record step
            if exc.code != "RESOURCE_ALREADY_EXISTS":
                raise
            return self.call("GET", "experiments/get-by-name", params={"experiment_name": name})[
                "experiment"
            ]["experiment_id"]

    def find_run(self, experiment_id: str, tag: str, value: str) -> dict[str, Any] | None:
        body = {"experiment_ids": [experiment_id], "filter": f"tags.`{tag}` = '{value}'", "max_results": 1}
        runs = self.call("POST", "runs/search", body).get("runs") or []
        return runs[0] if runs else None

    def log_batch(
        self,
        run_id: str,
        *,
        params: Sequence[dict[str, Any]] = (),
        tags: Sequence[dict[str, Any]] = (),
        metrics: Sequence[dict[str, Any]] = (),
    ) -> None:
        params, tags, metrics = list(params), list(tags), list(metrics)  # sliced below, a batch at a time
        while params or tags or metrics:
            body = {
                "run_id": run_id,
                "params": params[:MAX_PARAMS],
                "tags": tags[:MAX_TAGS],
                "metrics": metrics[:MAX_METRICS],
            }
            self.call("POST", "runs/log-batch", body)
            params, tags, metrics = params[MAX_PARAMS:], tags[MAX_TAGS:], metrics[MAX_METRICS:]

    # -- the model registry --------------------------------------------------------------------

    def registered_model(self, name: str) -> None:
        try:
            self.call("POST", "registered-models/create", {"name": name})
        except MlflowError as exc:
            if exc.code != "RESOURCE_ALREADY_EXISTS":
                raise

    def model_version_of_run(self, name: str, run_id: str) -> str | None:
        found = self.call(
            "GET", "model-versions/search", params={"filter": f"name='{name}' and run_id='{run_id}'"}
        )
        versions = found.get("model_versions") or []
        return str(versions[0]["version"]) if versions else None


def _tag(key: str, value: Any) -> dict[str, str]:
    return {"key": key, "value": str(value)}


def _millis(stamp: str) -> int:
    from datetime import datetime

    return int(datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() * 1000)


def _flat(prefix: str, value: Any) -> dict[str, Any]:
    """Nested Params as ``a.b`` keys, lists as JSON."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, inner in value.items():
            out.update(_flat(f"{prefix}.{key}" if prefix else str(key), inner))
        return out
    return {prefix: value}


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= MAX_PARAM_CHARS else text[: MAX_PARAM_CHARS - 3] + "..."


class MlflowTracker:
    """Logs one kubetrain run record, with what its run left in S3, to MLflow.

    :param settings: the tracking server.
    :param store: the run store (history.csv and the report are read from the run's prefix).
    :param log: where to say what was done.
    """

    def __init__(self, settings: TrackingSettings, store: RunStore, *, log: Any) -> None:
        self.client = MlflowRestClient(settings)
        self.store = store
        self.log = log

    def log_run(self, record: dict[str, Any]) -> dict[str, Any]:
        from kubetrain.s3_layout import RunLocation

        client = self.client
        run = RunLocation.from_uri(record["run_uri"])
        key = f"{record['dag_id']}/{record['run_id']}" + (
            f"/{record['trial']}" if record.get("trial") else ""
        )
        key_hash = hashlib.sha256(key.encode()).hexdigest()[:32]
        experiment_id = client.experiment_id(record["model"])
        found = client.find_run(experiment_id, RUN_KEY_TAG, key_hash)
        start = _millis(record["run_time"])
        if found is None:
            created = client.call(
                "POST",
                "runs/create",
                {
                    "experiment_id": experiment_id,
                    "run_name": key,
                    "start_time": start,
                    "tags": [_tag(RUN_KEY_TAG, key_hash)],
                },
            )["run"]
        else:
            created = found
        info = created["info"]
        run_id = info["run_id"]
        if info.get("status") in (
            "FINISHED",
            "FAILED",
            "KILLED",
        ):  # a re-run of the same DAG run: open it again
            client.call("POST", "runs/update", {"run_id": run_id, "status": "RUNNING"})

        client.log_batch(
            run_id,
            params=self.params(record),
            tags=self.tags(record, key),
            metrics=self.metrics(record, run, start),
        )
        self.log_dataset(run_id, record)
        self.log_report(info, run, record)
        status = "FINISHED" if record["status"] == "success" else "FAILED"
        client.call(
            "POST",
            "runs/update",
            {"run_id": run_id, "status": status, "end_time": _millis(record["recorded_at"])},
        )
        model_version = self.register(record, run_id) if record["promotion"]["promoted"] else None
        url = f"{client.settings.public_uri}/#/experiments/{experiment_id}/runs/{run_id}"
        self.log.info("MLflow run %s of experiment %s: %s", run_id, record["model"], url)
        return {"experiment_id": experiment_id, "run_id": run_id, "url": url, "model_version": model_version}

    # -- what is logged ------------------------------------------------------------------------

    @staticmethod
    def params(record: dict[str, Any]) -> list[dict[str, str]]:
        """The trainer's hyperparameters, then the run's Params that they do not already name."""
        values = _flat("", record.get("hyperparameters") or {})
        for name, value in _flat("", record.get("params") or {}).items():
            values.setdefault(name, value)
        return [
            {"key": name[:250], "value": _param_value(value)}
            for name, value in sorted(values.items())
            if value is not None
        ]

    @staticmethod
    def tags(record: dict[str, Any], key: str) -> list[dict[str, str]]:
        from kubetrain.links import api_base_url

        dataset, image, promotion = record["dataset"], record["image"], record["promotion"]
        values = {
            "mlflow.runName": key,
            "mlflow.source.name": image.get("reference") or record["dag_id"],
            "kubetrain.dag_id": record["dag_id"],
            "kubetrain.run_id": record["run_id"],
            "kubetrain.trial": record.get("trial"),
            "kubetrain.status": record["status"],
            "kubetrain.run_uri": record["run_uri"],
            "kubetrain.dataset_uri": dataset.get("uri"),
            "kubetrain.dataset_version": dataset.get("version"),
            "kubetrain.image": image.get("reference"),
            "kubetrain.image_digest": image.get("digest"),
            "kubetrain.code_version": record.get("code_version"),
            "kubetrain.trainer": record.get("trainer"),
            "kubetrain.report_uri": record.get("report_uri"),
            "kubetrain.promoted": str(bool(promotion["promoted"])).lower(),
            "kubetrain.promotion_reason": promotion["reason"],
            "kubetrain.model_uri": promotion.get("model_uri") or f"{record['run_uri']}/output/",
            "kubetrain.resumed_from_step": record.get("resumed_from_step"),
            "airflow.dag_run": f"{api_base_url()}/dags/{quote(record['dag_id'], safe='')}/runs/{quote(record['run_id'], safe='')}",
        }
        if record.get("failure"):
            values["kubetrain.failure"] = f"{record['failure']['task']}: {record['failure']['error']}"[:5000]
        return [_tag(k, v) for k, v in values.items() if v not in (None, "")]

    def metrics(self, record: dict[str, Any], run: Any, start: int) -> list[dict[str, Any]]:
        """Every column of history.csv per epoch, at its step; the best value of the monitor once.

        Timestamps are fixed by the run (its time plus the epoch's wall time), so logging the
        same history again adds no duplicate points.
        """
        from kubetrain.report.inputs import parse_history

        points: list[dict[str, Any]] = []
        raw = self.store.read(run.bucket, run.key("output", "history.csv"))
        if raw is not None:
            try:
                history = parse_history(raw)
            except ValueError as exc:
                self.log.warning("history.csv of %s not logged to MLflow: %s", run.uri, exc)
                history = None
            for index, row in enumerate(history.rows if history else []):
                epoch = row.get("epoch")
                step = row.get("step")
                step = int(step) if step is not None else int(epoch if epoch is not None else index + 1)
                stamp = start + int(1000 * (row.get("wall_time_s") or (index + 1)))
                for column, value in row.items():
                    if column in ("step", "wall_time_s") or value is None or not math.isfinite(value):
                        continue
                    points.append({"key": column, "value": value, "timestamp": stamp, "step": step})
        monitor, best = record["metrics"]["monitor"], record["metrics"]["best"]
        if monitor and isinstance(best.get(monitor), int | float):
            points.append({"key": f"best_{monitor}", "value": best[monitor], "timestamp": start, "step": 0})
        return points

    def log_dataset(self, run_id: str, record: dict[str, Any]) -> None:
        dataset = record["dataset"]
        if not dataset.get("version"):
            return
        from kubetrain.manifest import dataset_name_from_uri

        try:
            name = dataset_name_from_uri(dataset["uri"]) if dataset.get("uri") else "dataset"
        except ValueError:
            name = "dataset"
        source = {"uri": dataset.get("uri"), "manifest_uri": dataset.get("manifest_uri")}
        self.client.call(
            "POST",
            "runs/log-inputs",
            {
                "run_id": run_id,
                "datasets": [
                    {
                        "tags": [_tag("mlflow.data.context", "training")],
                        "dataset": {
                            "name": name,
                            "digest": dataset["version"],
                            "source_type": "s3",
                            "source": json.dumps(source),
                        },
                    }
                ],
            },
        )

    def log_report(self, info: dict[str, Any], run: Any, record: dict[str, Any]) -> None:
        """The report files as run artifacts under ``report/``.

        An S3 artifact store gets a server-side copy (CopyObject: no bytes through Airflow);
        the server's artifact proxy (``mlflow-artifacts:``) gets the small files uploaded.
        """
        if not record.get("report_uri"):
            return
        root = str(info.get("artifact_uri") or "")
        for name in REPORT_FILES:
            source_key = run.key("report", name)
            if root.startswith("s3://"):
                from kubetrain_contract.s3uri import parse_s3_uri

                bucket, prefix = parse_s3_uri(root.rstrip("/") + "/report/" + name)
                if self.store.head(run.bucket, source_key) is None:
                    continue
                self.store.hook.copy_object(
                    source_bucket_key=source_key,
                    dest_bucket_key=prefix,
                    source_bucket_name=run.bucket,
                    dest_bucket_name=bucket,
                )
            elif root.startswith("mlflow-artifacts:"):
                body = self.store.read(run.bucket, source_key)
                if body is None:
                    continue
                from urllib.parse import urlsplit

                path = urlsplit(root).path.strip(
                    "/"
                )  # mlflow-artifacts:/<path> or mlflow-artifacts://host:port/<path>
                kind = "text/html" if name.endswith(".html") else "text/markdown"
                self.client.upload_artifact(f"{path}/report/{name}", body, kind)
            else:
                self.log.info(
                    "MLflow artifact root %s is neither S3 nor the server's proxy: report not copied", root
                )
                return

    def register(self, record: dict[str, Any], run_id: str) -> str:
        """The promoted model as a version of the registered model (source: its S3 prefix), alias ``champion``."""
        client, name = self.client, record["model"]
        promotion = record["promotion"]
        client.registered_model(name)
        version = client.model_version_of_run(name, run_id)
        if version is None:
            version = str(
                client.call(
                    "POST",
                    "model-versions/create",
                    {
                        "name": name,
                        "source": promotion["model_uri"],
                        "run_id": run_id,
                        "tags": [
                            _tag("kubetrain.version", promotion["version"]),
                            _tag("kubetrain.reason", promotion["reason"]),
                        ],
                    },
                )["model_version"]["version"]
            )
        # Runs of one model may finish out of order: only the version that models/<model>/latest names
        # becomes the champion (a later promotion's record step moves the alias on).
        pointer = self.store.models.pointer(name)
        if pointer is not None and pointer.get("version") != promotion["version"]:
            self.log.info(
                "MLflow version %s of %s registered; the champion stays with the promoted %s",
                version,
                name,
                pointer.get("version"),
            )
            return version
        client.call(
            "POST", "registered-models/alias", {"name": name, "alias": CHAMPION_ALIAS, "version": version}
        )
        self.log.info(
            "MLflow registered model %s version %s is the %s (%s)",
            name,
            version,
            CHAMPION_ALIAS,
            promotion["model_uri"],
        )
        return version
