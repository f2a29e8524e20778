"""The training operator's arguments as the pod contract takes them: lists, names, labels and queues.

An argument may come from a DAG that renders templates as native objects
(``render_template_as_native_obj=True``: ``{{ params.epochs }}`` is the integer 5,
``{{ params.args }}`` the Param's list) or as text (``{{ params.node_selector }}`` is
``"{'gpu-type': 'a100'}"``); each function here takes what such a rendering gives and fails with
the argument's name, the value and what was expected.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from kubetrain import settings
from kubetrain.pod_startup import PRIORITY_LABEL, QUEUE_LABEL

__all__ = [
    "EMPTY",
    "node_selector",
    "pull_secret_names",
    "queue_labels",
    "queue_timeout",
    "string_list",
    "text",
    "tolerations",
]

# An argument left empty: the deployment's setting applies.
EMPTY: tuple[object, ...] = (None, "", [], {}, ())
# A Kueue LocalQueue or WorkloadPriorityClass name (a DNS subdomain).
_KUEUE_NAME = re.compile(settings.DNS_SUBDOMAIN)


def _native_hint(param: str) -> str:
    return (
        f"a template must render the object itself: '{{{{ params.{param} }}}}' in a DAG with "
        "render_template_as_native_obj=True"
    )


def string_list(name: str, value: Any) -> list[str] | None:
    """A command or argument list, each item as text (a native rendering's numbers become text).

    :param name: the operator argument, for the error message.
    :param value: a list (or tuple) of strings and numbers, or empty.
    """
    if value in (None, "", [], ()):
        return None
    if isinstance(value, str):
        raise ValueError(
            f"{name} {value!r} is not a list: expected a list of strings; "
            + _native_hint({"cmds": "command", "arguments": "args"}.get(name, name))
        )
    if not isinstance(value, list | tuple) or not all(isinstance(v, str | int | float) for v in value):
        raise ValueError(f"{name} {value!r} is not a list of strings")
    return [str(v) for v in value]


def text(name: str, value: Any) -> str | None:
    """A name-like setting (experiment, trial) as text: a number (a trial's, a native rendering of 2024) too."""
    if value in (None, ""):
        return None
    if not isinstance(value, str | int | float):
        raise ValueError(f"{name} {value!r} is not text: expected a string such as 'digits'")
    return str(value)


def pull_secret_names(value: Any) -> tuple[str, ...]:
    """Secret names from a list (of names or V1LocalObjectReference), or ``a,b`` (the setting's form)."""
    if value in EMPTY:
        return ()
    if isinstance(value, str):
        if value.lstrip().startswith("["):
            raise ValueError(
                f"image_pull_secrets {value!r} is text, not a list: expected e.g. ['regcred'] or regcred,mirror; "
                + _native_hint("image_pull_secrets")
            )
        return settings.parse_list("image_pull_secrets", value)
    if isinstance(value, list | tuple):
        return tuple(str(getattr(v, "name", v)) for v in value if getattr(v, "name", v))
    raise ValueError(f"image_pull_secrets {value!r} is not a list of Secret names: expected e.g. ['regcred']")


def node_selector(value: Any) -> dict[str, str]:
    """Node labels from a mapping, or ``k=v,k2=v2`` (the setting's form); checked by :mod:`kubetrain.settings`."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        raise ValueError(
            f"node_selector {value!r} is text, not a mapping: expected e.g. {{'gpu-type': 'a100'}} or "
            f"gpu-type=a100; {_native_hint('node_selector')}"
        )
    if not isinstance(value, Mapping | str):
        raise ValueError(
            f"node_selector {value!r} is not a mapping of node labels: expected e.g. {{'gpu-type': 'a100'}}"
        )
    return settings.parse_node_selector(value)


def tolerations(value: Any) -> tuple[Any, ...]:
    """Tolerations as given (V1Toleration objects or mappings, checked by :mod:`kubetrain.pod_spec`)."""
    if not isinstance(value, list | tuple):
        raise ValueError(
            f"tolerations {value!r} is not a list: expected V1Toleration objects or mappings such as "
            f"[{{'key': 'spot', 'operator': 'Exists'}}]; {_native_hint('tolerations')}"
        )
    return tuple(value)


def queue_labels(local_queue: Any, priority_class: Any) -> dict[str, str]:
    """Kueue's labels for the pod: its LocalQueue (default: the deployment's) and priority class, when it has a queue."""
    queue = text("local_queue", local_queue) or settings.get("queue")
    priority = text("priority_class", priority_class)
    labels: dict[str, str] = {}
    for what, value in (("queue", queue), ("priority", priority)):
        if value and not _KUEUE_NAME.match(value):
            raise ValueError(
                f"{what} {value!r} is not a Kueue object name: expected lowercase letters, digits, "
                "'-' and '.', starting and ending with a letter or digit (at most 253 characters)"
            )
    if priority and not queue:
        raise ValueError(
            f"priority {priority!r} needs a queue: Kueue orders the workloads of a queue; set the queue "
            "Param or KUBETRAIN_QUEUE"
        )
    if queue:
        labels[QUEUE_LABEL] = queue
    if priority:
        labels[PRIORITY_LABEL] = priority
    return labels


def queue_timeout(value: Any) -> float:
    """Seconds a pod may wait for Kueue's admission (default: the deployment's ``KUBETRAIN_QUEUE_TIMEOUT``)."""
    if value is None:
        value = settings.get("queue_timeout")
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if seconds <= 0:
        raise ValueError(f"queue_timeout {value!r} is not valid: expected a number of seconds > 0")
    return seconds
