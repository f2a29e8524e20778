"""Authentication by bearer token and authorization with Kubernetes' RBAC semantics.

* **Who**: a request's ``Authorization: Bearer <token>`` names a user and its groups, from the token
  file the server was started with (``--token-auth-file``, kube-apiserver's format:
  ``token,user,uid,"group1,group2"``). A service account's user is
  ``system:serviceaccount:<namespace>:<name>``, in the groups ``system:serviceaccounts``,
  ``system:serviceaccounts:<namespace>`` and ``system:authenticated``. A request without a token is
  ``system:anonymous`` (group ``system:unauthenticated``); an unknown token is 401 Unauthorized.
* **What**: the request's attributes as kube-apiserver derives them: the verb (get, list, watch,
  create, update, patch, delete, deletecollection), API group, resource, subresource, name and
  namespace, or the path of a non-resource request (discovery, /version, /openapi).
* **Allowed**: when a RoleBinding in the request's namespace or a ClusterRoleBinding names the user,
  one of its groups or its service account, and the Role or ClusterRole it refers to has a rule
  whose apiGroups, resources (``pods/exec`` for a subresource, ``*`` and ``*/scale`` wildcards),
  resourceNames and verbs (or nonResourceURLs, ``/apis/*`` prefixes) match. Nothing else allows.
* The bootstrap roles of every cluster: ``cluster-admin`` for group ``system:masters``,
  ``system:discovery`` and ``system:basic-user`` (SelfSubjectAccessReview) for every authenticated
  user, ``system:public-info-viewer`` (/version, /healthz) for everyone.
* **Listed**: ``Authorizer.rules_for`` gives the rules a user holds in a namespace, from the same bindings
  (SelfSubjectRulesReview, ``kubectl auth can-i --list``).
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field
from pathlib import Path

ANONYMOUS = "system:anonymous"
AUTHENTICATED = "system:authenticated"
UNAUTHENTICATED = "system:unauthenticated"
MASTERS = "system:masters"
RBAC_GROUP = "rbac.authorization.k8s.io"
BOOTSTRAP_LABEL = {"kubernetes.io/bootstrapping": "rbac-defaults"}


@dataclass(frozen=True)
class Identity:
    user: str
    groups: tuple[str, ...] = ()
    uid: str = ""

    @property
    def service_account(self) -> tuple[str, str] | None:
        """(namespace, name) when the user is a service account."""
        parts = self.user.split(":")
        if len(parts) == 4 and parts[:2] == ["system", "serviceaccount"]:
            return parts[2], parts[3]
        return None


def anonymous() -> Identity:
    return Identity(ANONYMOUS, (UNAUTHENTICATED,))


def service_account_identity(namespace: str, name: str) -> Identity:
    return Identity(
        f"system:serviceaccount:{namespace}:{name}",
        ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", AUTHENTICATED),
    )


def read_token_file(path: Path) -> dict[str, Identity]:
    """kube-apiserver's static token file: ``token,user,uid[,"group1,group2"]`` per line."""
    tokens: dict[str, Identity] = {}
    for row in csv.reader(io.StringIO(Path(path).read_text())):
        if not row or row[0].startswith("#"):
            continue
        if len(row) < 3:
            raise ValueError(f"{path}: a line needs token,user,uid: {','.join(row)!r}")
        groups = [g for g in (row[3].split(",") if len(row) > 3 else []) if g]
        identity = Identity(row[1], tuple(dict.fromkeys([*groups, AUTHENTICATED])), row[2])
        if identity.service_account:
            ns = identity.service_account[0]
            identity = Identity(
                identity.user,
                tuple(
                    dict.fromkeys(
                        [*identity.groups, "system:serviceaccounts", f"system:serviceaccounts:{ns}"]
                    )
                ),
                row[2],
            )
        tokens[row[0]] = identity
    return tokens


@dataclass(frozen=True)
class Attributes:
    """What a request asks to do, as the authorizer sees it."""

    verb: str
    api_group: str = ""
    resource: str = ""
    subresource: str = ""
    name: str = ""
    namespace: str = ""
    path: str = ""  # a non-resource request's path

    @property
    def resource_request(self) -> bool:
        return bool(self.resource)


