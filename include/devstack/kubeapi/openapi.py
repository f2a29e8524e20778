"""Schema checks of request bodies (kubernetes-validate's JSON schemas of the oldest Kubernetes minor kubetrain
supports) and the OpenAPI documents that kubectl reads to decide how to validate (``fieldValidation``) and
how to build patches. As on a real server, an unknown field is refused with ``fieldValidation=Strict``,
dropped with a warning otherwise (a field newer than that minor is unknown, as it would be there)."""

from __future__ import annotations

import hashlib
import json
import logging
from functools import cache
from pathlib import Path

from aiohttp import web

from include.devstack.kubeapi.meta import (
    MINIMUM_MINOR,
    RESOURCES,
    ApiError,
    Resource,
    invalid,
    served_versions,
)

log = logging.getLogger("kubeapi.openapi")
SCHEMA_VERSION = f"1.{MINIMUM_MINOR}.0"


def _path(error) -> str:
    out = ""
    for part in error.absolute_path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def schema_check(res: Resource, obj: dict, mode: str) -> list[str]:
    """Type errors are 400 BadRequest; unknown fields are 400 with ``fieldValidation=Strict``, else dropped from
    ``obj`` (in place) with a warning each (``Warn``) or silently (``Ignore``)."""
    if mode not in ("Strict", "Warn", "Ignore"):
        raise ApiError(
            400, "BadRequest", f'fieldValidation must be one of "Ignore", "Warn" or "Strict", got "{mode}"'
        )
    if res.group == KUEUE_GROUP:
        return _crd_check(res, obj, mode)
    try:
        import kubernetes_validate
    except ImportError:  # the check is an extra: without the package, bodies are taken as they are
        return []
    try:
        kubernetes_validate.validate(obj, SCHEMA_VERSION, strict=False)
    except kubernetes_validate.ValidationError as exc:
        where = _path(exc)
        raise ApiError(
            400,
            "BadRequest",
            f'{res.kind} in version "{res.version}" cannot be handled as a {res.kind}: {where}: {exc.message}',
        ) from None
    except Exception as exc:  # noqa: BLE001 - a schema the package lacks is not the request's fault
        log.debug("no schema check for %s: %s", res.kind, exc)
        return []
    unknown = _unknown_fields(obj)
    if unknown and mode == "Strict":
        joined = ", ".join(f'unknown field "{u}"' for u in unknown)
        raise ApiError(400, "BadRequest", f"strict decoding error: {joined}")
    return [] if mode == "Ignore" else [f'unknown field "{u}"' for u in unknown]


# Kueue v0.19.2's CRDs (config/components/crd/bases): each kind's served versions' openAPIV3Schema
KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_CRD_SCHEMAS = Path(__file__).with_name("kueue-v0.19.2-crd-schemas.json")


@cache
def _crd_schemas() -> dict:
    return json.loads(KUEUE_CRD_SCHEMAS.read_text())["kinds"]


