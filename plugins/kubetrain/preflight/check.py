"""One line of the preflight (:class:`Check`), and how a check that raised becomes one."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

STATUSES = ("PASS", "FAIL", "WARN", "INFO", "SKIP")


@dataclass(frozen=True)
class Check:
    """One line of the preflight: ``status name: detail``, and the fix for a FAIL."""

    name: str
    status: str
    detail: str
    fix: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"invalid status {self.status!r}: expected one of {', '.join(STATUSES)}")

    def line(self) -> str:
        text = f"{self.status:<4}  {self.name}: {self.detail}"
        return f"{text} -> fix: {self.fix}" if self.fix else text


def short_error(exc: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def api_message(exc) -> str:
    """The message of a Kubernetes API error's Status body (its first line otherwise)."""
    body = exc.body.decode(errors="replace") if isinstance(exc.body, bytes) else str(exc.body or "")
    try:
        return json.loads(body).get("message") or exc.reason or ""
    except ValueError:
        return (body.strip().splitlines() or [str(exc.reason or "")])[0][:300]


def guarded(name: str, check: Callable[[], Check]) -> Check:
    """``check()``, or its failure as one FAIL line: a preflight never ends in a traceback."""
    from kubernetes.client.exceptions import ApiException

    try:
        return check()
    except ApiException as exc:
        return Check(
            name,
            "FAIL",
            f"the API refused: {exc.status} {api_message(exc)}",
            "see the access line: kubectl apply -f deploy/rbac.yaml"
            if exc.status == 403
            else "check the cluster's API server",
        )
    except Exception as exc:  # noqa: BLE001 - one line, never a traceback
        return Check(
            name, "FAIL", f"could not be checked: {short_error(exc)}", "check the settings and the cluster"
        )
