"""The dev stack's Postgres: the metadata database of a multi-process Airflow (standard library only).

Airflow's API server, scheduler, DAG processor and triggerer write the metadata DB at the same
time; SQLite makes them wait on one file lock (an unpause from the trigger form then fails
after 5 s with ``database is locked``), and Airflow supports it only for tests. Like
docker-compose.yaml, `make airflow` and the tests' multi-process Airflow use Postgres instead:

* Debian's ``postgresql`` package (`make setup` installs it), one cluster per dev stack in
  ``<state dir>/postgres/data``, started by ``Stack.up`` like the stack's other servers (its own
  session, stopped by `make stack-down`, removed by `make clean`);
* it listens on 127.0.0.1 only, on a free port (5432 when free), without a Unix socket; every
  connection authenticates with scram-sha-256;
* its one role, ``airflow``, is the bootstrap superuser (as ``POSTGRES_USER`` makes it in
  docker-compose.yaml's Postgres). Its password is generated at ``initdb`` and lives only in
  ``<state dir>/postgres/pgpass`` (libpq's password file, mode 0600): clients find it through
  ``PGPASSFILE``, so neither URLs, environments nor logs carry it;
* Postgres refuses to run as root: then ``initdb`` and the server run as the package's
  ``postgres`` user (``setpriv``), which owns the data directory, with CAP_DAC_READ_SEARCH so that
  it reaches it under directories only root may enter (``.stack`` is 0700); where that capability
  cannot be handed down, those directories get the ``postgres`` group with search permission
  (mode 0710) instead;
* durability is a dev stack's: no fsync (an OS crash may lose the metadata DB, a process crash
  does not).

Databases: ``Server.template`` migrates one database per Airflow version once (``airflow db
migrate``, about half a minute), and ``Server.create`` copies it for each Airflow home with
``CREATE DATABASE ... TEMPLATE`` (well under a second), as ``seed_db`` copied a migrated SQLite
file before.
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import os
import pwd
import re
import secrets
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

USER = "airflow"
SERVER_USER = "postgres"  # the system user Debian's package creates; the server runs as it under root
PG_ROOT = Path("/usr/lib/postgresql")
URL_VARIABLE = "KUBETRAIN_POSTGRES_URL"
PASSFILE_VARIABLE = "PGPASSFILE"
_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class PostgresError(RuntimeError):
    """The server did not start, or a statement failed."""


def bin_dir() -> Path:
    """The newest installed server's binaries (``/usr/lib/postgresql/<major>/bin``)."""
    found = sorted(
        (p for p in PG_ROOT.glob("*/bin") if (p / "initdb").exists() and p.parent.name.isdigit()),
        key=lambda p: int(p.parent.name),
    )
    if not found:
        raise FileNotFoundError(
            f"no Postgres server under {PG_ROOT}: run `make setup` (it installs Debian's postgresql package)"
        )
    return found[-1]


