"""Start, stop and describe the embedded dev stack (standard library only).

The stack is three servers on 127.0.0.1, each a background process of its own session
so that it outlives the ``make`` call that started it:

* ``s3``: rclone's S3 server over ``<state dir>/s3`` behind HAProxy, which answers a range as
  AWS S3 does (include/devstack/s3.py, S3.md), with the ``datasets`` and ``training`` buckets; it
  keeps its objects and its key pair across restarts;
* ``registry``: Debian's ``docker-registry`` (the CNCF distribution registry);
* ``mirror``: the same registry, read-only, serving the public images that pods name (busybox,
  alpine, python, tensorflow) as stand-ins built here from Debian packages (mirror.py, `make mirror`);
* ``kubeapi``: include/devstack/kubeapi, a local Kubernetes API server whose kubelet runs each
  container from its image under runc, pulling from the registry and the mirror;
* ``mlflow`` (only when asked: ``make stack-up MLFLOW=1``): an MLflow tracking server with a
  SQLite store and its artifacts in the embedded S3 (include/devstack/mlflow_server.py); the
  env file then names it in ``KUBETRAIN_MLFLOW_TRACKING_URI``;
* ``postgres``: Debian's Postgres, the metadata DB of the multi-process Airflow (`make airflow`,
  include/airflow_ui.py); include/devstack/postgres.py.

Everything it makes lives under the state directory (``.stack`` by default):
``env`` (export lines), ``kubeconfig``, ``state.json``, ``logs/`` and each server's data.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from include.devstack import postgres

REPO = Path(__file__).resolve().parents[2]
AIRFLOW_PYTHON = REPO / ".venv" / "bin" / "python"
# the queues of the dev stack's Kueue stand-in (LocalQueue "training" in the training namespace)
KUEUE_CONFIG = Path(__file__).resolve().parent / "kueue.yaml"
BUCKETS = ("datasets", "training")
S3_SECRET_NAME = "kubetrain-s3"
# the namespace of training pods (KUBETRAIN_NAMESPACE), created with the S3 Secret in it
NAMESPACE = "kubetrain"
REGION = "us-east-1"
# Who talks to the local Kubernetes API, as on a cluster with the official Helm chart: the Airflow
# workers and triggerer by their service accounts (bound by deploy/rbac.yaml, which the stack applies),
# and a cluster admin for setting things up (the kubeconfig `kind` or a cloud console would give).
AIRFLOW_NAMESPACE = "airflow"
IDENTITIES = {
    "worker": (f"system:serviceaccount:{AIRFLOW_NAMESPACE}:airflow-worker", ""),
    "triggerer": (f"system:serviceaccount:{AIRFLOW_NAMESPACE}:airflow-triggerer", ""),
    "admin": ("kubetrain-admin", "system:masters"),
}
RBAC_MANIFEST = REPO / "deploy" / "rbac.yaml"
KUBECTL = REPO / ".tools" / "bin" / "kubectl"
DEFAULT_PORTS = {
    "s3": 9000,
    "registry": 5000,
    "mirror": 5001,
    "kubeapi": 6443,
    "mlflow": 5500,
    "postgres": 5432,
}


class StackError(RuntimeError):
    """The stack could not be started or is not running."""


def free_port(preferred: int | None = None) -> int:
    """Return ``preferred`` when nothing listens there, else any free loopback port."""
    candidates = [preferred] if preferred else []
    for port in [*candidates, 0]:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise StackError("no free port on 127.0.0.1")


def s3_keys(state_dir: Path) -> tuple[str, str]:
    """The stack's S3 key pair: generated on the first start, then kept (``s3-keys.json``, mode 0600),
    so that objects, Airflow connections and shells that sourced ``env`` stay valid across restarts."""
    path = state_dir / "s3-keys.json"
    try:
        keys = json.loads(path.read_text())
        return keys["access_key_id"], keys["secret_access_key"]
    except FileNotFoundError:
        pass
    except (ValueError, KeyError, TypeError) as exc:
        raise StackError(
            f"{path} is not a key pair written by the stack ({exc}): remove it to generate a new one"
        ) from exc
    access_key, secret_key = "kt" + secrets.token_hex(8), secrets.token_hex(20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"access_key_id": access_key, "secret_access_key": secret_key}, f)
    return access_key, secret_key


def s3_client(env: Mapping[str, str]) -> Any:
    """A boto3 S3 client of the stack whose variables ``env`` holds (:meth:`Stack.env`, or what
    ``.stack/env`` exports). boto3 is imported here: this module stays standard library only.

    :param env: the stack's variables: ``KUBETRAIN_S3_ENDPOINT`` and its key pair.
    """
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=env["KUBETRAIN_S3_ENDPOINT"],
        aws_access_key_id=env["KUBETRAIN_S3_ACCESS_KEY_ID"],
        aws_secret_access_key=env["KUBETRAIN_S3_SECRET_ACCESS_KEY"],
        region_name="us-east-1",
    )


def serving_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost (and its key), made once with openssl, then kept.

    The local Kubernetes API serves HTTPS with it, as every API server does (kubectl sends a bearer
    token over HTTPS only); the kubeconfigs trust it as their certificate authority.
    """
    cert, key = directory / "kubeapi.crt", directory / "kubeapi.key"
    if cert.exists() and key.exists():
        return cert, key
    directory.mkdir(parents=True, exist_ok=True)
    made = subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "3650",
            "-subj",
            "/CN=kubetrain-dev-kubeapi",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,digitalSignature,keyCertSign",
            "-addext",
            "extendedKeyUsage=serverAuth",
        ],
        capture_output=True,
        text=True,
    )
    if made.returncode:
        raise StackError(f"openssl could not make the API server's certificate: {made.stderr.strip()[-500:]}")
    key.chmod(0o600)
    return cert, key


