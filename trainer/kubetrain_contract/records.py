"""Versioned records: the JSON documents that cross between the Airflow side and the pod side.

A record is a frozen dataclass that subclasses :class:`Record`. It names its ``KIND`` and
``FORMAT_VERSION``, which every document carries, and reads and writes itself:

* :meth:`Record.to_json` / :meth:`Record.to_dict` write the document, ``kind`` and
  ``format_version`` first;
* :meth:`Record.from_json` / :meth:`Record.from_dict` read one back, refusing a ``kind`` or
  ``format_version`` it does not know and any field whose value is not of the declared type, with
  a :class:`RecordError` that names the document, the field, the value and what was expected;
* :meth:`Record.json_schema` is the record's JSON Schema (draft 2020-12), generated from the
  field types and each field's :func:`spec` (description, minimum, format, JSON name). The files in
  ``kubetrain_contract/schemas/`` are these schemas, written by
  ``python -m kubetrain_contract --write`` and checked to match by the tests.

Field types a record may use: ``str``, ``int``, ``float``, ``bool``, ``None``, ``Any``, unions of
them, ``Literal[...]``, ``list[T]``, ``dict[str, T]`` and nested (plain) dataclasses. A field
with a default may be absent from a document (the default is then taken); the others are
required. Fields not declared are ignored on reading, so that a reader of version 1 reads a
version-1 document written by a newer writer that added an optional field.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
SCHEMA_BASE = "https://kubetrain.dev/schemas/"
SCHEMA_DIR = Path(__file__).resolve().parent / "schemas"

R = TypeVar("R", bound="Record")
_MISSING = dataclasses.MISSING


class RecordError(ValueError):
    """A document that is not a valid record of the kind it claims or is expected to be."""


def spec(
    default: Any = _MISSING,
    *,
    description: str = "",
    json_name: str | None = None,
    default_factory: Any = _MISSING,
    **schema: Any,
) -> Any:
    """A record field with its schema: ``description``, ``json_name`` (the document's key where it
    is not a Python name, as ``pass``) and further JSON Schema keywords (``minimum``, ``format``...).

    Without ``default`` the field has none, but type checkers take any call on a field's right-hand
    side for a default: a field without one that follows it carries ``# type: ignore[misc]``."""
    metadata: dict[str, Any] = {
        "schema": dict(schema, **({"description": description} if description else {}))
    }
    if json_name:
        metadata["json_name"] = json_name
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _json_name(field: dataclasses.Field) -> str:
    return field.metadata.get("json_name", field.name)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    # once per class: evaluating the annotations cost 0.2 ms per nested record (a manifest's objects)
    return get_type_hints(cls, include_extras=False)


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


_SIMPLE = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}


def _expected(tp: Any) -> str:
    """What a value of ``tp`` looks like, in words for an error message."""
    if tp is Any:
        return "any JSON value"
    if tp in _SIMPLE:
        return {"string": "a string", "integer": "an integer", "number": "a number"}.get(
            _SIMPLE[tp], _SIMPLE[tp]
        )
    if _is_union(tp):
        return " or ".join(_expected(t) for t in get_args(tp))
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(v) for v in get_args(tp))
    if origin is list:
        return f"a list of {_expected(get_args(tp)[0])}"
    if origin is dict:
        return f"an object of {_expected(get_args(tp)[1])}"
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return f"an object ({tp.__name__})"
    return tp.__name__


def _bad(value: Any, tp: Any, where: str, path: str) -> RecordError:
    shown = repr(value)
    shown = shown if len(shown) <= 200 else shown[:200] + "..."
    return RecordError(f"{where}: field {path!r} is {shown}, expected {_expected(tp)}")


# A converter turns a document's value into the field's type: ``conv(value, where, path)``, raising
# RecordError that names the document, the field and what was expected. One is built per type and
# kept: a dataset manifest of 2,000 objects was read in 47 ms when each value's type was taken
# apart again (``get_origin`` per value), in 12 ms with them (stage-in's start,
# bench/notes/transfer-profile.md).
_Converter = typing.Callable[[Any, str, str], Any]