def _matches(values: list[str], wanted: str) -> bool:
    return "*" in values or wanted in values


def rule_allows(rule: dict, attrs: Attributes) -> bool:
    verbs = rule.get("verbs") or []
    if not _matches(verbs, attrs.verb):
        return False
    if not attrs.resource_request:
        for url in rule.get("nonResourceURLs") or []:
            if url == "*" or url == attrs.path or (url.endswith("*") and attrs.path.startswith(url[:-1])):
                return True
        return False
    if not _matches(rule.get("apiGroups") or [], attrs.api_group):
        return False
    resources = rule.get("resources") or []
    combined = f"{attrs.resource}/{attrs.subresource}" if attrs.subresource else attrs.resource
    if not (
        "*" in resources
        or combined in resources
        or (attrs.subresource and f"*/{attrs.subresource}" in resources)
        or (attrs.subresource and f"{attrs.resource}/*" in resources)
    ):
        return False
    names = rule.get("resourceNames") or []
    return not names or (bool(attrs.name) and attrs.name in names)


def subject_matches(subject: dict, identity: Identity) -> bool:
    kind = subject.get("kind")
    if kind == "User":
        return subject.get("name") == identity.user
    if kind == "Group":
        return subject.get("name") in identity.groups
    if kind == "ServiceAccount":
        return identity.service_account == (subject.get("namespace", ""), subject.get("name"))
    return False