def tls_context(ca: Path | None):
    """An ssl context that trusts ``ca`` (None: no context, plain HTTP)."""
    if ca is None:
        return None
    import ssl

    return ssl.create_default_context(cafile=str(ca))


def wait_http(
    url: str,
    timeout: float,
    proc: subprocess.Popen | None = None,
    log: Path | None = None,
    ca: Path | None = None,
) -> None:
    """Wait until ``url`` answers with any HTTP status; fail early if ``proc`` dies."""
    deadline = time.monotonic() + timeout
    context = tls_context(ca)
    while True:
        try:
            urllib.request.urlopen(url, timeout=2, context=context).close()
            return
        except urllib.error.HTTPError:
            return  # the server answered; a 4xx still means it is up
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log and log.exists() else ""
            raise StackError(f"{url} did not come up: the server exited with {proc.returncode}\n{tail}")
        if time.monotonic() > deadline:
            raise StackError(f"{url} did not answer within {timeout:.0f} s")
        time.sleep(0.1)


@dataclass
class Stack:
    """A dev stack rooted at ``state_dir``."""

    state_dir: Path
    strict_gpu: bool = False
    # an MLflow tracking server beside the others: KUBETRAIN_MLFLOW=1 / make stack-up MLFLOW=1
    mlflow: bool = False
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def state_file(self) -> Path:
        return self.state_dir / "state.json"

    def load_state(self) -> dict:
        if not self.state_file.exists():
            raise StackError(f"no dev stack at {self.state_dir}: run `make stack-up`")
        return json.loads(self.state_file.read_text())

    # -- start -----------------------------------------------------------------------------

    def _spawn(
        self, name: str, argv: list[str], env: dict[str, str] | None = None
    ) -> tuple[subprocess.Popen, Path]:
        logs = self.state_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log = logs / f"{name}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=REPO,
                env={**os.environ, **(env or {})},
                start_new_session=True,  # outlive the caller; stop by process group
            )
        self.procs[name] = proc
        return proc, log

    def up(self) -> dict:
        """Start all servers, create buckets and the S3 Secret, write env and kubeconfig."""
        if self.state_file.exists():
            state = json.loads(self.state_file.read_text())
            components = state["components"]
            if "postgres" in components and all(_alive(c["pid"]) for c in components.values()):
                if self.mlflow and not state.get("mlflow"):
                    raise StackError(
                        f"the dev stack in {self.state_dir} is already running without MLflow: "
                        "`make stack-down`, then `make stack-up MLFLOW=1`"
                    )
                return state
            self.down()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.state_dir.chmod(0o700)  # it holds the generated S3 credentials
        ports = {
            name: free_port(int(os.environ.get(f"KUBETRAIN_{name.upper()}_PORT", default)))
            for name, default in DEFAULT_PORTS.items()
            if name != "mlflow" or self.mlflow
        }
        access_key, secret_key = s3_keys(self.state_dir)
        state: dict = {"ports": ports, "components": {}, "strict_gpu": self.strict_gpu}
        try:
            self._start_s3(state, ports["s3"], access_key, secret_key)
            self._start_registry(state, ports["registry"])
            self._start_mirror(state, ports["mirror"])
            self._start_kubeapi(state, ports["kubeapi"], ports["mirror"])
            postgres.start_in_stack(self, state, ports["postgres"])
            if self.mlflow:
                self._start_mlflow(state, ports["mlflow"], access_key, secret_key)
            state["s3"] = {
                "endpoint": f"http://127.0.0.1:{ports['s3']}",
                "access_key_id": access_key,
                "secret_access_key": secret_key,
                "region": REGION,
                "buckets": list(BUCKETS),
            }
            state["registry"] = f"127.0.0.1:{ports['registry']}"
            state["mirror"] = f"127.0.0.1:{ports['mirror']}"
            state["kubeapi"] = f"https://127.0.0.1:{ports['kubeapi']}"
            self._write_kubeconfig(state)
            self._set_up_cluster(state)
            self._create_s3_secret(state)
            self.state_file.write_text(json.dumps(state, indent=2))
            self.state_file.chmod(0o600)
            self._write_env(state)
        except BaseException:
            for proc in self.procs.values():
                _kill_group(proc.pid)
            raise
        return state

    def _start_s3(self, state: dict, port: int, access_key: str, secret_key: str) -> None:
        data_dir = self.state_dir / "s3"
        proc, log = self._spawn(
            "s3",
            [
                sys.executable,
                "-m",
                "include.devstack.s3",
                "--port",
                str(port),
                "--data-dir",
                str(data_dir),
                "--buckets",
                *BUCKETS,
            ],
            env={"KUBETRAIN_S3_ACCESS_KEY_ID": access_key, "KUBETRAIN_S3_SECRET_ACCESS_KEY": secret_key},
        )
        # every bucket is a directory that exists before the server starts: once it answers
        # (403 to this unsigned request), it serves them
        wait_http(f"http://127.0.0.1:{port}/", 60, proc, log)
        state["components"]["s3"] = {
            "pid": proc.pid,
            "port": port,
            "log": str(log),
            "data_dir": str(data_dir),
        }

    def _start_mlflow(self, state: dict, port: int, access_key: str, secret_key: str) -> None:
        from include.devstack import mlflow_server

        endpoint = f"http://127.0.0.1:{state['ports']['s3']}"
        proc, log = self._spawn(
            "mlflow",
            mlflow_server.command(self.state_dir / "mlflow", port),
            env=mlflow_server.environment(endpoint, access_key, secret_key, REGION),
        )
        wait_http(mlflow_server.health_url(port), 180, proc, log)
        state["components"]["mlflow"] = {"pid": proc.pid, "port": port, "log": str(log)}
        state["mlflow"] = f"http://127.0.0.1:{port}"

    def _start_registry(self, state: dict, port: int) -> None:
        from include.devstack import registry

        proc, log = self._spawn("registry", registry.command(self.state_dir / "registry", port))
        wait_http(f"http://127.0.0.1:{port}/v2/", 30, proc, log)
        state["components"]["registry"] = {"pid": proc.pid, "port": port, "log": str(log)}

    def _start_mirror(self, state: dict, port: int) -> None:
        from include.devstack import mirror, registry

        data = mirror.MIRROR_DIR / "data"
        if not data.is_dir():
            raise StackError(f"the registry mirror's images are missing ({data}): run `make mirror`")
        argv = registry.command(self.state_dir / "mirror", port, data_dir=data, readonly=True)
        proc, log = self._spawn("mirror", argv)
        wait_http(f"http://127.0.0.1:{port}/v2/", 30, proc, log)
        state["components"]["mirror"] = {"pid": proc.pid, "port": port, "log": str(log)}

    @property
    def token_file(self) -> Path:
        return self.state_dir / "kube-tokens.csv"

    def _write_tokens(self) -> dict[str, str]:
        """A bearer token per identity, in kube-apiserver's token file format (mode 0600)."""
        tokens = {name: secrets.token_urlsafe(32) for name in IDENTITIES}
        lines = [f'{tokens[name]},{user},{name},"{groups}"' for name, (user, groups) in IDENTITIES.items()]
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        return tokens

    def kubeapi_argv(self, port: int, mirror_port: int) -> list[str]:
        """The local Kubernetes API's command line for this stack's options."""
        cert, key = self.state_dir / "kubeapi.crt", self.state_dir / "kubeapi.key"
        argv = [
            str(AIRFLOW_PYTHON),
            "-m",
            "include.devstack.kubeapi",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--state-dir",
            str(self.state_dir / "kube"),
            "--mirror",
            f"127.0.0.1:{mirror_port}",
            "--token-auth-file",
            str(self.token_file),
            "--tls-cert-file",
            str(cert),
            "--tls-private-key-file",
            str(key),
        ]
        if self.strict_gpu:
            argv.append("--strict-gpu")
        # Kueue's stand-in: only pods and Jobs labelled with a queue are held by it
        argv += ["--kueue-config", str(KUEUE_CONFIG)]
        return argv

    def _start_kubeapi(self, state: dict, port: int, mirror_port: int) -> None:
        state["tokens"] = self._write_tokens()
        state["kubeapi_ca"] = str(serving_certificate(self.state_dir)[0])
        argv = self.kubeapi_argv(port, mirror_port)
        # the server reads this from its environment too: the flag above decides, not the caller's shell
        proc, log = self._spawn("kubeapi", argv, env={"KUBETRAIN_REGISTRY_MIRROR": ""})
        wait_http(f"https://127.0.0.1:{port}/version", 60, proc, log, ca=Path(state["kubeapi_ca"]))
        state["components"]["kubeapi"] = {"pid": proc.pid, "port": port, "log": str(log)}

    def _write_kubeconfig(self, state: dict) -> None:
        """``kubeconfig`` (the Airflow worker's identity), ``kubeconfig-admin`` and ``kubeconfig-triggerer``."""
        import base64

        ca_data = base64.b64encode(Path(state["kubeapi_ca"]).read_bytes()).decode()
        for identity, token in state["tokens"].items():
            kubeconfig = {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "kubetrain-dev",
                        "cluster": {"server": state["kubeapi"], "certificate-authority-data": ca_data},
                    }
                ],
                "users": [{"name": identity, "user": {"token": token}}],
                "contexts": [
                    {
                        "name": "kubetrain-dev",
                        "context": {"cluster": "kubetrain-dev", "user": identity, "namespace": NAMESPACE},
                    }
                ],
                "current-context": "kubetrain-dev",
            }
            # JSON is valid YAML, so kubectl and the Python clients read these files as they are.
            path = self.state_dir / ("kubeconfig" if identity == "worker" else f"kubeconfig-{identity}")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(kubeconfig, indent=2))
        state["kubeconfig"] = str(self.state_dir / "kubeconfig")
        state["kubeconfig_admin"] = str(self.state_dir / "kubeconfig-admin")
        state["kubeconfig_triggerer"] = str(self.state_dir / "kubeconfig-triggerer")

    def _admin_request(self, state: dict, path: str, body: dict) -> None:
        req = urllib.request.Request(
            state["kubeapi"] + path,
            data=json.dumps(body).encode(),
            headers={
                "Content-Type": "application/json",
                "Authorization": f"Bearer {state['tokens']['admin']}",
            },
            method="POST",
        )
        urllib.request.urlopen(req, timeout=10, context=tls_context(Path(state["kubeapi_ca"]))).close()

    def _set_up_cluster(self, state: dict) -> None:
        """What a cluster's admin does once, as docs/real-cluster.md says: the training namespace, the Airflow
        service accounts (the Helm chart's), and deploy/rbac.yaml applied with kubectl, nothing more."""
        # the training namespace enforces Pod Security level restricted, as docs/real-cluster.md advises
        labels = {NAMESPACE: {"pod-security.kubernetes.io/enforce": "restricted"}, AIRFLOW_NAMESPACE: {}}
        for name, ns_labels in labels.items():
            self._admin_request(
                state,
                "/api/v1/namespaces",
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": ns_labels}},
            )
        for identity in ("worker", "triggerer"):
            account = IDENTITIES[identity][0].rsplit(":", 1)[1]
            self._admin_request(
                state,
                f"/api/v1/namespaces/{AIRFLOW_NAMESPACE}/serviceaccounts",
                {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account}},
            )
        if not KUBECTL.exists():
            raise StackError(f"{KUBECTL} is missing: run `make setup`")
        applied = subprocess.run(
            [str(KUBECTL), "--kubeconfig", state["kubeconfig_admin"], "apply", "-f", str(RBAC_MANIFEST)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if applied.returncode:
            raise StackError(f"kubectl apply -f {RBAC_MANIFEST} failed: {applied.stderr.strip()}")

    def _create_s3_secret(self, state: dict) -> None:
        """The Secret that training pods reference for S3 (never literal values in pod specs)."""
        import base64

        s3 = state.get("s3") or {}
        data = {
            "AWS_ACCESS_KEY_ID": s3["access_key_id"],
            "AWS_SECRET_ACCESS_KEY": s3["secret_access_key"],
            "AWS_ENDPOINT_URL": s3["endpoint"],
            "AWS_DEFAULT_REGION": s3["region"],
        }
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": S3_SECRET_NAME, "namespace": NAMESPACE},
            "type": "Opaque",
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
        }
        self._admin_request(state, f"/api/v1/namespaces/{NAMESPACE}/secrets", body)

    def _write_env(self, state: dict) -> None:
        s3 = state["s3"]
        # The kubeconfig comes from KUBECONFIG (below): with provider 10.25 a deferrable pod
        # operator turns $KUBECONFIG into a config dict and refuses a kube_config_path beside it.
        kube_conn = {"conn_type": "kubernetes", "extra": {"namespace": NAMESPACE}}
        aws_conn = {
            "conn_type": "aws",
            "login": s3["access_key_id"],
            "password": s3["secret_access_key"],
            "extra": {"endpoint_url": s3["endpoint"], "region_name": s3["region"]},
        }
        registry_conn = {
            "conn_type": "kubetrain_registry",
            "host": "127.0.0.1",
            "port": int(state["registry"].rpartition(":")[2]),
            "extra": {"insecure": True},
        }
        values = {
            # the Airflow worker's identity (what deploy/rbac.yaml grants it); kubeconfig-admin is the cluster admin's
            "KUBECONFIG": state["kubeconfig"],
            "KUBETRAIN_ADMIN_KUBECONFIG": state["kubeconfig_admin"],
            "AIRFLOW_CONN_KUBERNETES_DEFAULT": json.dumps(kube_conn),
            "AIRFLOW_CONN_AWS_DEFAULT": json.dumps(aws_conn),
            "AIRFLOW_CONN_KUBETRAIN_REGISTRY_DEFAULT": json.dumps(registry_conn),
            "KUBETRAIN_REGISTRY": state["registry"],
            # the mirror that serves docker.io and quay.io images to the local kubelet (mirror.py)
            "KUBETRAIN_REGISTRY_MIRROR": state["mirror"],
            # The node has no GPU: training pods run the CPU variant that `make stack-images` pushes
            # (<registry>/kubetrain/trainer:latest-cpu, by the same default names as on a cluster).
            "KUBETRAIN_TRAINER_VARIANT": "cpu",
            "KUBETRAIN_S3_ENDPOINT": s3["endpoint"],
            "KUBETRAIN_S3_ACCESS_KEY_ID": s3["access_key_id"],
            "KUBETRAIN_S3_SECRET_ACCESS_KEY": s3["secret_access_key"],
            "KUBETRAIN_S3_SECRET": S3_SECRET_NAME,
            # the same endpoint and keys for the AWS CLI and boto3 of a shell that sources this file
            "AWS_ACCESS_KEY_ID": s3["access_key_id"],
            "AWS_SECRET_ACCESS_KEY": s3["secret_access_key"],
            "AWS_ENDPOINT_URL": s3["endpoint"],
            "AWS_DEFAULT_REGION": s3["region"],
            "KUBETRAIN_NAMESPACE": NAMESPACE,
            "KUBETRAIN_STACK_DIR": str(self.state_dir),
        }
        if state.get("mlflow"):
            values["KUBETRAIN_MLFLOW_TRACKING_URI"] = state["mlflow"]
        # Airflow's metadata DB for `make airflow` (postgres.py); the password is in the PGPASSFILE only
        values[postgres.URL_VARIABLE] = state["postgres"]["url"]
        values[postgres.PASSFILE_VARIABLE] = state["postgres"]["pgpass"]
        lines = ["# Generated by `make stack-up`; source it: `. .stack/env`. Holds dev-only credentials."]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in values.items()]
        path = self.state_dir / "env"
        path.write_text("\n".join(lines) + "\n")
        path.chmod(0o600)

    # -- stop ------------------------------------------------------------------------------

    def down(self) -> list[str]:
        """Stop every server of this stack (SIGTERM to its process group, then SIGKILL)."""
        if not self.state_file.exists():
            return []
        state = json.loads(self.state_file.read_text())
        stopped = []
        for name, comp in state.get("components", {}).items():
            if _kill_group(comp["pid"]):
                stopped.append(name)
        for name in (
            "state.json",
            "env",
            "kubeconfig",
            "kubeconfig-admin",
            "kubeconfig-triggerer",
            "kube-tokens.csv",
        ):
            (self.state_dir / name).unlink(missing_ok=True)
        return stopped

    def env(self) -> dict[str, str]:
        """The exported variables of ``.stack/env`` as a dict."""
        values = {}
        for line in (self.state_dir / "env").read_text().splitlines():
            if line.startswith("export "):
                key, _, raw = line[len("export ") :].partition("=")
                values[key] = shlex.split(raw)[0] if raw else ""
        return values


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def _kill_group(pid: int, grace: float = 10.0) -> bool:
    try:
        os.killpg(pid, signal.SIGTERM)
    except OSError:
        return False
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except OSError:
            return True
        try:  # reap it when it is our own child
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    return True