@functools.cache
def _converter(tp: Any) -> _Converter:
    if tp is Any:
        return lambda value, where, path: value
    if _is_union(tp):
        return _union_converter(tp)

    def checked(
        ok: typing.Callable[[Any], bool], make: typing.Callable[[Any], Any] | None = None
    ) -> _Converter:
        def conv(value: Any, where: str, path: str) -> Any:
            if ok(value):
                return value if make is None else make(value)
            raise _bad(value, tp, where, path)

        return conv

    if tp is type(None):
        return checked(lambda v: v is None)
    if tp is bool:
        return checked(lambda v: isinstance(v, bool))
    if tp is int:
        return checked(lambda v: isinstance(v, int) and not isinstance(v, bool))
    if tp is float:
        return checked(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), float)
    if tp is str:
        return checked(lambda v: isinstance(v, str))
    origin = get_origin(tp)
    if origin is Literal:
        allowed, kinds = get_args(tp), {type(v) for v in get_args(tp)}
        return checked(lambda v: v in allowed and type(v) in kinds)
    if origin is list:
        (item_type,) = get_args(tp)
        item = _converter(item_type)

        def list_conv(value: Any, where: str, path: str) -> Any:
            if not isinstance(value, list):
                raise _bad(value, tp, where, path)
            return [item(v, where, f"{path}[{i}]") for i, v in enumerate(value)]

        return list_conv
    if origin is dict:
        item = _converter(get_args(tp)[1])

        def dict_conv(value: Any, where: str, path: str) -> Any:
            if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                raise _bad(value, tp, where, path)
            return {k: item(v, where, f"{path}.{k}") for k, v in value.items()}

        return dict_conv
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):

        def object_conv(value: Any, where: str, path: str) -> Any:
            if not isinstance(value, dict):
                raise _bad(value, tp, where, path)
            return _build(tp, value, where, f"{path}.")

        return object_conv
    raise TypeError(f"record field type {tp!r}, which kubetrain_contract.records cannot read")


def _union_converter(tp: Any) -> _Converter:
    options = [_converter(t) for t in get_args(tp)]

    def conv(value: Any, where: str, path: str) -> Any:
        for option in options:  # the first that takes the value
            try:
                return option(value, where, path)
            except RecordError:
                continue
        raise _bad(value, tp, where, path)

    return conv


@functools.cache
def _fields(cls: type) -> tuple[tuple[str, str, bool, _Converter, Any, Any, Any], ...]:
    """Per init field of ``cls``: its name, JSON name, whether it is required, its converter, its
    type, and the schema's minimum and maximum (None where not set)."""
    hints = _hints(cls)
    out = []
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        schema = field.metadata.get("schema", {})
        required = field.default is _MISSING and field.default_factory is _MISSING
        tp = hints[field.name]
        out.append(
            (
                field.name,
                _json_name(field),
                required,
                _converter(tp),
                tp,
                schema.get("minimum"),
                schema.get("maximum"),
            )
        )
    return tuple(out)