def _read_search_capability() -> bool:
    """Whether this process may hand CAP_DAC_READ_SEARCH down (it is in the bounding set)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapBnd:"):
                return bool(int(line.split()[1], 16) & (1 << 2))
    except (OSError, ValueError):
        pass
    return False


def _as_server_user(argv: list[str]) -> list[str]:
    """``argv`` run as the ``postgres`` user when we are root (Postgres refuses root), else as is.

    The server keeps CAP_DAC_READ_SEARCH (where the machine allows it): it reaches its data directory
    however the directories above it are set (a test session's 0700 temporary directory, whose mode
    pytest sets back at the start of every session, while the server runs).
    """
    if os.geteuid() != 0:
        return argv
    caps = (
        ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
        if _read_search_capability()
        else []
    )
    return [
        "setpriv",
        f"--reuid={SERVER_USER}",
        f"--regid={SERVER_USER}",
        "--init-groups",
        *caps,
        "--",
        *argv,
    ]


def _let_server_user_in(path: Path) -> None:
    """As root without CAP_DAC_READ_SEARCH to hand down, give the ``postgres`` group search permission on
    ``path`` and the directories above it that would stop the server reaching its data directory (mode
    0700 becomes 0710, group postgres)."""
    if os.geteuid() != 0 or _read_search_capability():
        return
    user = pwd.getpwnam(SERVER_USER)
    gid = grp.getgrnam(SERVER_USER).gr_gid
    for directory in [path, *path.parents]:
        st = directory.stat()
        if st.st_mode & 0o001 or (st.st_uid == user.pw_uid and st.st_mode & 0o100):
            continue
        if st.st_gid != gid:
            if st.st_mode & 0o010 and st.st_gid in os.getgrouplist(SERVER_USER, user.pw_gid):
                continue
            os.chown(directory, -1, gid)
        directory.chmod((st.st_mode & 0o7777) | 0o010)


@dataclass(frozen=True)
class Cluster:
    """A Postgres cluster in ``directory``: ``data/`` (the server's) and ``pgpass`` (the password file).

    :param directory: where the cluster lives (the dev stack's ``<state dir>/postgres``).
    """

    directory: Path

    @property
    def data(self) -> Path:
        return self.directory / "data"

    @property
    def pgpass(self) -> Path:
        return self.directory / "pgpass"

    def init(self) -> None:
        """Create the cluster once: the ``airflow`` superuser with a generated password, TCP with
        scram-sha-256 only. A cluster that exists (``data/PG_VERSION``) is kept, with its databases."""
        if (self.data / "PG_VERSION").exists() and self.pgpass.exists():
            return
        initdb = bin_dir() / "initdb"
        self.directory.mkdir(parents=True, exist_ok=True)
        self.directory.chmod(0o700)
        _let_server_user_in(self.directory)
        if self.data.exists():  # a half-made cluster: its password is lost with the pgpass file
            subprocess.run(["rm", "-rf", str(self.data)], check=True)
        self.data.mkdir(mode=0o700)
        password = secrets.token_urlsafe(24)
        # initdb reads the password from a file (never argv): one that only the server's user can read
        pwfile = self.directory / "initdb-password"
        fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(password + "\n")
        if os.geteuid() == 0:
            owner = pwd.getpwnam(SERVER_USER).pw_uid, grp.getgrnam(SERVER_USER).gr_gid
            os.chown(self.data, *owner)
            os.chown(pwfile, *owner)
        argv = [
            str(initdb),
            "--pgdata",
            str(self.data),
            "--username",
            USER,
            f"--pwfile={pwfile}",
            "--auth-host=scram-sha-256",
            "--auth-local=reject",
            "--encoding=UTF8",
            "--locale=C.UTF-8",
            "--no-sync",
            "--no-instructions",
        ]
        try:
            proc = subprocess.run(_as_server_user(argv), capture_output=True, text=True, cwd="/")
        finally:
            pwfile.unlink(missing_ok=True)
        if proc.returncode != 0:
            raise PostgresError(f"initdb {self.data} failed ({proc.returncode}): {proc.stderr[-2000:]}")
        tmp = self.pgpass.with_name("pgpass.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(f"127.0.0.1:*:*:{USER}:{password}\n")  # libpq's format: host:port:db:user:password
        tmp.replace(self.pgpass)

    def command(self, port: int) -> list[str]:
        """The server on 127.0.0.1:``port``, no Unix socket, logging to stderr (run it as the stack's servers)."""
        if not 0 < port < 65536:
            raise ValueError(f"port={port} is not valid: expected 1..65535")
        settings = {
            "listen_addresses": "127.0.0.1",
            "port": str(port),
            "unix_socket_directories": "",
            # four components per Airflow, several Airflows in a test session, each with a pool
            "max_connections": "300",
            "shared_buffers": "64MB",
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "log_min_messages": "warning",
        }
        argv = [str(bin_dir() / "postgres"), "-D", str(self.data)]
        for name, value in settings.items():
            argv += ["-c", f"{name}={value}"]
        return _as_server_user(argv)

    def server(self, port: int) -> Server:
        """How clients reach this cluster once it listens on ``port``."""
        return Server(f"postgresql://{USER}@127.0.0.1:{port}", self.pgpass)


def wait_ready(
    port: int, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None
) -> None:
    """Wait until the server on 127.0.0.1:``port`` accepts connections; fail early if ``proc`` dies.

    :param port: the server's port.
    :param timeout: seconds to wait.
    :param proc: the server process.
    :param log: its log, quoted when it dies.
    """
    isready = bin_dir() / "pg_isready"
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as sock:
            listening = sock.connect_ex(("127.0.0.1", port)) == 0
        if (
            listening
            and subprocess.run(
                [str(isready), "-q", "-h", "127.0.0.1", "-p", str(port), "-U", USER, "-d", "postgres"],
                check=False,
            ).returncode
            == 0
        ):
            return
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log and log.exists() else ""
            raise PostgresError(f"Postgres on port {port} exited with {proc.returncode}\n{tail}")
        if time.monotonic() > deadline:
            raise PostgresError(
                f"Postgres on 127.0.0.1:{port} did not accept connections within {timeout:.0f} s"
            )
        time.sleep(0.1)


def start_in_stack(stack, state: dict, port: int) -> None:
    """Start the dev stack's Postgres (``<state dir>/postgres``) as one of its servers and record it in ``state``.

    :param stack: the ``include.devstack.stack.Stack`` being started.
    :param state: its state (``components``, and ``postgres``: the URL and the password file).
    :param port: the port to listen on.
    """
    cluster = Cluster(stack.state_dir / "postgres")
    cluster.init()
    proc, log = stack._spawn("postgres", cluster.command(port))
    wait_ready(port, 60, proc, log)
    state["components"]["postgres"] = {"pid": proc.pid, "port": port, "log": str(log)}
    server = cluster.server(port)
    state["postgres"] = {"url": server.url, "pgpass": str(server.pgpass)}


@dataclass(frozen=True)
class Server:
    """A running Postgres as its clients see it.

    :param url: ``postgresql://airflow@127.0.0.1:<port>`` (no password, no database).
    :param pgpass: the password file that holds the role's password.
    """

    url: str
    pgpass: Path

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Server | None:
        """The server that ``env`` (the dev stack's ``env`` file) names, else None."""
        url, pgpass = env.get(URL_VARIABLE), env.get(PASSFILE_VARIABLE)
        if not url:
            return None
        if not pgpass:
            raise PostgresError(f"{URL_VARIABLE}={url} comes without {PASSFILE_VARIABLE} (its password file)")
        return cls(url, Path(pgpass))

    def env(self) -> dict[str, str]:
        """What a client (libpq, psycopg2, psql) needs besides the URL: where the password is."""
        return {PASSFILE_VARIABLE: str(self.pgpass)}

    def sqlalchemy_url(self, database: str) -> str:
        """The SQLAlchemy URL of ``database`` (psycopg2 driver, password from ``PGPASSFILE``)."""
        return "postgresql+psycopg2://" + self.url.split("://", 1)[1] + "/" + _checked(database)

    def sql(self, statement: str, database: str = "postgres") -> list[list[str]]:
        """Run one statement with psql; return the rows (fields as text).

        :param statement: the SQL.
        :param database: the database to connect to.
        """
        proc = subprocess.run(
            [
                str(bin_dir() / "psql"),
                "--no-psqlrc",
                "--quiet",
                "--no-align",
                "--tuples-only",
                "--field-separator=\t",
                "--set=ON_ERROR_STOP=1",
                "--dbname",
                f"{self.url}/{_checked(database)}",
                "--command",
                statement,
            ],
            env={**os.environ, **self.env()},
            capture_output=True,
            text=True,
            timeout=120,
        )
        if proc.returncode != 0:
            raise PostgresError(
                f"{statement!r} on {self.url}/{database} failed: {proc.stderr.strip()[-1000:]}"
            )
        return [line.split("\t") for line in proc.stdout.splitlines() if line]

    def databases(self) -> dict[str, str]:
        """The databases other than Postgres' own, with their comments (``''`` when none)."""
        rows = self.sql(
            "SELECT datname, coalesce(shobj_description(oid, 'pg_database'), '') FROM pg_database "
            "WHERE datname NOT IN ('postgres', 'template0', 'template1')"
        )
        return {row[0]: (row[1] if len(row) > 1 else "") for row in rows}

    def exists(self, database: str) -> bool:
        return _checked(database) in self.databases()

    def create(self, database: str, template: str, comment: str = "") -> None:
        """``CREATE DATABASE database TEMPLATE template`` (a file copy), with ``comment`` on it.

        :param database: the new database.
        :param template: the database to copy; nobody may be connected to it.
        :param comment: what the database is for (AirflowUI: its home).
        """
        self.sql(f"CREATE DATABASE {_checked(database)} TEMPLATE {_checked(template)} STRATEGY FILE_COPY")
        if comment:
            self.sql(f"COMMENT ON DATABASE {database} IS {_literal(comment)}")

    def drop(self, database: str) -> None:
        """Drop ``database``, disconnecting whoever is still connected."""
        self.sql(f"DROP DATABASE IF EXISTS {_checked(database)} WITH (FORCE)")

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """One process at a time makes templates and databases (a file lock beside the password file)."""
        with open(self.pgpass.with_name("databases.lock"), "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def template(self, name: str, migrate: Callable[[str], None]) -> str:
        """The template database ``name``, made once: ``migrate(sqlalchemy_url)`` fills a fresh database,
        which is then renamed to ``name`` (a half-migrated one never takes the name). Call under ``lock``.

        :param name: the template's name (per Airflow version).
        :param migrate: fills the database at the URL it is given (``airflow db migrate``).
        """
        if self.exists(name):
            return name
        partial = _checked(f"{name}_partial"[:63])
        self.drop(partial)
        self.sql(f"CREATE DATABASE {partial}")
        migrate(self.sqlalchemy_url(partial))
        self.sql(f"ALTER DATABASE {partial} RENAME TO {_checked(name)}")
        return name


def _checked(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"database name {name!r} is not valid: expected lower-case letters, digits and _")
    return name


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"