def _flag(name: str, default: bool = False) -> bool:
    return os.environ.get(name, "1" if default else "") not in ("", "0", "false", "no")


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m include.devstack", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["up", "down", "status", "env"])
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=REPO / ".stack",
        help="where the stack keeps its files (default: .stack)",
    )
    parser.add_argument(
        "--strict-gpu",
        action="store_true",
        default=os.environ.get("KUBETRAIN_STRICT_GPU", "") not in ("", "0", "false"),
        help="pods that request nvidia.com/gpu stay Pending (FailedScheduling) when no GPU is present, as on a real cluster",
    )
    parser.add_argument(
        "--mlflow",
        action="store_true",
        default=_flag("KUBETRAIN_MLFLOW"),
        help="also start an MLflow tracking server (SQLite, artifacts in the embedded S3) that the DAGs log to",
    )
    args = parser.parse_args(argv)
    stack = Stack(args.state_dir.resolve(), strict_gpu=args.strict_gpu, mlflow=args.mlflow)
    try:
        if args.command == "up":
            state = stack.up()
            print(
                f"dev stack up: S3 {state['s3']['endpoint']}, registry {state['registry']} (mirror {state['mirror']}), "
                f"Kubernetes API {state['kubeapi']}"
            )
            print(f"  kubeconfig: {state['kubeconfig']}")
            if state.get("mlflow"):
                print(f"  MLflow tracking server: {state['mlflow']}")
            print(f"  use it from a shell: . {stack.state_dir / 'env'}")
        elif args.command == "down":
            stopped = stack.down()
            print(
                "dev stack down"
                + (f": stopped {', '.join(stopped)}" if stopped else " (nothing was running)")
            )
        elif args.command == "status":
            state = stack.load_state()
            for name, comp in state["components"].items():
                print(
                    f"{name:9} pid {comp['pid']:>7}  port {comp['port']:>5}  {'running' if _alive(comp['pid']) else 'DEAD'}"
                )
        elif args.command == "env":
            sys.stdout.write((stack.state_dir / "env").read_text())
    except StackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
