"""JSON patch (RFC 6902), JSON merge patch (RFC 7386) and Kubernetes strategic merge patch."""

from __future__ import annotations

import copy
from typing import Any

from include.devstack.kubeapi.meta import ApiError, bad_request

# Merge keys of the list fields the served kinds have (from the Go struct tags
# `patchStrategy:"merge" patchMergeKey:...`); any other list is replaced whole.
MERGE_KEYS: dict[str, str] = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "env": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
    "hostAliases": "ip",
    "conditions": "type",
    "ownerReferences": "uid",
    "resourceClaims": "name",
    "readinessGates": "conditionType",
    "containerStatuses": "name",
    "initContainerStatuses": "name",
    "podIPs": "ip",
    "hostIPs": "ip",
    "addresses": "type",
    "taints": "key",
}
SET_LISTS = {"finalizers"}  # patchStrategy:"merge" on a list of scalars

JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"


def apply_patch(content_type: str, target: dict, patch: Any) -> dict:
    ctype = content_type.split(";")[0].strip().lower()
    if ctype == JSON_PATCH:
        if not isinstance(patch, list):
            raise bad_request("json patch must be a list of operations")
        return json_patch(target, patch)
    if ctype == MERGE_PATCH:
        if not isinstance(patch, dict):
            raise bad_request("merge patch must be a JSON object")
        return merge_patch(target, patch)
    if ctype == STRATEGIC_PATCH:
        if not isinstance(patch, dict):
            raise bad_request("strategic merge patch must be a JSON object")
        return strategic_merge(target, patch)
    if ctype == APPLY_PATCH:
        raise ApiError(
            415,
            "UnsupportedMediaType",
            "server-side apply (application/apply-patch+yaml) of an existing object is not supported by the local "
            "Kubernetes API (it keeps no field managers; it creates new objects only): use client-side "
            "`kubectl apply` or a strategic merge patch",
        )
    raise ApiError(
        415,
        "UnsupportedMediaType",
        f'the body of the request was in an unknown format - accepted media types include: "{JSON_PATCH}", '
        f'"{MERGE_PATCH}", "{STRATEGIC_PATCH}"',
    )


# -- RFC 7386 --------------------------------------------------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# -- RFC 6902 --------------------------------------------------------------------------------


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise bad_request(f'json patch path "{path}" must start with "/"')
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc: Any, parts: list[str], path: str) -> Any:
    for part in parts:
        if isinstance(doc, dict):
            if part not in doc:
                raise ApiError(422, "Invalid", f'json patch: path "{path}" does not exist')
            doc = doc[part]
        elif isinstance(doc, list):
            try:
                doc = doc[int(part)]
            except (ValueError, IndexError):
                raise ApiError(422, "Invalid", f'json patch: path "{path}" does not exist') from None
        else:
            raise ApiError(422, "Invalid", f'json patch: path "{path}" does not exist')
    return doc


def json_patch(target: dict, ops: list[dict]) -> dict:
    doc = copy.deepcopy(target)
    for op in ops:
        kind, path = op.get("op"), op.get("path", "")
        parts = _pointer(path)
        if kind == "test":
            if _walk(doc, parts, path) != op.get("value"):
                raise ApiError(422, "Invalid", f'json patch: test failed at "{path}"')
            continue
        if kind in ("move", "copy"):
            src = _pointer(op.get("from", ""))
            value = copy.deepcopy(_walk(doc, src, op.get("from", "")))
            if kind == "move":
                _remove(doc, src, op.get("from", ""))
            _add(doc, parts, value, path)
            continue
        if kind == "add":
            _add(doc, parts, copy.deepcopy(op.get("value")), path)
        elif kind == "remove":
            _remove(doc, parts, path)
        elif kind == "replace":
            _remove(doc, parts, path)
            _add(doc, parts, copy.deepcopy(op.get("value")), path)
        else:
            raise bad_request(
                f'json patch: unknown operation "{kind}": expected add, remove, replace, move, copy or test'
            )
    return doc


def _add(doc: Any, parts: list[str], value: Any, path: str) -> None:
    if not parts:
        raise bad_request("json patch: replacing the whole object is not allowed")
    parent = _walk(doc, parts[:-1], path)
    last = parts[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        if last == "-":
            parent.append(value)
        else:
            try:
                idx = int(last)
            except ValueError:
                raise ApiError(422, "Invalid", f'json patch: bad array index in "{path}"') from None
            if not 0 <= idx <= len(parent):
                raise ApiError(422, "Invalid", f'json patch: array index out of range in "{path}"')
            parent.insert(idx, value)
    else:
        raise ApiError(422, "Invalid", f'json patch: path "{path}" does not exist')


def _remove(doc: Any, parts: list[str], path: str) -> None:
    parent = _walk(doc, parts[:-1], path)
    last = parts[-1] if parts else ""
    if isinstance(parent, dict) and last in parent:
        del parent[last]
    elif isinstance(parent, list):
        try:
            del parent[int(last)]
        except (ValueError, IndexError):
            raise ApiError(422, "Invalid", f'json patch: path "{path}" does not exist') from None
    else:
        raise ApiError(422, "Invalid", f'json patch: path "{path}" does not exist')


# -- strategic merge patch -------------------------------------------------------------------


def strategic_merge(target: Any, patch: Any, field: str = "") -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if patch.get("$patch") == "delete":
        return None
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    retain = patch.get("$retainKeys")
    for key, value in patch.items():
        if key in ("$patch", "$retainKeys") or key.startswith("$setElementOrder/"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            name = key.split("/", 1)[1]
            if isinstance(result.get(name), list):
                result[name] = [v for v in result[name] if v not in value]
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list):
            result[key] = _merge_list(key, result.get(key), value)
        elif isinstance(value, dict):
            merged = strategic_merge(result.get(key), value, key)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        else:
            result[key] = value
    if isinstance(retain, list):
        result = {k: v for k, v in result.items() if k in retain}
    return result


def _merge_list(field: str, current: Any, patch: list) -> list:
    current = current if isinstance(current, list) else []
    if field in SET_LISTS:
        out = list(current)
        for v in patch:
            if v not in out:
                out.append(v)
        return out
    key = MERGE_KEYS.get(field)
    if field == "ports" and any(
        isinstance(p, dict) and "port" in p and "containerPort" not in p for p in patch
    ):
        key = "port"  # a Service's ports merge on port, a container's on containerPort
    if not key or not all(isinstance(p, dict) for p in patch):
        return [p for p in copy.deepcopy(patch) if not (isinstance(p, dict) and p.get("$patch"))]
    if any(isinstance(p, dict) and p.get("$patch") == "replace" for p in patch):
        return [copy.deepcopy(p) for p in patch if p.get("$patch") != "replace"]
    out = copy.deepcopy(current)
    for item in patch:
        ident = item.get(key)
        idx = next((i for i, c in enumerate(out) if isinstance(c, dict) and c.get(key) == ident), None)
        if item.get("$patch") == "delete":
            if idx is not None:
                out.pop(idx)
            continue
        if idx is None:
            out.append(strategic_merge({}, item, field))
        else:
            out[idx] = strategic_merge(out[idx], item, field)
    return out
