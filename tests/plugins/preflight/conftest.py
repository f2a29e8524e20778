"""Stand-ins for the cluster that the preflight's groups ask, so that each group's lines are tested without one
(test_preflight_devstack.py runs them against the dev stack)."""

from __future__ import annotations

import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from kubetrain.settings import Deployment


class FakeCore:
    """The CoreV1Api calls a group makes, each answered by a value, a function of the call's arguments, or an
    exception that is raised; ``calls`` records them in order."""

    def __init__(self, **answers: Any) -> None:
        self.answers = answers
        self.calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name == "answers" or name not in self.answers:
            raise AttributeError(f"the test gives no answer to CoreV1Api.{name}")

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args, kwargs))
            answer = self.answers[name]
            if isinstance(answer, BaseException):
                raise answer
            return answer(*args, **kwargs) if callable(answer) else answer

        return call


@pytest.fixture
def api_error() -> Callable[..., ApiException]:
    """An ApiException as the client raises it: the status and the API's Status body with ``message``."""

    def make(status: int, message: str = "", reason: str = "") -> ApiException:
        exc = ApiException(status=status, reason=reason)
        exc.body = json.dumps({"kind": "Status", "code": status, "message": message}).encode()
        return exc

    return make


@pytest.fixture
def fake_cluster() -> Callable[..., SimpleNamespace]:
    """A :class:`kubetrain.preflight.cluster.Cluster` whose ``core`` is a :class:`FakeCore` of ``answers``."""

    def make(deployment: Deployment | None = None, **answers: Any) -> SimpleNamespace:
        deployment = deployment or Deployment()
        return SimpleNamespace(
            deployment=deployment,
            namespace=deployment.namespace,
            kubernetes_conn_id="kubernetes_default",
            core=FakeCore(**answers),
        )

    return make