def closed_schema(node):
    """A CRD schema with unknown fields refused wherever it lists an object's fields (what the API server
    prunes, or refuses under ``fieldValidation=Strict``)."""
    if isinstance(node, list):
        return [closed_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: closed_schema(v) for k, v in node.items()}
    if (
        out.get("type") == "object"
        and "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def _crd_check(res: Resource, obj: dict, mode: str) -> list[str]:
    """A Kueue object checked as kube-apiserver checks a custom resource against its CRD's schema: a value
    the schema refuses is 422 Invalid; an unknown field is pruned (with a warning under ``Warn``) or refused
    under ``Strict``. The CRD's CEL rules (x-kubernetes-validations) are not evaluated."""
    import jsonschema

    schema = (_crd_schemas().get(res.kind) or {}).get(res.version)
    if schema is None:
        return []
    name = (obj.get("metadata") or {}).get("name", "")
    unknown: list[str] = []
    for error in jsonschema.Draft7Validator(closed_schema(schema)).iter_errors(obj):
        if error.validator != "additionalProperties" or not isinstance(error.instance, dict):
            continue
        for key in [k for k in error.instance if k not in (error.schema.get("properties") or {})]:
            base = _path(error)
            unknown.append(f"{base}.{key}" if base else key)
            node = obj
            for part in error.absolute_path:
                node = node[part]
            node.pop(key, None)
    if unknown and mode == "Strict":
        raise ApiError(
            400, "BadRequest", "strict decoding error: " + ", ".join(f'unknown field "{u}"' for u in unknown)
        )
    causes = []
    for error in sorted(
        jsonschema.Draft7Validator(schema).iter_errors(obj), key=lambda e: list(e.absolute_path)
    ):
        where = _path(error)
        if error.validator == "enum":
            supported = ", ".join(json.dumps(v) for v in error.validator_value)
            causes.append(
                (
                    where,
                    "FieldValueNotSupported",
                    f"Unsupported value: {json.dumps(error.instance)}: supported values: {supported}",
                )
            )
        elif error.validator == "required":
            causes.append((where, "FieldValueRequired", f"Required value: {error.message}"))
        else:
            causes.append(
                (where, "FieldValueInvalid", f"Invalid value: {json.dumps(error.instance)}: {error.message}")
            )
    if causes:
        raise invalid(res.kind, name, causes, res.group)
    return [] if mode == "Ignore" else [f'unknown field "{u}"' for u in unknown]


def _unknown_fields(obj: dict) -> list[str]:
    """The unknown fields of ``obj``, dropped from it in place (its nested objects stay the same objects:
    the caller may hold them)."""
    import jsonschema
    import kubernetes_validate

    out = []
    seen = 0
    current = obj
    # kubernetes-validate stops at the first error: drop each unknown field and look again
    while seen < 20:
        try:
            kubernetes_validate.validate(current, SCHEMA_VERSION, strict=True)
            break
        except jsonschema.ValidationError as exc:
            if exc.validator != "additionalProperties":
                break
            extra = [k for k in exc.instance if k not in (exc.schema.get("properties") or {})]
            if not extra:
                break
            base = _path(exc)
            node = current
            for part in exc.absolute_path:
                node = node[part]
            for key in extra:
                out.append(f"{base}.{key}" if base else key)
                node.pop(key, None)
            seen += 1
    return out


# -- OpenAPI documents -----------------------------------------------------------------------


def _group_versions() -> list[tuple[str, str]]:
    """Every (group, version) served, as kube-apiserver publishes one document for each: a group with
    several served versions (Kueue's v1beta2 and v1beta1) has one per version."""
    out = [("", "v1")]
    for group in sorted({r.group for r in RESOURCES.values() if r.group}):
        out += [(group, version) for version in served_versions(group)]
    return out


def _v3_index() -> dict:
    # the hash in each URL lets kubectl keep the document in its disk cache, as with a real server
    paths = {}
    for group, version in _group_versions():
        key = f"apis/{group}/{version}" if group else f"api/{version}"
        paths[key] = {"serverRelativeURL": f"/openapi/v3/{key}?hash={_v3_document(group, version)[1]}"}
    return {"paths": paths}


@cache
def _v3_document(group: str, version: str = "v1") -> tuple[bytes, str]:
    body = json.dumps(_v3_group(group, version), separators=(",", ":")).encode()
    return body, hashlib.sha512(body).hexdigest().upper()


def _field_validation_param() -> dict:
    return {
        "name": "fieldValidation",
        "in": "query",
        "description": "Ignore, Warn or Strict handling of unknown fields",
        "schema": {"type": "string", "uniqueItems": True},
    }


@cache
def _v3_group(group: str, version: str = "v1") -> dict:
    paths: dict = {}
    prefix = f"/apis/{group}/{version}" if group else f"/api/{version}"
    for res in RESOURCES.values():
        if res.group != group:
            continue
        ns = "/namespaces/{namespace}" if res.namespaced else ""
        ops = {
            "x-kubernetes-group-version-kind": {"group": group, "version": version, "kind": res.kind},
        }
        item_ops = {}
        for verb, method in (("patch", "patch"), ("update", "put"), ("get", "get"), ("delete", "delete")):
            if verb in res.verbs:
                item_ops[method] = {
                    "operationId": f"{verb}{res.kind}",
                    "parameters": [_field_validation_param()] if verb in ("patch", "update") else [],
                    "x-kubernetes-action": verb,
                    **ops,
                }
        coll_ops = {}
        if "create" in res.verbs:
            coll_ops["post"] = {
                "operationId": f"create{res.kind}",
                "parameters": [_field_validation_param()],
                "x-kubernetes-action": "post",
                **ops,
            }
        if "list" in res.verbs:
            coll_ops["get"] = {"operationId": f"list{res.kind}", "x-kubernetes-action": "list", **ops}
        paths[f"{prefix}{ns}/{res.name}"] = coll_ops
        paths[f"{prefix}{ns}/{res.name}/{{name}}"] = item_ops
    roots = [
        f"{_definition_prefix(group, version)}.{res.kind}" for res in RESOURCES.values() if res.group == group
    ]
    roots += [f"{name}List" for name in roots] + [f"{META}.Status", f"{META}.DeleteOptions"]
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes (kubetrain local API)", "version": f"v{SCHEMA_VERSION}"},
        "paths": paths,
        "components": {"schemas": _schemas(tuple(roots))},
    }


