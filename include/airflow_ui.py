"""A local Airflow (API server + UI, scheduler, DAG processor, triggerer) against the dev stack.

What `airflow standalone` does, with the knobs a shared dev machine and the tests need: a
chosen port and home, the dev stack's connections, a generated password for the
SimpleAuthManager ``admin`` user, LocalExecutor with a small parallelism, one JWT secret
shared by all components, and every component in a process group of its own so that
stopping (``with`` exit, Ctrl-C, SIGTERM) leaves no process behind.

The metadata DB is a database of the dev stack's Postgres (include/devstack/postgres.py;
``KUBETRAIN_POSTGRES_URL`` and ``PGPASSFILE`` in the stack's env): four components write it at
once, which SQLite serves only by making them wait on its lock (the trigger form's unpause then
failed after 5 s). Each home gets its own database, named in ``<home>/postgres-database``,
copied from a template migrated once per Airflow version. SQLite (``<home>/airflow.db``,
``seed_db``) remains for the API server alone (``api_server_only``), a single process.

    with AirflowUI(home, stack_env, port=8080) as ui:
        print(ui.url, ui.username, ui.password)
        run_id = ui.trigger("train_image_classifier", {"epochs": 2})
        ui.wait_run("train_image_classifier", run_id, timeout=600)

Standard library only, so that it imports in any environment; the components run from
the Airflow environment (.venv).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
import sqlite3
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from include.devstack import postgres
from include.devstack.stack import free_port

REPO = Path(__file__).resolve().parents[1]
AIRFLOW = REPO / ".venv" / "bin" / "airflow"
COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
SIMPLE_AUTH_MANAGER = "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager"
TERMINAL_RUN_STATES = ("success", "failed")
USERNAME = "admin"


class AirflowUIError(RuntimeError):
    """A component did not start, died, or the API answered with an error."""


class AirflowUI:
    """Start and stop a local Airflow whose components share ``home`` and the dev stack's connections.

    :param home: the Airflow home (the name of its Postgres database, logs, the passwords file, component logs).
    :param stack_env: the dev stack's variables (``Stack.env()``): connections, KUBECONFIG, its Postgres, ...
    :param port: API server port (the UI is at ``http://<host>:<port>``).
    :param host: address the API server binds to (``0.0.0.0``: every interface).
    :param seed_db: without Postgres in ``stack_env`` (the API server alone): a migrated SQLite
        metadata DB copied to ``home/airflow.db`` when that is missing; unused with Postgres.
    :param parallelism: task slots of the LocalExecutor (and per DAG); keep it near the core count.
    :param pool_slots: slots of the ``gpu`` pool that training pods take.
    :param paused_at_creation: whether DAGs new to this metadata DB start paused
        (``None``: Airflow's configuration decides).
    :param dags_folder: the DAGs to load.
    :param env: more environment for every component (wins over everything above).
    """

    def __init__(
        self,
        home: Path | str,
        stack_env: Mapping[str, str],
        *,
        port: int = 8080,
        host: str = "127.0.0.1",
        seed_db: Path | str | None = None,
        parallelism: int = 4,
        pool_slots: int = 2,
        paused_at_creation: bool | None = None,
        dags_folder: Path | str = REPO / "dags",
        env: Mapping[str, str] | None = None,
    ) -> None:
        if not 0 < port < 65536:
            raise ValueError(f"port={port} is not valid: expected 1..65535")
        if parallelism < 1:
            raise ValueError(f"parallelism={parallelism} is not valid: expected at least 1")
        if pool_slots < 1:
            raise ValueError(f"pool_slots={pool_slots} is not valid: expected at least 1")
        self.home = Path(home).resolve()
        self.stack_env = dict(stack_env)
        self.port = port
        self.host = host
        self.seed_db = Path(seed_db) if seed_db else None
        self.parallelism = parallelism
        self.pool_slots = pool_slots
        self.paused_at_creation = paused_at_creation
        self.dags_folder = Path(dags_folder).resolve()
        self.extra_env = dict(env or {})
        self.postgres = postgres.Server.from_env(self.stack_env)
        self.procs: dict[str, subprocess.Popen] = {}
        self.started_at: datetime | None = None
        self._token: str | None = None
        # The scheduler and the triggerer serve task logs on fixed ports by default; another
        # Airflow on this machine (a test, a second checkout) must not collide with them.
        worker_log_port = free_port()
        trigger_log_port = free_port()
        while trigger_log_port == worker_log_port:
            trigger_log_port = free_port()
        self._log_ports = (worker_log_port, trigger_log_port)

    # -- what a user needs to know -----------------------------------------------------------

    @property
    def url(self) -> str:
        # Bound to every interface, it is still reached from this machine through the loopback.
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def username(self) -> str:
        return USERNAME

    @property
    def passwords_file(self) -> Path:
        return self.home / "simple_auth_manager_passwords.json"

    @property
    def password(self) -> str:
        """The ``admin`` password, generated on first use and kept in the home (mode 0600)."""
        path = self.passwords_file
        if path.exists():
            stored = json.loads(path.read_text()).get(USERNAME)
            if isinstance(stored, str) and stored:
                return stored
        self.home.mkdir(parents=True, exist_ok=True)
        password = secrets.token_urlsafe(12)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump({USERNAME: password}, out)
        return password

    @property
    def db(self) -> Path:
        """The SQLite metadata DB (the API server alone, without the dev stack's Postgres)."""
        return self.home / "airflow.db"

    @property
    def database_file(self) -> Path:
        return self.home / "postgres-database"

    @property
    def database(self) -> str | None:
        """This home's database on the dev stack's Postgres (None before ``start`` made it, or without Postgres)."""
        if self.postgres is None or not self.database_file.exists():
            return None
        return self.database_file.read_text().strip() or None

    def sql_alchemy_conn(self) -> str:
        if self.postgres is None:
            return f"sqlite:///{self.db}"
        database = self.database
        if database is None:
            raise AirflowUIError(f"{self.home} has no Postgres database yet: start() makes it")
        return self.postgres.sqlalchemy_url(database)

    def log_path(self, component: str) -> Path:
        return self.home / "logs" / f"{component}.log"

    def env(self, sql_alchemy_conn: str | None = None) -> dict[str, str]:
        """The environment every component (and an ``airflow`` CLI call against this instance) gets.

        :param sql_alchemy_conn: another metadata DB than this home's (the template, while it is migrated).
        """
        env = {
            **os.environ,
            **self.stack_env,
            "AIRFLOW_HOME": str(self.home),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": sql_alchemy_conn or self.sql_alchemy_conn(),
            "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags_folder),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": str(self.parallelism),
            "AIRFLOW__CORE__MAX_ACTIVE_TASKS_PER_DAG": str(self.parallelism),
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
            "AIRFLOW__CORE__AUTH_MANAGER": SIMPLE_AUTH_MANAGER,
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{USERNAME}:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(self.passwords_file),
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
            "AIRFLOW__API__HOST": self.host,
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__API__BASE_URL": self.url,
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(self.home / "logs"),
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(self._log_ports[0]),
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(self._log_ports[1]),
            # Two cores run four components and the training pods: parse with one process,
            # and look for new DAG files every 30 s instead of 5 min.
            "AIRFLOW__DAG_PROCESSOR__PARSING_PROCESSES": "1",
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "30",
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
        }
        # The API server signs the tokens that the workers present to the execution API; every
        # component must hold the same secret.
        env["AIRFLOW__API_AUTH__JWT_SECRET"] = self._jwt_secret()
        if self.postgres is not None:
            env.update(self.postgres.env())
        if self.paused_at_creation is not None:
            env["AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION"] = str(self.paused_at_creation)
        env.update(self.extra_env)
        return env

    def _jwt_secret(self) -> str:
        path = self.home / "jwt_secret"
        if not path.exists():
            self.home.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_urlsafe(32))
        return path.read_text().strip()

    # -- start / stop --------------------------------------------------------------------------

    def __enter__(self) -> AirflowUI:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 180) -> None:
        """Start the four components and wait until the API reports all of them healthy."""
        if self.procs:
            raise AirflowUIError("this Airflow is already started")
        if not AIRFLOW.exists():
            raise AirflowUIError(f"{AIRFLOW} is missing: run `make setup`")
        with socket.socket() as sock:
            if sock.connect_ex((urllib.parse.urlsplit(self.url).hostname, self.port)) == 0:
                raise AirflowUIError(f"port {self.port} is in use: another Airflow or server listens there")
        if self.postgres is None:
            raise AirflowUIError(
                "the scheduler, DAG processor, triggerer and API server need the dev stack's Postgres "
                "(KUBETRAIN_POSTGRES_URL and PGPASSFILE in stack_env): start the stack with `make stack-up`, "
                "or restart one started before it had Postgres (`make stack-down stack-up`)"
            )
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "logs").mkdir(exist_ok=True)
        self.prepare_database()
        _ = self.password  # written before the API server reads the passwords file
        env = self.env()
        self.started_at = datetime.now(UTC)
        try:
            for name in COMPONENTS:
                self._spawn(name, env)
            self.wait_healthy(timeout)
            self.ensure_pool("gpu", self.pool_slots, "GPU training pods")
        except BaseException:
            self.stop()
            raise

    def prepare_database(self) -> None:
        """Make sure the metadata DB exists: with Postgres, this home's database (copied from the
        migrated template, made first when this Airflow version has none); else ``home/airflow.db``
        from ``seed_db``."""
        (self.home / "logs").mkdir(parents=True, exist_ok=True)
        if self.postgres is None:
            if not self.db.exists():
                if self.seed_db is None or not self.seed_db.exists():
                    raise AirflowUIError(
                        f"no metadata DB at {self.db} and no migrated DB to copy (seed_db={self.seed_db}): "
                        "run `make setup`, which migrates .airflow/airflow.db"
                    )
                copy_metadata_db(self.seed_db, self.db, pause_dags=bool(self.paused_at_creation))
            return
        server = self.postgres
        try:
            with server.lock():
                databases = server.databases()
                if self.database in databases:
                    return
                # Databases of homes that are gone (a test's or a benchmark's temporary Airflow) go too.
                for name, comment in databases.items():
                    if name.startswith("airflow_home_") and comment and not _names(Path(comment), name):
                        server.drop(name)
                template = server.template(_template_name(), self._migrate)
                name = f"airflow_home_{secrets.token_hex(6)}"
                server.create(name, template, comment=str(self.home))
                self.database_file.write_text(name + "\n")
        except postgres.PostgresError as exc:
            raise AirflowUIError(f"the metadata DB for {self.home} could not be made: {exc}") from None

    def _migrate(self, url: str) -> None:
        """``airflow db migrate`` into the database at ``url`` (the template, once per Airflow version)."""
        log = self.home / "logs" / "migrate.log"
        env = self.env(sql_alchemy_conn=url)
        with open(log, "ab") as out:
            proc = subprocess.run(
                [str(AIRFLOW), "db", "migrate"], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT
            )
        if proc.returncode != 0:
            tail = log.read_text(errors="replace")[-3000:]
            raise AirflowUIError(f"airflow db migrate failed ({proc.returncode}); end of {log}:\n{tail}")

    def _spawn(self, name: str, env: Mapping[str, str]) -> None:
        argv = [str(AIRFLOW), name]
        if name == "api-server":
            argv += ["--host", self.host, "--port", str(self.port)]
        with open(self.log_path(name), "ab") as out:
            self.procs[name] = subprocess.Popen(
                argv,
                cwd=REPO,
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stopped with everything it forks
                preexec_fn=_die_with_parent,
            )

    @contextlib.contextmanager
    def api_server_only(self, timeout: float = 240) -> Iterator[AirflowUI]:
        """Run the API server alone (no scheduler, triggerer or DAG processor) on this home's DB until
        the block ends; it is up once ``/api/v2/monitor/health`` answers.

        For tests of what reads the REST API (the Training page's permissions, the preflight's pool).

        :param timeout: seconds the server may take to answer.
        """
        self.prepare_database()
        _ = self.password  # written before the API server reads the passwords file
        self._spawn("api-server", self.env())
        try:
            deadline = time.monotonic() + timeout
            while True:
                self.check_alive()
                try:
                    with urllib.request.urlopen(f"{self.url}/api/v2/monitor/health", timeout=5):
                        break
                except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                    pass
                if time.monotonic() > deadline:
                    tail = self.log_path("api-server").read_text(errors="replace")[-3000:]
                    raise AirflowUIError(f"the API server did not answer within {timeout:.0f} s: {tail}")
                time.sleep(1)
            yield self
        finally:
            self.stop()

    def restart(self, component: str, *, sig: int = signal.SIGKILL, timeout: float = 180) -> None:
        """Kill one component (its whole process group, task processes included) with ``sig`` and start
        it again, as a supervisor restarts a crashed process; return once Airflow reports it healthy.

        :param component: one of ``COMPONENTS``.
        :param sig: the signal that ends it (SIGKILL: a crash, nothing is cleaned up).
        :param timeout: seconds to wait for the new process to be healthy.
        """
        if component not in self.procs:
            raise AirflowUIError(
                f"{component!r} is not a running component: expected one of {', '.join(self.procs)}"
            )
        proc = self.procs[component]
        strays = _descendants({proc.pid})
        _signal_group(proc.pid, sig)
        for pid in strays:
            _signal_pid(pid, sig)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait(10)
        self._spawn(component, self.env())
        self.wait_healthy(timeout)

    def stop(self, grace: float = 20) -> None:
        """SIGTERM every component's process group (and strays), SIGKILL what is left after ``grace`` s."""
        if not self.procs:
            return
        pids = {p.pid for p in self.procs.values()}
        groups = set(pids)
        # Task processes may start sessions of their own; find them while their parents live.
        strays = _descendants(pids)
        for pgid in groups:
            _signal_group(pgid, signal.SIGTERM)
        for pid in strays:
            _signal_pid(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            for proc in self.procs.values():
                proc.poll()
            if not any(_group_alive(g) for g in groups) and not any(_alive(p) for p in strays):
                break
            time.sleep(0.2)
        for pgid in groups:
            _signal_group(pgid, signal.SIGKILL)
        for pid in strays:
            _signal_pid(pid, signal.SIGKILL)
        for proc in self.procs.values():
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()
        self._token = None

    def check_alive(self) -> None:
        """Raise when a component has exited, naming it and quoting its log."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = self.log_path(name).read_text(errors="replace")[-3000:]
                raise AirflowUIError(f"airflow {name} exited with {proc.returncode}; end of its log:\n{tail}")

    def wait_healthy(self, timeout: float = 180) -> dict[str, Any]:
        """Wait until ``/api/v2/monitor/health`` reports the DB, scheduler, triggerer and DAG processor healthy."""
        deadline = time.monotonic() + timeout
        health: dict[str, Any] = {}
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                with urllib.request.urlopen(f"{self.url}/api/v2/monitor/health", timeout=5) as resp:
                    health = json.loads(resp.read())
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError):
                time.sleep(0.5)
                continue
            parts = ("metadatabase", "scheduler", "triggerer", "dag_processor")
            if all((health.get(p) or {}).get("status") == "healthy" for p in parts):
                return health
            time.sleep(0.5)
        raise AirflowUIError(f"Airflow at {self.url} was not healthy within {timeout:.0f} s: {health}")

    # -- REST API ------------------------------------------------------------------------------

    def token(self) -> str:
        """A JWT for the REST API, from the SimpleAuthManager's ``/auth/token``."""
        if self._token is None:
            body = self._request(
                "POST", "/auth/token", {"username": self.username, "password": self.password}, auth=False
            )
            self._token = body["access_token"]
        return self._token

    def api(self, method: str, path: str, body: Any = None) -> Any:
        """Call ``/api/v2<path>`` with a JWT and return the decoded JSON answer."""
        return self._request(method, "/api/v2" + path, body, auth=True)

    def _request(self, method: str, path: str, body: Any, *, auth: bool) -> Any:
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if auth:
            headers["Authorization"] = f"Bearer {self.token()}"
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            # A loaded machine's API server can take tens of seconds to answer (its first seconds
            # also import the Training page's warm-up): the callers' deadlines decide, not this one.
            with urllib.request.urlopen(req, timeout=120) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:1000]
            raise AirflowUIError(
                f"{method} {path} answered {exc.code}: {detail}{self._logged_error(detail)}"
            ) from None
        return json.loads(raw) if raw else None

    def _logged_error(self, detail: str) -> str:
        """The API server's log record of a database error it answered with only an ID (500s hide
        the statement and its traceback unless ``[api] expose_stacktrace``), for failure messages."""
        found = re.search(r"look for ID (\w+)", detail)
        log = self.log_path("api-server")
        if not found or not log.exists():
            return ""
        lines = log.read_text(errors="replace").splitlines()
        start = next((i for i, line in enumerate(lines) if f"Error with id {found[1]}" in line), None)
        if start is None:
            return ""
        return f"\nthe API server logged ({log}):\n" + "\n".join(lines[start : start + 40])

    def ensure_pool(self, name: str, slots: int, description: str, include_deferred: bool = True) -> None:
        """Create the pool, or set its slots when it exists (what ``airflow pools set`` does).

        Deferred tasks count by default: a deferred training task still holds its pod, and its GPU.
        """
        body = {
            "name": name,
            "slots": slots,
            "description": description,
            "include_deferred": include_deferred,
        }
        try:
            self.api("PATCH", f"/pools/{urllib.parse.quote(name)}", body)
        except AirflowUIError as exc:
            if " 404:" not in str(exc):
                raise
            self.api("POST", "/pools", body)

    def wait_dags(self, dag_ids: Iterable[str], timeout: float = 120) -> None:
        """Wait until this instance's DAG processor has parsed every DAG in ``dag_ids``.

        A DAG already in a copied metadata DB counts only once it is parsed again, with this
        instance's environment.
        """
        wanted = set(dag_ids)
        since = self.started_at or datetime.now(UTC)
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            found = {
                d["dag_id"]
                for d in self.api("GET", "/dags?limit=100")["dags"]
                if d.get("last_parsed_time") and datetime.fromisoformat(d["last_parsed_time"]) >= since
            }
            if wanted <= found:
                return
            if time.monotonic() > deadline:
                errors = self.api("GET", "/importErrors?limit=20").get("import_errors", [])
                detail = "; ".join(f"{e.get('filename')}: {str(e.get('stack_trace'))[-500:]}" for e in errors)
                raise AirflowUIError(
                    f"DAGs {sorted(wanted - found)} not loaded within {timeout:.0f} s. {detail}"
                )
            time.sleep(1)

    def set_paused(self, dag_id: str, paused: bool) -> None:
        self.api("PATCH", f"/dags/{dag_id}", {"is_paused": paused})

    def set_run_state(self, dag_id: str, run_id: str, state: str) -> None:
        """Mark a run ``failed``, ``success`` or ``queued``, as the UI's buttons do.

        Marking a run rewrites its task instances while the scheduler, and a task starting or
        ending, may write the same rows: Postgres can pick the API server's transaction as a
        deadlock's victim, which it answers with a 500 "Database error" (CI saw one). Airflow's
        own components retry such a transaction; so does this, up to five times."""
        import tenacity

        retry = tenacity.Retrying(
            retry=tenacity.retry_if_exception(
                lambda exc: (
                    isinstance(exc, AirflowUIError)
                    and "answered 500" in str(exc)
                    and '"Database error"' in str(exc)
                )
            ),
            wait=tenacity.wait_exponential(multiplier=0.5, max=8),
            stop=tenacity.stop_after_attempt(5),
            reraise=True,
        )
        path = f"/dags/{dag_id}/dagRuns/{urllib.parse.quote(run_id, safe='')}"
        retry(self.api, "PATCH", path, {"state": state})

    def trigger(self, dag_id: str, conf: Mapping[str, Any] | None = None) -> str:
        """Trigger a manual run now; return its run id."""
        run = self.api("POST", f"/dags/{dag_id}/dagRuns", {"logical_date": None, "conf": dict(conf or {})})
        return run["dag_run_id"]

    def runs(self, dag_id: str) -> list[dict[str, Any]]:
        """All runs of ``dag_id``, oldest first."""
        return self.api("GET", f"/dags/{dag_id}/dagRuns?limit=100&order_by=id")["dag_runs"]

    def task_instances(self, dag_id: str, run_id: str) -> dict[str, dict[str, Any]]:
        """The run's task instances by task id (mapped ones as ``task[i]``)."""
        body = self.api(
            "GET", f"/dags/{dag_id}/dagRuns/{urllib.parse.quote(run_id, safe='')}/taskInstances?limit=100"
        )
        return {
            (ti["task_id"] if ti.get("map_index", -1) < 0 else f"{ti['task_id']}[{ti['map_index']}]"): ti
            for ti in body["task_instances"]
        }

    def task_errors(self, dag_id: str, run_id: str, task_id: str, limit: int = 3) -> list[str]:
        """The error lines of the latest attempt's log of a task (``exc_type: message``), for failure messages."""
        folder = self.home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}" / f"task_id={task_id}"
        attempts = (
            sorted(
                (
                    p for p in folder.glob("attempt=*.log") if p.stem.split("=")[1].isdigit()
                ),  # not attempt=3.log.trigger.2.log
                key=lambda p: int(p.stem.split("=")[1]),
            )
            if folder.is_dir()
            else []
        )
        errors: list[str] = []
        for line in attempts[-1].read_text(errors="replace").splitlines() if attempts else []:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if not isinstance(record, dict) or record.get("level") not in ("error", "critical"):
                continue
            details = [
                f"{d.get('exc_type')}: {str(d.get('exc_value'))[:300]}"
                for d in record.get("error_detail") or []
            ]
            errors.append(f"{record.get('event')}" + (f" ({'; '.join(details)})" if details else ""))
        return errors[-limit:]

    def wait_run(
        self, dag_id: str, run_id: str, timeout: float = 600, states: Iterable[str] = TERMINAL_RUN_STATES
    ) -> dict[str, Any]:
        """Wait until the run is in one of ``states``; return the run. Raise naming the task states on timeout."""
        wanted = set(states)
        deadline = time.monotonic() + timeout
        quoted = urllib.parse.quote(run_id, safe="")
        while True:
            self.check_alive()
            run = self.api("GET", f"/dags/{dag_id}/dagRuns/{quoted}")
            if run["state"] in wanted:
                return run
            if time.monotonic() > deadline:
                tis = {k: v["state"] for k, v in self.task_instances(dag_id, run_id).items()}
                raise AirflowUIError(
                    f"{dag_id} run {run_id} is {run['state']} after {timeout:.0f} s; tasks: {tis}"
                )
            time.sleep(2)


