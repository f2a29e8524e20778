"""Params of training DAGs: the trigger form's order, and a dataset URI check that explains itself.

**Order.** Airflow 3's trigger form shows Params in the order a DAG lists them, grouped by
their ``section``, the groups in the order of their first Param. Only the Params without a
section are open when the form opens (under "Run Parameters"); every named section starts
folded, and no Param attribute opens it. :func:`form_order` therefore puts the sections people
change most (:data:`OPEN_SECTIONS`: Container, Training, Model) first and open, by dropping their
``section``, and the others after them, folded, in :data:`FOLDED_SECTIONS` order.

**Dataset URIs.** The API server checks a submitted form against each Param's JSON schema
(jsonschema, with its format checker) and answers a bad value with the schema's error. A
``pattern`` error quotes the regular expression; a ``format`` error names the format instead.
:data:`S3_URI` is a format whose name says, in words, what is expected, checked by
:func:`kubetrain.s3_layout.parse_s3_uri`, the check the stage task applies too::

    'datasets/digits' is not a 'S3 URI: s3://<bucket>/<prefix>/ or s3://<bucket>/<file>'

jsonschema lets a format be registered only on its ``FormatChecker`` class for the checkers
that Airflow creates; importing :mod:`kubetrain` registers it (the kubetrain plugin loads the
package in the API server, a DAG file in the DAG processor and the worker). Where it is not
registered, jsonschema skips the unknown format, and the stage task still refuses the URI.

**Native values.** The training and sweep DAGs render templates as native objects
(``render_template_as_native_obj=True``, checked by :func:`native_dag`), so a Param reaches
its task as the Param's value (``{{ params.node_selector }}`` a mapping, ``{{ params.gpus }}``
an integer), never as text parsed back. Jinja's native rendering reads a rendered text that
looks like a Python literal as that literal (a model named ``1.10`` would become the number
1.1): a free name (model name, experiment) reaches its tasks as the Param itself
(``dag.param("model_name")``, resolved when the task runs), not through a template.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jsonschema import FormatChecker

from kubetrain_contract.s3uri import parse_s3_uri

__all__ = [
    "FOLDED_SECTIONS",
    "OPEN_SECTIONS",
    "S3_URI",
    "SWITCH",
    "form_order",
    "is_s3_uri",
    "marked_required",
    "native_dag",
    "with_dialect",
]

OPEN_SECTIONS = ("Container", "Training", "Model")
FOLDED_SECTIONS = ("Data", "Resources", "Cluster", "Promotion")
S3_URI = "S3 URI: s3://<bucket>/<prefix>/ or s3://<bucket>/<file>"
# The type of a boolean Param: the form shows a switch, which always has a value; "null" keeps the form
# from marking it required (:func:`marked_required`).
SWITCH = ["boolean", "null"]
# The JSON Schema dialect of every Param of a kubetrain DAG (:func:`with_dialect`).
SCHEMA_DIALECT = "http://json-schema.org/draft-07/schema#"


def is_s3_uri(value: object) -> bool:
    """Whether ``value`` is ``s3://<bucket>/...`` with a valid bucket name (non-strings are another check's)."""
    if not isinstance(value, str):
        return True
    try:
        parse_s3_uri(value)
    except ValueError:
        return False
    return value.startswith("s3://") and "/" in value[len("s3://") :]


def register_formats() -> None:
    """Make the format checkers jsonschema creates (Airflow's among them) check :data:`S3_URI`."""
    FormatChecker.checkers[S3_URI] = (is_s3_uri, ())


def _section(param: Any) -> str | None:
    schema = getattr(param, "schema", None)
    section = schema.get("section") if isinstance(schema, dict) else None
    return section if isinstance(section, str) and section else None


def marked_required(schema: Mapping[str, Any]) -> bool:
    """Whether Airflow 3's trigger form marks a Param with this JSON schema required (a red asterisk).

    The form (airflow-core's ui/src/components/FlexibleForm) marks a Param required when its
    schema has a ``type`` that does not allow ``null``, whatever its default.

    :param schema: the Param's schema.
    """
    kind = schema.get("type")
    return bool(kind) and not (isinstance(kind, list) and "null" in kind)


