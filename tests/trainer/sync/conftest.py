"""Fixtures of the transfer tool's tests.

``s3_server`` (tests/conftest.py) is the dev stack's S3 server, which verifies every SigV4
signature. ``moto_server`` is moto's S3 server (from .venv), for the verification paths that
need what the dev stack's server does not do (include/devstack/S3.md): multipart ETags of the
form ``<md5>-<parts>``, ``If-Match``, and the checksums a store keeps (``x-amz-checksum-*``).
"""

from __future__ import annotations

import secrets
import subprocess
from dataclasses import dataclass

import pytest

from include.devstack.stack import REPO, free_port, wait_http


@dataclass(frozen=True)
class MotoServer:
    endpoint: str
    access_key_id: str
    secret_access_key: str
    region: str = "us-east-1"

    def env(self) -> dict[str, str]:
        """Standard AWS variables that boto3 and the transfer tool read."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
            "AWS_DEFAULT_REGION": self.region,
        }


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory) -> MotoServer:
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    server = MotoServer(f"http://127.0.0.1:{port}", "kt" + secrets.token_hex(8), secrets.token_hex(20))
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(REPO / ".venv" / "bin" / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_http(f"{server.endpoint}/moto-api/", 60, proc, log)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