# -- component schemas, from kubernetes-validate's JSON schemas ---------------------------------

META = "io.k8s.apimachinery.pkg.apis.meta.v1"


def _definition_prefix(group: str, version: str) -> str:
    if group == "":
        return f"io.k8s.api.core.{version}"
    if group == "apiextensions.k8s.io":
        return f"io.k8s.apiextensions-apiserver.pkg.apis.apiextensions.{version}"
    if group == "rbac.authorization.k8s.io":
        return f"io.k8s.api.rbac.{version}"
    return f"io.k8s.api.{group.removesuffix('.k8s.io').replace('.', '')}.{version}"


@cache
def _definitions() -> dict:
    from importlib.resources import files

    path = (
        files("kubernetes_validate")
        / "kubernetes-json-schema"
        / f"v{SCHEMA_VERSION}-local"
        / "_definitions.json"
    )
    return json.loads(path.read_text())["$defs"]


def _convert(node):
    """A JSON-schema node of kubernetes-validate as the API server's OpenAPI v3 writes it."""
    if isinstance(node, list):
        return [_convert(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    ref = (
        node.get("$ref") if isinstance(node.get("$ref"), str) else None
    )  # JSONSchemaProps has a "$ref" property
    for key, value in node.items():
        if key == "$ref" and ref is not None:
            continue
        if key == "type" and isinstance(value, list):
            kinds = [t for t in value if t != "null"]
            value = kinds[0] if len(kinds) == 1 else kinds
        out[key] = _convert(value)
    if ref is not None:
        target = {"$ref": ref.replace("#/$defs/", "#/components/schemas/")}
        if out:  # a reference with its own description: the server wraps it in allOf
            return {"allOf": [target], **out}
        return target
    return out


@cache
def _schemas(roots: tuple[str, ...]) -> dict:
    defs = _definitions()
    out: dict = {}
    todo = [r for r in roots if r in defs]
    while todo:
        name = todo.pop()
        if name in out:
            continue
        schema = _convert(defs[name])
        props = schema.get("properties") or {}
        for field in ("apiVersion", "kind"):  # the JSON schemas pin them with an enum; the server's do not
            if isinstance(props.get(field), dict):
                props[field].pop("enum", None)
        out[name] = schema
        text = json.dumps(defs[name])
        for part in text.split('"#/$defs/')[1:]:
            todo.append(part.split('"', 1)[0])
    return out


def handle(request: web.Request, parts: list[str]) -> web.Response:
    if parts == ["v3"]:
        return web.json_response(_v3_index())
    if parts[:1] == ["v3"]:
        rest = "/".join(parts[1:])
        for group, version in _group_versions():
            if rest == (f"apis/{group}/{version}" if group else f"api/{version}"):
                body, digest = _v3_document(group, version)
                headers = {"Etag": f'"{digest}"'}
                if request.query.get("hash") == digest:
                    headers["Cache-Control"] = "public, immutable"
                return web.Response(body=body, content_type="application/json", headers=headers)
    raise ApiError(404, "NotFound", f"the server could not find the requested resource ({request.path})")
