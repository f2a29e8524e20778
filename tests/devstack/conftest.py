"""A private local Kubernetes API server per test session (fast restart back-off), plus clients for it.

The shared ``devstack`` fixture (tests/conftest.py) runs the server as ``make stack-up`` does;
these tests start their own so that they can use a short back-off and strict GPU mode.
"""

from __future__ import annotations

import pytest
from kubernetes import client

from .support import KubeApi, start_server, stop_server


@pytest.fixture(scope="session")
def mirror(devstack) -> str:
    """``host:port`` of the dev stack's registry mirror (busybox, alpine, python, tensorflow)."""
    return devstack.load_state()["mirror"]


@pytest.fixture(scope="session")
def kubeapi(tmp_path_factory, mirror) -> KubeApi:
    api, proc = start_server(tmp_path_factory.mktemp("kubeapi"), mirror=mirror)
    try:
        yield api
    finally:
        stop_server(proc)


@pytest.fixture(scope="session")
def core(kubeapi: KubeApi) -> client.CoreV1Api:
    return client.CoreV1Api(kubeapi.api_client())


@pytest.fixture(scope="session")
def batch(kubeapi: KubeApi) -> client.BatchV1Api:
    return client.BatchV1Api(kubeapi.api_client())
