"""End-to-end fixtures: real DAG runs through `airflow dags test` against the dev stack.

``airflow`` gives a per-session Airflow home (a copy of the migrated metadata DB) and runs
DAGs in a subprocess exactly as a user would, with the dev stack's connections from its
env file. Task states and XComs are read back from the metadata DB.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from ui_support import airflow_ui, chromium_page

REPO = Path(__file__).resolve().parents[2]
AIRFLOW = REPO / ".venv" / "bin" / "airflow"


@dataclass
class DagRunResult:
    dag_id: str
    run_id: str | None
    returncode: int
    output: str
    db: Path
    log: Path = field(repr=False)

    def task_states(self) -> dict[str, str]:
        with sqlite3.connect(self.db) as conn:
            rows = conn.execute(
                "SELECT task_id, map_index, state FROM task_instance WHERE dag_id = ? AND run_id = ?",
                (self.dag_id, self.run_id),
            ).fetchall()
        return {(t if m < 0 else f"{t}[{m}]"): s for t, m, s in rows}

    def state(self) -> str | None:
        with sqlite3.connect(self.db) as conn:
            row = conn.execute(
                "SELECT state FROM dag_run WHERE dag_id = ? AND run_id = ?", (self.dag_id, self.run_id)
            ).fetchone()
        return row[0] if row else None

    def xcom(self, task_id: str, key: str = "return_value", map_index: int = -1):
        with sqlite3.connect(self.db) as conn:
            row = conn.execute(
                "SELECT value FROM xcom WHERE dag_id = ? AND run_id = ? AND task_id = ? AND key = ? AND map_index = ?",
                (self.dag_id, self.run_id, task_id, key, map_index),
            ).fetchone()
        if row is None:
            raise KeyError(f"no XCom {key!r} from {self.dag_id}.{task_id} in run {self.run_id}")
        value = row[0]
        return json.loads(value) if isinstance(value, str | bytes) else value

    def try_numbers(self, task_id: str) -> int:
        with sqlite3.connect(self.db) as conn:
            row = conn.execute(
                "SELECT try_number FROM task_instance WHERE dag_id = ? AND run_id = ? AND task_id = ?",
                (self.dag_id, self.run_id, task_id),
            ).fetchone()
        return row[0] if row else 0


class AirflowRunner:
    """Runs DAGs with `airflow dags test` in an isolated Airflow home."""

    def __init__(self, home: Path, stack_env: dict[str, str], dags_folder: Path):
        self.home = home
        self.stack_env = stack_env
        self.dags_folder = dags_folder
        self.db = home / "airflow.db"

    def env(self, **extra: str) -> dict[str, str]:
        return {
            **os.environ,
            **self.stack_env,
            "AIRFLOW_HOME": str(self.home),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{self.db}",
            "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags_folder),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(self.home / "logs"),
            "PYTHONPATH": str(REPO),
            **extra,
        }

    def cli(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(AIRFLOW), *args],
            env=self.env(),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
        )

    def dags_test(
        self,
        dag_id: str,
        conf: dict | None = None,
        timeout: float = 900,
        *,
        whole_folder: bool = False,
        **env: str,
    ) -> DagRunResult:
        """``airflow dags test dag_id``. The DAG's own file (``<dag_id>.py``, file name == dag_id) is
        the only one in the dags folder that run sees, unless ``whole_folder`` or there is no such
        file: `dags test` parses and serializes its whole bundle twice (once to find the DAG, once in
        ``DAG.test``), which costs seconds per run for DAGs the run never uses."""
        before = self._run_ids(dag_id)
        log = self.home / f"{dag_id}-{len(before)}.log"
        args = [str(AIRFLOW), "dags", "test", dag_id]
        if conf is not None:
            args += ["-c", json.dumps(conf)]
        folder = self.dags_folder if whole_folder else self._folder_of(dag_id)
        with open(log, "w") as out:
            proc = subprocess.run(
                args,
                env=self.env(**{"AIRFLOW__CORE__DAGS_FOLDER": str(folder), **env}),
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
        new = [r for r in self._run_ids(dag_id) if r not in before]
        return DagRunResult(
            dag_id, new[-1] if new else None, proc.returncode, log.read_text(errors="replace"), self.db, log
        )

    def _folder_of(self, dag_id: str) -> Path:
        """A dags folder holding only a link to ``dag_id``'s file (the whole folder if it has none)."""
        source = self.dags_folder / f"{dag_id}.py"
        if not source.is_file():
            return self.dags_folder
        tag = hashlib.sha256(str(self.dags_folder.resolve()).encode()).hexdigest()[:12]
        folder = self.home / "dag-files" / tag / dag_id
        link = folder / source.name
        if not link.is_symlink():
            folder.mkdir(parents=True, exist_ok=True)
            link.symlink_to(source.resolve())  # a link, so that Path(__file__).resolve() finds the repository
        return folder

    def _run_ids(self, dag_id: str) -> list[str]:
        with sqlite3.connect(self.db) as conn:
            try:
                rows = conn.execute(
                    "SELECT run_id FROM dag_run WHERE dag_id = ? ORDER BY id", (dag_id,)
                ).fetchall()
            except sqlite3.OperationalError:
                return []
        return [r[0] for r in rows]


def make_airflow_home(tmp: Path) -> Path:
    """A private Airflow home whose DB is a copy of the one `make setup` migrated."""
    source = Path(os.environ.get("AIRFLOW_HOME", REPO / ".airflow")) / "airflow.db"
    if not source.exists():
        pytest.fail(f"{source} is missing: run `make setup` (it migrates the Airflow metadata DB)")
    tmp.mkdir(parents=True, exist_ok=True)
    shutil.copy(source, tmp / "airflow.db")
    return tmp


@pytest.fixture(scope="session", autouse=True)
def dev_images(stack_images) -> dict[str, str]:
    """The trainer and sync images in the dev stack's registry, built from their Dockerfiles
    (``stack_images``): training tasks run them by digest. ``{repository: digest}``."""
    return {image.repository: image.digest for image in stack_images.values()}


@pytest.fixture(scope="session")
def airflow(devstack, tmp_path_factory) -> AirflowRunner:
    """Runs the project's DAGs (dags/) against the dev stack."""
    runner = AirflowRunner(
        make_airflow_home(tmp_path_factory.mktemp("airflow")), devstack.env(), REPO / "dags"
    )
    runner.cli("pools", "set", "--include-deferred", "gpu", "4", "GPU training pods")
    return runner


@pytest.fixture(scope="session")
def ui(devstack, tmp_path_factory):
    """Airflow as `make airflow` starts it (ui_support.airflow_ui), shared by the session's UI tests."""
    with airflow_ui(devstack.env(), tmp_path_factory.mktemp("ui")) as airflow:
        yield airflow


@pytest.fixture
def page(tmp_path):
    """A headless Chromium page; its profile in the test's tmp dir."""
    with chromium_page(tmp_path / "chromium-profile") as page:
        yield page
