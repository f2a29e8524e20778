"""Schema checks of request bodies (kubernetes-validate's v1.32 JSON schemas) and the OpenAPI documents
that kubectl reads to decide how to validate (``fieldValidation``) and how to build patches."""

from __future__ import annotations

import json
import logging
from functools import cache

from aiohttp import web

from include.devstack.kubeapi.meta import RESOURCES, ApiError, Resource

log = logging.getLogger("kubeapi.openapi")
SCHEMA_VERSION = "1.32.0"


def _path(error) -> str:
    out = ""
    for part in error.absolute_path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def schema_check(res: Resource, obj: dict, mode: str) -> list[str]:
    """Type errors are 400 BadRequest; unknown fields are 400 with ``fieldValidation=Strict``, else warnings."""
    if mode not in ("Strict", "Warn", "Ignore"):
        raise ApiError(
            400, "BadRequest", f'fieldValidation must be one of "Ignore", "Warn" or "Strict", got "{mode}"'
        )
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
    if mode == "Ignore":
        return []
    unknown = _unknown_fields(obj)
    if unknown and mode == "Strict":
        joined = ", ".join(f'unknown field "{u}"' for u in unknown)
        raise ApiError(400, "BadRequest", f"strict decoding error: {joined}")
    return [f'unknown field "{u}"' for u in unknown]


def _unknown_fields(obj: dict) -> list[str]:
    import jsonschema
    import kubernetes_validate

    out = []
    seen = 0
    current = json.loads(json.dumps(obj))
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


@cache
def _v3_index() -> dict:
    paths = {"api/v1": {"serverRelativeURL": "/openapi/v3/api/v1"}}
    for group in sorted({r.group for r in RESOURCES.values() if r.group}):
        paths[f"apis/{group}/v1"] = {"serverRelativeURL": f"/openapi/v3/apis/{group}/v1"}
    return {"paths": paths}


def _field_validation_param() -> dict:
    return {
        "name": "fieldValidation",
        "in": "query",
        "description": "Ignore, Warn or Strict handling of unknown fields",
        "schema": {"type": "string", "uniqueItems": True},
    }


@cache
def _v3_group(group: str) -> dict:
    paths: dict = {}
    prefix = f"/apis/{group}/v1" if group else "/api/v1"
    for res in RESOURCES.values():
        if res.group != group:
            continue
        ns = "/namespaces/{namespace}" if res.namespaced else ""
        ops = {
            "x-kubernetes-group-version-kind": {"group": group, "version": res.version, "kind": res.kind},
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
            coll_ops["post"] = {"operationId": f"create{res.kind}", "parameters": [_field_validation_param()],
                                "x-kubernetes-action": "post", **ops}  # fmt: skip
        if "list" in res.verbs:
            coll_ops["get"] = {"operationId": f"list{res.kind}", "x-kubernetes-action": "list", **ops}
        paths[f"{prefix}{ns}/{res.name}"] = coll_ops
        paths[f"{prefix}{ns}/{res.name}/{{name}}"] = item_ops
    return {"openapi": "3.0.0", "info": {"title": "Kubernetes (kubetrain local API)", "version": "v1.32.0"},
            "paths": paths, "components": {"schemas": {}}}  # fmt: skip


def handle(request: web.Request, parts: list[str]) -> web.Response:
    if parts == ["v3"]:
        return web.json_response(_v3_index())
    if parts[:1] == ["v3"]:
        rest = "/".join(parts[1:])
        if rest == "api/v1":
            return web.json_response(_v3_group(""))
        for group in {r.group for r in RESOURCES.values() if r.group}:
            if rest == f"apis/{group}/v1":
                return web.json_response(_v3_group(group))
    raise ApiError(404, "NotFound", f"the server could not find the requested resource ({request.path})")
