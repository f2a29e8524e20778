"""The dev stack's MLflow tracking server (optional: `make stack-up MLFLOW=1`), standard library only.

A real ``mlflow server`` from its own environment (.tools/mlflow, pinned by
include/devstack/mlflow/requirements.lock: MLflow's pins clash with Airflow's), with a SQLite
backend store under the stack's state directory and the artifacts of new experiments in the
embedded S3 (``s3://training/mlflow/``), so a run's report is copied into them inside S3. The
server runs as the stack's other servers do: its own session, stopped with the stack.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MLFLOW = REPO / ".tools" / "mlflow" / "bin" / "mlflow"
ARTIFACT_ROOT = "s3://training/mlflow/"


def command(state_dir: Path, port: int, *, host: str = "127.0.0.1") -> list[str]:
    """``mlflow server`` with a SQLite store in ``state_dir`` and artifacts in the embedded S3."""
    if not MLFLOW.exists():
        raise FileNotFoundError(
            f"{MLFLOW} is missing: run `make mlflow-env` (make stack-up MLFLOW=1 and make test do)"
        )
    state_dir.mkdir(parents=True, exist_ok=True)
    return [
        str(MLFLOW),
        "server",
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{state_dir / 'mlflow.db'}",
        "--default-artifact-root",
        ARTIFACT_ROOT,
        "--no-serve-artifacts",
    ]


def environment(
    s3_endpoint: str, access_key_id: str, secret_access_key: str, region: str = "us-east-1"
) -> dict[str, str]:
    """What the server needs to reach the embedded S3 (its artifact store)."""
    return {
        "MLFLOW_S3_ENDPOINT_URL": s3_endpoint,
        "AWS_ACCESS_KEY_ID": access_key_id,
        "AWS_SECRET_ACCESS_KEY": secret_access_key,
        "AWS_DEFAULT_REGION": region,
        # the server's own telemetry and update checks stay off: nothing leaves the machine
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "true",
    }


def health_url(port: int, host: str = "127.0.0.1") -> str:
    return f"http://{host}:{port}/health"


class MlflowServer:
    """An MLflow tracking server of its own (tests): started in ``state_dir`` against an S3 endpoint, stopped on exit.

    with MlflowServer(tmp, s3_endpoint, key_id, secret) as server:
        os.environ["KUBETRAIN_MLFLOW_TRACKING_URI"] = server.url
    """

    def __init__(self, state_dir: Path, s3_endpoint: str, access_key_id: str, secret_access_key: str) -> None:
        self.state_dir = Path(state_dir)
        self.env = environment(s3_endpoint, access_key_id, secret_access_key)
        self.port = 0
        self.proc = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> MlflowServer:
        import os
        import subprocess

        from include.devstack.stack import free_port, wait_http

        self.port = free_port()
        log = self.state_dir / "mlflow.log"
        argv = command(self.state_dir, self.port)
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=REPO,
                env={**os.environ, **self.env},
                start_new_session=True,
            )
        try:
            wait_http(health_url(self.port), 180, self.proc, log)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        import os
        import signal
        import subprocess

        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(20)
        except (OSError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
        self.proc = None