def _as_shown(param: Any, *, open_section: bool) -> Any:
    """``param`` as the trigger form should show it: open (no ``section``) or not, a boolean never required.

    A boolean Param is a switch, which always has a value: its type allows ``null`` so that the
    form does not mark it required; the switch still submits true or false.
    """
    schema = getattr(param, "schema", None)
    if not isinstance(schema, dict):
        return param  # a plain value
    changed = dict(schema)
    if open_section:
        changed.pop("section", None)
    if changed.get("type") in ("boolean", ["boolean"]):
        changed["type"] = list(SWITCH)
    if changed == schema:
        return param
    from airflow.sdk import Param

    return Param(param.value, param.description, source=param.source, schema=changed)


def form_order(params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` in the order of the trigger form: Training, Model and Container open, then the rest folded.

    Params of :data:`OPEN_SECTIONS` (and those with no section) come first, in that section
    order, and lose their ``section`` so that the form shows them open; the others follow in
    :data:`FOLDED_SECTIONS` order, then any other section in the order it first appears, each
    Param in its DAG's order. Plain values (not Params) count as open. A boolean Param's type
    also allows ``null``, so that the form does not mark it required (:func:`marked_required`):
    its switch always has a value.

    :param params: a DAG's Params by name.
    """
    first_seen: dict[str | None, int] = {}
    for param in params.values():
        first_seen.setdefault(_section(param), len(first_seen))

    def rank(item: tuple[int, tuple[str, Any]]) -> tuple[int, int, int]:
        position, (_, param) = item
        section = _section(param)
        if section is None:
            group = (0, len(OPEN_SECTIONS))
        elif section in OPEN_SECTIONS:
            group = (0, OPEN_SECTIONS.index(section))
        elif section in FOLDED_SECTIONS[:2]:
            group = (1, FOLDED_SECTIONS.index(section))
        elif section in FOLDED_SECTIONS:
            group = (3, FOLDED_SECTIONS.index(section))
        else:  # a section of the DAG's own: after Data and Resources, before Cluster and Promotion
            group = (2, first_seen[section])
        return (*group, position)

    ordered = sorted(enumerate(params.items()), key=rank)
    return {
        name: _as_shown(param, open_section=_section(param) in OPEN_SECTIONS) for _, (name, param) in ordered
    }


def native_dag(task: Any, builder: str) -> Any:
    """The DAG of a task that a pipeline created; it must render templates as native objects.

    :param task: a task the pipeline created in the current DAG.
    :param builder: the pipeline function, for the error message.
    """
    if not task.has_dag():
        raise ValueError(
            f"{builder} creates its tasks in the current DAG: call it inside a 'with DAG(...)' block"
        )
    dag = task.dag
    if not dag.render_template_as_native_obj:
        raise ValueError(
            f"DAG {dag.dag_id!r}: {builder} passes Params to its tasks as native objects ("
            "'{{ params.node_selector }}' is the Param's mapping, '{{ params.gpus }}' its integer): create the "
            "DAG with render_template_as_native_obj=True"
        )
    return dag


register_formats()


def with_dialect(params: Mapping[str, Any]) -> dict[str, Any]:
    """``params``, each Param's schema declaring its dialect, :data:`SCHEMA_DIALECT` (draft-07).

    Airflow checks a Param's value with ``jsonschema.validate``, which checks the schema itself
    against its dialect's meta-schema first, on every resolve; serializing a DAG (each parse by
    the DAG processor, each ``airflow dags test``) resolves every Param of every task several
    times. Without ``$schema``, jsonschema takes the 2020-12 dialect, whose meta-schema is seven
    vocabularies joined by references; draft-07's is one document, and every keyword the Params
    use (type, enum, minimum, pattern, items, properties, format, ...) means the same there. All of
    dags/ serialized in one process: 1.93 CPU-s with 2020-12, 0.69 with draft-07.

    :param params: a DAG's Params (plain values pass unchanged), in the order the form shows them.
    """
    for value in params.values():
        schema = getattr(value, "schema", None)
        if isinstance(schema, dict):
            schema.setdefault("$schema", SCHEMA_DIALECT)
    return dict(params)
