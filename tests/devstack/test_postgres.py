"""The dev stack's Postgres (include/devstack/postgres.py): a cluster of its own in a temporary directory,
started as ``Stack.up`` starts it, one template copied into a database, password authentication only,
nothing left running once it is stopped."""

from __future__ import annotations

import os
import pwd
import signal
import subprocess
import time

import pytest

from include.devstack import postgres
from include.devstack.stack import free_port


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A running cluster: ``(Server, its process, its log)``; stopped (SIGTERM to its group) at the end."""
    directory = tmp_path_factory.mktemp("postgres")
    cluster = postgres.Cluster(directory)
    cluster.init()
    port = free_port()
    log = directory / "postgres.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cluster.command(port),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        postgres.wait_ready(port, 60, proc, log)
        yield cluster.server(port), proc, log
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def test_a_database_is_a_copy_of_the_template(server):
    pg, _, _ = server

    def migrate(url: str) -> None:
        assert url.startswith("postgresql+psycopg2://airflow@127.0.0.1:"), url
        pg.sql(
            "CREATE TABLE slot_pool (pool text PRIMARY KEY); INSERT INTO slot_pool VALUES ('default_pool')",
            database=url.rsplit("/", 1)[1],
        )

    with pg.lock():
        assert pg.template("airflow_template_test", migrate) == "airflow_template_test"
        # made once: a second call does not migrate again
        assert pg.template("airflow_template_test", lambda url: pytest.fail("migrated twice")) == (
            "airflow_template_test"
        )
    started = time.monotonic()
    pg.create("airflow_home_a", "airflow_template_test", comment="/tmp/home's a")
    took = time.monotonic() - started
    assert took < 10, f"CREATE DATABASE ... TEMPLATE took {took:.1f} s"
    assert pg.sql("SELECT pool FROM slot_pool", database="airflow_home_a") == [["default_pool"]]
    assert pg.databases() == {"airflow_template_test": "", "airflow_home_a": "/tmp/home's a"}
    pg.drop("airflow_home_a")
    assert not pg.exists("airflow_home_a")
    with pytest.raises(ValueError, match="database name 'a; DROP' is not valid"):
        pg.sql("SELECT 1", database="a; DROP")


def test_psycopg2_connects_through_the_password_file_only(server, tmp_path):
    """Airflow's URL carries no password: libpq reads it from PGPASSFILE, and nothing else gets in."""
    import sqlalchemy

    pg, _, log = server
    password = pg.pgpass.read_text().strip().rsplit(":", 1)[1]
    assert (pg.pgpass.stat().st_mode & 0o777) == 0o600
    url = pg.sqlalchemy_url("postgres")
    assert password not in url and password not in log.read_text(errors="replace")
    os.environ[postgres.PASSFILE_VARIABLE] = str(pg.pgpass)
    try:
        engine = sqlalchemy.create_engine(url)
        with engine.connect() as conn:
            assert conn.execute(sqlalchemy.text("SELECT current_user")).scalar() == "airflow"
        engine.dispose()
    finally:
        del os.environ[postgres.PASSFILE_VARIABLE]
    empty = tmp_path / "pgpass"
    empty.write_text("")
    empty.chmod(0o600)
    refused = subprocess.run(
        [
            str(postgres.bin_dir() / "psql"),
            "--no-password",
            "--dbname",
            f"{pg.url}/postgres",
            "-c",
            "SELECT 1",
        ],
        env={**os.environ, postgres.PASSFILE_VARIABLE: str(empty)},
        capture_output=True,
        text=True,
    )
    assert refused.returncode != 0 and "password" in refused.stderr, refused.stderr


def test_the_server_runs_as_postgres_under_root(server):
    _, proc, _ = server
    uid = int(next(line for line in open(f"/proc/{proc.pid}/status") if line.startswith("Uid:")).split()[1])
    expected = pwd.getpwnam(postgres.SERVER_USER).pw_uid if os.geteuid() == 0 else os.geteuid()
    assert uid == expected