def _template_name() -> str:
    """The template database of the Airflow in .venv (``airflow_template_3_3_2``): one per version."""
    site = REPO / ".venv" / "lib"
    found = sorted(site.glob("python3*/site-packages/apache_airflow-*.dist-info"))
    if not found:
        raise AirflowUIError(f"no Airflow installed under {site}: run `make setup`")
    version = found[-1].name[len("apache_airflow-") : -len(".dist-info")]
    return "airflow_template_" + re.sub(r"[^a-z0-9]+", "_", version.lower())


def _names(home: Path, database: str) -> bool:
    """Whether ``home`` still exists and names ``database`` as its own."""
    try:
        return (home / "postgres-database").read_text().strip() == database
    except OSError:
        return False


def copy_metadata_db(source: Path | str, dest: Path | str, *, pause_dags: bool) -> None:
    """Copy a migrated SQLite metadata DB for a new Airflow home.

    The copy is a consistent snapshot even while another Airflow writes ``source``. Runs that
    were unfinished there belong to that Airflow; they and their tasks are marked failed here
    (their triggers and queued Asset events dropped) so that this scheduler and triggerer do
    not pick them up. With ``pause_dags``, every DAG starts paused, as DAGs
    new to a home do under ``dags_are_paused_at_creation``.
    """
    dest = Path(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.unlink(missing_ok=True)
    src = sqlite3.connect(f"file:{source}?mode=ro", uri=True)
    try:
        out = sqlite3.connect(tmp)
        try:
            src.backup(out)
            with out:
                out.execute("UPDATE dag_run SET state = 'failed' WHERE state NOT IN ('success', 'failed')")
                out.execute(
                    "UPDATE task_instance SET state = 'failed', trigger_id = NULL "
                    "WHERE state IN ('scheduled', 'queued', 'running', 'deferred', 'up_for_retry', 'up_for_reschedule', 'restarting')"
                )
                out.execute("DELETE FROM trigger")  # their deferred tasks wait on that other Airflow's pods
                out.execute("DELETE FROM asset_dag_run_queue")  # runs that Airflow was about to create
                # Which assets are active is derived from the DAG files; this DAG processor decides it
                # anew, so an asset whose URI changed since the copied parse is not shadowed by it.
                out.execute("DELETE FROM asset_active")
                if pause_dags:
                    out.execute("UPDATE dag SET is_paused = 1")
        finally:
            out.close()
    finally:
        src.close()
    tmp.replace(dest)


# -- processes ---------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the starting process dies, however it dies.

    A test run or `make airflow` killed without a chance to clean up must not leave a
    scheduler running; the component's own shutdown then stops what it started.
    """
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: stop() still cleans up
        pass


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name may hold spaces and parentheses; the fields after the last ')' do not.
        fields = stat[stat.rfind(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def _descendants(roots: Iterable[int]) -> set[int]:
    if not Path("/proc").is_dir():
        return set()
    children = _children_map()
    found: set[int] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except OSError:
        pass


def _signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except OSError:
        return False
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie child of ours counts as gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
