"""Label and field selectors with the grammar of ``k8s.io/apimachinery`` (labels.Parse, fields.ParseSelector)."""

from __future__ import annotations

import re
from collections.abc import Callable

from include.devstack.kubeapi.meta import bad_request

Predicate = Callable[[dict], bool]

_TOKEN = re.compile(r"\s*(!=|==|=|!|\(|\)|,|>|<|[^\s!=(),<>]+)")


def _tokens(text: str) -> list[str]:
    out, pos = [], 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise bad_request(f'unable to parse requirement: invalid label selector "{text}"')
        out.append(m.group(1))
        pos = m.end()
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return out


def parse_label_selector(text: str | None) -> Predicate:
    """Compile a label selector: ``k``, ``!k``, ``k=v``, ``k==v``, ``k!=v``, ``k in (a,b)``, ``k notin (a)``, ``k>1``."""
    if not text or not text.strip():
        return lambda obj: True
    toks = _tokens(text)
    reqs: list[Callable[[dict[str, str]], bool]] = []
    i = 0

    def err(why: str):
        return bad_request(f'unable to parse requirement: {why} in label selector "{text}"')

    while i < len(toks):
        tok = toks[i]
        if tok == "!":
            if i + 1 >= len(toks):
                raise err("expected a key after '!'")
            key = toks[i + 1]
            reqs.append(lambda labels, k=key: k not in labels)
            i += 2
        else:
            key = tok
            op = toks[i + 1] if i + 1 < len(toks) else ","
            if op == ",":
                reqs.append(lambda labels, k=key: k in labels)
                i += 1
            elif op in ("=", "==", "!="):
                if i + 2 >= len(toks) or toks[i + 2] == ",":
                    value, i = "", i + 2
                else:
                    value, i = toks[i + 2], i + 3
                if op == "!=":
                    reqs.append(lambda labels, k=key, v=value: labels.get(k) != v)
                else:
                    reqs.append(lambda labels, k=key, v=value: labels.get(k) == v)
            elif op in ("in", "notin"):
                if i + 2 >= len(toks) or toks[i + 2] != "(":
                    raise err(f"expected '(' after '{op}'")
                j, values = i + 3, set()
                while j < len(toks) and toks[j] != ")":
                    if toks[j] != ",":
                        values.add(toks[j])
                    j += 1
                if j >= len(toks):
                    raise err("expected ')'")
                if op == "in":
                    reqs.append(lambda labels, k=key, vs=frozenset(values): labels.get(k) in vs)
                else:
                    reqs.append(lambda labels, k=key, vs=frozenset(values): labels.get(k) not in vs)
                i = j + 1
            elif op in (">", "<"):
                if i + 2 >= len(toks):
                    raise err(f"expected an integer after '{op}'")
                try:
                    bound = int(toks[i + 2])
                except ValueError:
                    raise err(f"for '{op}', the value must be an integer") from None

                def cmp(labels, k=key, b=bound, gt=op == ">"):
                    try:
                        v = int(labels[k])
                    except (KeyError, ValueError):
                        return False
                    return v > b if gt else v < b

                reqs.append(cmp)
                i += 3
            else:
                raise err(f"found '{op}', expected: '=', '!=', '==', 'in', 'notin'")
        if i < len(toks):
            if toks[i] != ",":
                raise err(f"found '{toks[i]}', expected: ','")
            i += 1

    def predicate(obj: dict) -> bool:
        labels = obj.get("metadata", {}).get("labels") or {}
        return all(r(labels) for r in reqs)

    return predicate


def _pod_fields(obj: dict) -> dict[str, str]:
    spec, status = obj.get("spec", {}), obj.get("status", {})
    return {
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.restartPolicy": spec.get("restartPolicy", ""),
        "spec.schedulerName": spec.get("schedulerName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "spec.hostNetwork": str(bool(spec.get("hostNetwork", False))).lower(),
        "status.phase": status.get("phase", ""),
        "status.podIP": status.get("podIP", ""),
        "status.nominatedNodeName": status.get("nominatedNodeName", ""),
    }


def _event_fields(obj: dict) -> dict[str, str]:
    inv = obj.get("involvedObject", {})
    out = {
        f"involvedObject.{k}": str(inv.get(k, ""))
        for k in ("kind", "namespace", "name", "uid", "apiVersion", "resourceVersion", "fieldPath")
    }
    out.update(
        {
            "reason": obj.get("reason", ""),
            "reportingComponent": obj.get("reportingComponent", ""),
            "source": obj.get("source", {}).get("component", ""),
            "type": obj.get("type", ""),
        }
    )
    return out


def _job_fields(obj: dict) -> dict[str, str]:
    return {"status.successful": str(obj.get("status", {}).get("succeeded", 0))}


def _secret_fields(obj: dict) -> dict[str, str]:
    return {"type": obj.get("type", "")}


def _namespace_fields(obj: dict) -> dict[str, str]:
    return {"status.phase": obj.get("status", {}).get("phase", "")}


FIELD_GETTERS: dict[str, Callable[[dict], dict[str, str]]] = {
    "pods": _pod_fields,
    "events": _event_fields,
    "jobs": _job_fields,
    "secrets": _secret_fields,
    "namespaces": _namespace_fields,
}


def parse_field_selector(resource: str, text: str | None) -> Predicate:
    """Compile a field selector (``=``, ``==``, ``!=``, comma = and) for ``resource``."""
    if not text or not text.strip():
        return lambda obj: True
    getter = FIELD_GETTERS.get(resource, lambda obj: {})
    reqs: list[tuple[str, str, bool]] = []
    for part in _split_unescaped(text):
        part = part.strip()
        for op in ("!=", "==", "="):
            if op in part:
                key, _, value = part.partition(op)
                reqs.append((key.strip(), _unescape(value.strip()), op == "!="))
                break
        else:
            raise bad_request(f"invalid selector: '{text}'; can't understand '{part}'")
    sample_keys = {"metadata.name", "metadata.namespace"} | set(getter({}).keys())
    for key, _, _ in reqs:
        if key not in sample_keys:
            raise bad_request(
                f'"{key}" is not a known field selector: only "{", ".join(sorted(sample_keys))}"'
            )

    def predicate(obj: dict) -> bool:
        values = getter(obj)
        values["metadata.name"] = obj["metadata"].get("name", "")
        values["metadata.namespace"] = obj["metadata"].get("namespace", "")
        return all((values.get(k, "") != v) if neg else (values.get(k, "") == v) for k, v, neg in reqs)

    return predicate


def _split_unescaped(text: str) -> list[str]:
    parts, cur, esc = [], "", False
    for ch in text:
        if esc:
            cur += "\\" + ch
            esc = False
        elif ch == "\\":
            esc = True
        elif ch == ",":
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p for p in parts if p.strip()]


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", r"\1", value)


def match_label_selector_object(selector: dict | None, labels: dict[str, str]) -> bool:
    """Evaluate a ``metav1.LabelSelector`` object (matchLabels + matchExpressions)."""
    if not selector:
        return False
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], set(expr.get("values") or [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True