def _build(cls: type, doc: Mapping[str, Any], where: str, prefix: str = "") -> Any:
    values: dict[str, Any] = {}
    for name, json_name, required, conv, tp, low, high in _fields(cls):
        if json_name not in doc:
            if required:
                raise RecordError(
                    f"{where}: field {prefix + json_name!r} is missing, expected {_expected(tp)}"
                )
            continue
        value = conv(doc[json_name], where, prefix + json_name)
        if (
            (low is not None or high is not None)
            and isinstance(value, (int, float))
            and not isinstance(value, bool)
        ):
            if low is not None and value < low:
                raise RecordError(
                    f"{where}: field {prefix + json_name!r} is {value!r}, expected at least {low}"
                )
            if high is not None and value > high:
                raise RecordError(
                    f"{where}: field {prefix + json_name!r} is {value!r}, expected at most {high}"
                )
        values[name] = value
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, RecordError):
            raise
        raise RecordError(f"{where}: {exc}") from exc


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _dump(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _dump(obj: Any) -> dict[str, Any]:
    return {_json_name(f): _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def _type_schema(tp: Any) -> dict[str, Any]:
    if tp is Any:
        return {}
    if tp in _SIMPLE:
        return {"type": _SIMPLE[tp]}
    if _is_union(tp):
        options = [_type_schema(t) for t in get_args(tp)]
        if all(set(o) == {"type"} for o in options):
            kinds: list[str] = []
            for o in options:
                kinds += o["type"] if isinstance(o["type"], list) else [o["type"]]
            return {"type": kinds}
        return {"anyOf": options}
    origin = get_origin(tp)
    if origin is Literal:
        values = list(get_args(tp))
        return {"const": values[0]} if len(values) == 1 else {"enum": values}
    if origin is list:
        return {"type": "array", "items": _type_schema(get_args(tp)[0])}
    if origin is dict:
        return {"type": "object", "additionalProperties": _type_schema(get_args(tp)[1])}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _object_schema(tp)
    raise TypeError(f"no JSON Schema for {tp!r}")


def _object_schema(cls: type, head: Mapping[str, Any] | None = None) -> dict[str, Any]:
    hints = _hints(cls)
    properties: dict[str, Any] = dict(head or {})
    required = list(head or {})
    for field in dataclasses.fields(cls):
        name = _json_name(field)
        prop = _type_schema(hints[field.name])
        prop.update(field.metadata.get("schema", {}))
        properties[name] = prop
        if field.default is _MISSING and field.default_factory is _MISSING:
            required.append(name)
    schema: dict[str, Any] = {"type": "object"}
    doc = typing.cast(str, cls.__doc__ or "").strip()
    if doc and not head:
        schema["description"] = " ".join(doc.split())
    schema["required"] = required
    schema["properties"] = properties
    return schema


@dataclasses.dataclass(frozen=True)
class Record:
    """Base of the versioned records; see the module's documentation."""

    KIND: ClassVar[str] = ""
    FORMAT_VERSION: ClassVar[int] = 1
    #: the schema file's stem, as ``sync-pass`` for ``schemas/sync-pass.v1.json``
    SCHEMA_NAME: ClassVar[str] = ""
    TITLE: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        """The document: ``kind`` and ``format_version``, then the fields."""
        return {"kind": self.KIND, "format_version": self.FORMAT_VERSION, **_dump(self)}

    def to_json(self, *, indent: int | None = 2) -> str:
        """The document as JSON text (strict: NaN and infinities are refused)."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def check_header(cls, doc: Any, where: str) -> dict[str, Any]:
        """``doc`` if it is an object of this record's kind and version, else :class:`RecordError`."""
        if not isinstance(doc, dict):
            raise RecordError(f"{where}: expected a JSON object ({cls.KIND}), got {type(doc).__name__}")
        if doc.get("kind") != cls.KIND:
            raise RecordError(f"{where}: unknown kind {doc.get('kind')!r}, expected {cls.KIND!r}")
        if doc.get("format_version") != cls.FORMAT_VERSION:
            raise RecordError(
                f"{where}: unknown format_version {doc.get('format_version')!r} of {cls.KIND}; "
                f"this version of kubetrain reads format_version {cls.FORMAT_VERSION}"
            )
        return doc

    @classmethod
    def from_dict(cls: type[R], doc: Any, where: str | None = None) -> R:
        """The record that ``doc`` holds; :class:`RecordError` names what is wrong with it."""
        where = where or cls.KIND
        return _build(cls, cls.check_header(doc, where), where)

    @classmethod
    def from_json(cls: type[R], data: bytes | str, where: str | None = None) -> R:
        """The record in JSON text ``data``; :class:`RecordError` when it is not JSON or not valid."""
        where = where or cls.KIND
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise RecordError(f"{where}: not valid JSON ({exc})") from exc
        return cls.from_dict(doc, where)

    @classmethod
    def schema_file(cls) -> str:
        return f"{cls.SCHEMA_NAME}.v{cls.FORMAT_VERSION}.json"

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        """The record's JSON Schema, generated from its fields."""
        head = {"kind": {"const": cls.KIND}, "format_version": {"const": cls.FORMAT_VERSION}}
        body = _object_schema(cls, head)
        return {
            "$schema": SCHEMA_DIALECT,
            "$id": SCHEMA_BASE + cls.schema_file(),
            "title": cls.TITLE or f"{cls.KIND}, format version {cls.FORMAT_VERSION}",
            "description": " ".join((cls.__doc__ or "").split()),
            **body,
        }


def schema_text(cls: type[Record]) -> str:
    """The schema file's text for ``cls``."""
    return json.dumps(cls.json_schema(), indent=2) + "\n"


def registered() -> list[type[Record]]:
    """Every record of the contract, for the schema files and their check."""
    from kubetrain_contract import RECORDS

    return list(RECORDS)