def bootstrap_objects() -> list[tuple[str, dict]]:
    """The default ClusterRoles and ClusterRoleBindings every cluster has (the subset that applies here)."""
    discovery = [
        "/api",
        "/api/*",
        "/apis",
        "/apis/*",
        "/openapi",
        "/openapi/*",
        "/version",
        "/version/",
        "/healthz",
        "/livez",
        "/readyz",
    ]
    roles = {
        "cluster-admin": [
            {"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]},
            {"nonResourceURLs": ["*"], "verbs": ["*"]},
        ],
        "system:discovery": [{"nonResourceURLs": discovery, "verbs": ["get"]}],
        "system:basic-user": [
            {
                "apiGroups": ["authorization.k8s.io"],
                "resources": ["selfsubjectaccessreviews", "selfsubjectrulesreviews"],
                "verbs": ["create"],
            }
        ],
        "system:public-info-viewer": [
            {"nonResourceURLs": ["/healthz", "/livez", "/readyz", "/version", "/version/"], "verbs": ["get"]}
        ],
    }
    bindings = {
        "cluster-admin": [MASTERS],
        "system:discovery": [AUTHENTICATED],
        "system:basic-user": [AUTHENTICATED],
        "system:public-info-viewer": [AUTHENTICATED, UNAUTHENTICATED],
    }
    out: list[tuple[str, dict]] = []
    for name, rules in roles.items():
        out.append(
            (
                "clusterroles",
                {
                    "apiVersion": f"{RBAC_GROUP}/v1",
                    "kind": "ClusterRole",
                    "metadata": {"name": name, "labels": dict(BOOTSTRAP_LABEL)},
                    "rules": rules,
                },
            )
        )
    for name, groups in bindings.items():
        out.append(
            (
                "clusterrolebindings",
                {
                    "apiVersion": f"{RBAC_GROUP}/v1",
                    "kind": "ClusterRoleBinding",
                    "metadata": {"name": name, "labels": dict(BOOTSTRAP_LABEL)},
                    "roleRef": {"apiGroup": RBAC_GROUP, "kind": "ClusterRole", "name": name},
                    "subjects": [{"apiGroup": RBAC_GROUP, "kind": "Group", "name": g} for g in groups],
                },
            )
        )
    return out


@dataclass
class Authorizer:
    """RBAC over the objects of a store (anything with ``list(resource, namespace)`` and ``get``)."""

    store: object
    cache: dict = field(default_factory=dict)

    def _rules(self, role_ref: dict, namespace: str | None) -> list[dict]:
        kind, name = role_ref.get("kind"), role_ref.get("name", "")
        if kind == "ClusterRole":
            role = self.store.get("clusterroles", "", name)
        elif kind == "Role" and namespace:
            role = self.store.get("roles", namespace, name)
        else:
            role = None
        return list((role or {}).get("rules") or [])

    def allowed(self, identity: Identity, attrs: Attributes) -> bool:
        if MASTERS in identity.groups:
            return True  # what cluster-admin's binding grants, without a store walk per request
        for binding in self.store.list("clusterrolebindings", None):
            if any(subject_matches(s, identity) for s in binding.get("subjects") or []):
                if any(rule_allows(r, attrs) for r in self._rules(binding.get("roleRef") or {}, None)):
                    return True
        if attrs.namespace:
            for binding in self.store.list("rolebindings", attrs.namespace):
                if any(subject_matches(s, identity) for s in binding.get("subjects") or []):
                    rules = self._rules(binding.get("roleRef") or {}, attrs.namespace)
                    if any(rule_allows(r, attrs) for r in rules):
                        return True
        return False

    def rules_for(self, identity: Identity, namespace: str) -> tuple[list[dict], list[dict], str]:
        """What the identity may do in ``namespace``, as kube-apiserver's RBAC rule resolver lists it for a
        SelfSubjectRulesReview: the rules of every ClusterRoleBinding, then of every RoleBinding in the
        namespace, that names the identity, each rule as a ResourceRule and/or a NonResourceRule (not merged:
        kubectl compacts them), and the errors of roles that could not be read (the review's
        ``evaluationError``)."""
        resource_rules: list[dict] = []
        non_resource_rules: list[dict] = []
        errors: list[str] = []

        def visit(binding: dict, binding_ns: str | None) -> None:
            if not any(subject_matches(s, identity) for s in binding.get("subjects") or []):
                return
            ref = binding.get("roleRef") or {}
            kind, name = ref.get("kind"), ref.get("name", "")
            if kind == "ClusterRole":
                role = self.store.get("clusterroles", "", name)
            elif kind == "Role" and binding_ns:
                role = self.store.get("roles", binding_ns, name)
            else:
                role = None
            if role is None:
                errors.append(f'{(kind or "").lower()}.{RBAC_GROUP} "{name}" not found')
                return
            for rule in role.get("rules") or []:
                if rule.get("resources"):
                    out = {
                        "verbs": list(rule.get("verbs") or []),
                        "apiGroups": list(rule.get("apiGroups") or []),
                        "resources": list(rule["resources"]),
                    }
                    if rule.get("resourceNames"):
                        out["resourceNames"] = list(rule["resourceNames"])
                    resource_rules.append(out)
                if rule.get("nonResourceURLs"):
                    non_resource_rules.append(
                        {
                            "verbs": list(rule.get("verbs") or []),
                            "nonResourceURLs": list(rule["nonResourceURLs"]),
                        }
                    )

        for binding in self.store.list("clusterrolebindings", None):
            visit(binding, None)
        if namespace:
            for binding in self.store.list("rolebindings", namespace):
                visit(binding, namespace)
        error = errors[0] if len(errors) == 1 else (f"[{', '.join(errors)}]" if errors else "")
        return resource_rules, non_resource_rules, error


def forbidden_message(identity: Identity, attrs: Attributes) -> str:
    """kube-apiserver's words for a refused request."""
    if not attrs.resource_request:
        return f'forbidden: User "{identity.user}" cannot {attrs.verb} path "{attrs.path}"'
    resource = f"{attrs.resource}/{attrs.subresource}" if attrs.subresource else attrs.resource
    what = f'{attrs.resource} "{attrs.name}"' if attrs.name else attrs.resource
    where = f'in the namespace "{attrs.namespace}"' if attrs.namespace else "at the cluster scope"
    return (
        f'{what} is forbidden: User "{identity.user}" cannot {attrs.verb} resource "{resource}" in API group '
        f'"{attrs.api_group}" {where}'
    )
