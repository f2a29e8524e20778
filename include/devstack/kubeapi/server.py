"""The HTTP side: discovery, OpenAPI, CRUD, list/watch, patch, delete, pods/log, pods/exec, pods/attach."""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import copy
import json
import logging
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from aiohttp import WSMsgType, web

from include.devstack.kubeapi import openapi, podsecurity, protobuf, rbac, tables
from include.devstack.kubeapi import validation as v
from include.devstack.kubeapi.cluster import Cluster
from include.devstack.kubeapi.images import DEFAULT_STORE
from include.devstack.kubeapi.jobs import JobController
from include.devstack.kubeapi.kueue import GROUP as KUEUE_GROUP
from include.devstack.kubeapi.kueue import Kueue
from include.devstack.kubeapi.kueue import present as kueue_present
from include.devstack.kubeapi.logs import LogOptions, stream_log
from include.devstack.kubeapi.meta import (
    GROUPS,
    MINIMUM_MINOR,
    RESOURCES,
    SERVER_VERSION,
    ApiError,
    Resource,
    bad_request,
    conflict,
    not_found,
    parse_time,
    parse_time_ns,
    resource_for,
    rfc3339,
    rfc3339_micro,
    served_versions,
    set_version,
    unsupported_group,
)
from include.devstack.kubeapi.patch import APPLY_PATCH, apply_patch
from include.devstack.kubeapi.runtime import RuntimeUnavailable
from include.devstack.kubeapi.selectors import parse_field_selector, parse_label_selector

log = logging.getLogger("kubeapi")
EXEC_PROTOCOLS = (
    "v5.channel.k8s.io",
    "v4.channel.k8s.io",
    "v3.channel.k8s.io",
    "v2.channel.k8s.io",
    "channel.k8s.io",
)
BOOKMARK_EVERY = 10.0
TRUE = ("true", "1", "True")


def _json(body: dict, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(
        body=json.dumps(body, separators=(",", ":")).encode(),
        status=status,
        content_type="application/json",
        headers=headers,
    )


class Api:
    def __init__(
        self,
        cluster: Cluster,
        tokens: dict[str, rbac.Identity] | None = None,
        kueue_config: Path | None = None,
    ) -> None:
        self.cluster = cluster
        self.store = cluster.store
        self.jobs = JobController(cluster, self.create_pod_object)
        self.kueue = Kueue(cluster, self.jobs, kueue_config) if kueue_config else None
        self.tokens = tokens or {}
        self.authorizer = rbac.Authorizer(self.store)

    # -- authentication and authorization ----------------------------------------------------

    def authenticate(self, request: web.Request) -> rbac.Identity:
        """The request's user: its bearer token's, else system:anonymous; 401 for a token nobody issued."""
        header = request.headers.get("Authorization", "")
        if not header:
            return rbac.anonymous()
        scheme, _, token = header.partition(" ")
        identity = self.tokens.get(token.strip()) if scheme.lower() == "bearer" else None
        if identity is None:
            raise ApiError(401, "Unauthorized", "Unauthorized")
        return identity

    def authorize(self, request: web.Request, attrs: rbac.Attributes) -> None:
        identity = request["identity"]
        if not self.authorizer.allowed(identity, attrs):
            raise ApiError(
                403,
                "Forbidden",
                rbac.forbidden_message(identity, attrs),
                kind=attrs.resource or None,
                name=attrs.name or None,
                group=attrs.api_group,
            )

    def authorize_path(self, request: web.Request) -> None:
        self.authorize(
            request,
            rbac.Attributes(
                verb=request.method.lower() if request.method != "HEAD" else "get", path=request.path
            ),
        )

    # -- routing -----------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            request["identity"] = self.authenticate(request)
            return await self._route(request)
        except ApiError as exc:
            return _json(exc.status(), exc.code)
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as exc:
            log.exception("%s %s failed", request.method, request.path_qs)
            return _json(ApiError(500, "InternalError", f"an error on the server: {exc}").status(), 500)

    async def _route(self, request: web.Request) -> web.StreamResponse:
        """Route a request by the tables below: a discovery path (ROOTS, then the group and version
        documents), else a resource path (parse_resource_path), whose streaming subresources go to
        STREAMS and whose method goes to METHODS."""
        parts = [p for p in request.path.split("/") if p]
        if is_discovery(parts):
            self.authorize_path(request)
        head = parts[0] if parts else ""
        root = ROOTS.get(head)
        if root is not None:
            return root(request, parts)
        document = DISCOVERY_DOCUMENTS.get(head)
        if document is None:
            raise no_such_path()
        found = document(request, parts)
        if found is not None:
            return found
        group, version, rest = group_version(parts)
        if not rest:
            return _json(resource_list(group, version))
        path = parse_resource_path(group, version, rest)
        res = resource_for(group, version, path.resource)
        check_scope(res, path)
        q = request.query
        self.authorize_resource(request, res, path.namespace, path.name, path.sub, path.watching(q))
        stream = STREAMS.get(path.sub or "")
        if stream is not None:
            return await stream(self, request, path.namespace, path.name)
        handler = METHODS.get(request.method)
        if handler is None:
            raise not_allowed()
        return await handler(self, request, res, path)

    async def _get(self, request: web.Request, res: Resource, path: ResourcePath) -> web.StreamResponse:
        q = request.query
        if path.watching(q):
            return await self.watch(request, res, path.namespace, path.name)
        if path.name is None:
            return self.list(request, res, path.namespace)
        obj = self.present(res, self.get(res, path.namespace, path.name))
        if wants_table(request):
            return _json(
                tables.table(
                    res.name,
                    [obj],
                    q.get("includeObject", "Metadata"),
                    obj["metadata"]["resourceVersion"],
                )
            )
        return _json(obj)

    async def _post(self, request: web.Request, res: Resource, path: ResourcePath) -> web.StreamResponse:
        body, dry = await self._writing(request, res, path, "create")
        review = REVIEWS.get(res.name)
        if review is not None:
            return review(self, request, body)
        if path.sub == "eviction":
            return self.evict(path.namespace, path.name, body, dry)
        if path.name is not None:
            raise not_allowed()
        obj, warnings = self.create(res, path.namespace, body, request.query, dry)
        return _json(self.present(res, obj), 201, warning_headers(warnings))

    async def _put(self, request: web.Request, res: Resource, path: ResourcePath) -> web.StreamResponse:
        body, dry = await self._writing(request, res, path, "update")
        if path.name is None:
            raise not_allowed()
        return _json(self.present(res, self.update(res, path.namespace, path.name, body, path.sub, dry)))

    async def _patch(self, request: web.Request, res: Resource, path: ResourcePath) -> web.StreamResponse:
        body, dry = await self._writing(request, res, path, "patch")
        ns, name, sub = path.namespace, path.name, path.sub
        if name is None:
            raise not_allowed()
        if (
            request.content_type == APPLY_PATCH
            and sub is None
            and self.store.get(self.key(res), ns or "", name) is None
        ):
            # server-side apply of a new object creates it; of an existing one it is refused (415)
            if "create" not in res.verbs:
                raise not_allowed(f"create {res.name}")
            if not isinstance(body, dict):
                raise bad_request("the server-side apply body must be an object")
            if (body.get("metadata") or {}).get("name") not in (None, name):
                raise bad_request("the name of the object does not match the name on the URL")
            body.setdefault("metadata", {})["name"] = name
            obj, warnings = self.create(res, ns, body, request.query, dry)
            return _json(self.present(res, obj), 201, warning_headers(warnings))
        obj = self.update(res, ns, name, None, sub, dry, patch=(request.content_type, body))
        return _json(self.present(res, obj))

    async def _delete(self, request: web.Request, res: Resource, path: ResourcePath) -> web.StreamResponse:
        ns, name = path.namespace, path.name
        body, dry = await self._writing(request, res, path, "delete" if name else "deletecollection")
        if name is None:
            return _json(self.delete_collection(res, ns, request.query, body, dry))
        deleted = self.delete(res, ns, name, request.query, body or {}, dry)
        still_there = self.store.get(self.key(res), ns or "", name)
        if (
            res.name == "pods"
            or dry
            or (still_there and still_there["metadata"]["uid"] == deleted["metadata"]["uid"])
        ):
            return _json(self.present(res, deleted))
        details = {"name": name, "kind": res.name, "uid": deleted["metadata"]["uid"]}
        if res.group:
            details["group"] = res.group
        return _json(
            {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Success",
                "details": details,
            }
        )

    async def _writing(self, request: web.Request, res: Resource, path: ResourcePath, verb: str) -> tuple:
        """The body of a write and whether it is a dry run, once the resource (or subresource) is known to
        allow ``verb``."""
        allowed = res.subresources.get(path.sub, ()) if path.sub else res.verbs
        body = await read_body(request)
        if verb not in allowed:
            raise not_allowed(f"{request.method} {res.name}{'/' + path.sub if path.sub else ''}")
        return body, "All" in request.query.getall("dryRun", [])

    def authorize_resource(
        self,
        request: web.Request,
        res: Resource,
        ns: str | None,
        name: str | None,
        sub: str | None,
        watching: bool,
    ) -> None:
        """RBAC for a resource request, with the verb kube-apiserver derives from the method."""
        method = request.method
        if method in ("GET", "HEAD"):
            verbs = ["watch" if watching else ("get" if name else "list")]
            if sub in ("exec", "attach"):
                # over WebSocket (a GET): get up to 1.29, create since 1.30; both are needed to work on every
                # supported minor, so both are checked
                verbs = ["get", "create"]
        else:
            verbs = [
                {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method)
                or ("delete" if name else "deletecollection")
            ]
        namespace = name if res.name == "namespaces" and name else (ns or "")
        for verb in verbs:
            self.authorize(
                request,
                rbac.Attributes(
                    verb=verb,
                    api_group=res.group,
                    resource=res.name,
                    subresource=sub or "",
                    name=name or "",
                    namespace=namespace,
                ),
            )

    def access_review(self, request: web.Request, body) -> web.Response:
        """SelfSubjectAccessReview: may the asking user do what the spec says?"""
        if not isinstance(body, dict) or not isinstance(body.get("spec"), dict):
            raise bad_request("the body of the request must be a SelfSubjectAccessReview with a spec")
        spec = body["spec"]
        res, nonres = spec.get("resourceAttributes"), spec.get("nonResourceAttributes")
        if bool(res) == bool(nonres):
            raise v_invalid_review()
        if res:
            attrs = rbac.Attributes(
                verb=res.get("verb", ""),
                api_group=res.get("group", ""),
                resource=res.get("resource", ""),
                subresource=res.get("subresource", ""),
                name=res.get("name", ""),
                namespace=res.get("namespace", ""),
            )
        else:
            attrs = rbac.Attributes(verb=nonres.get("verb", ""), path=nonres.get("path", ""))
        allowed = self.authorizer.allowed(request["identity"], attrs)
        status = {"allowed": allowed}
        if allowed:
            status["reason"] = "RBAC: allowed by a RoleBinding or ClusterRoleBinding"
        out = {
            "kind": "SelfSubjectAccessReview",
            "apiVersion": "authorization.k8s.io/v1",
            "metadata": {"creationTimestamp": None},
            "spec": spec,
            "status": status,
        }
        return _json(out, 201)

    def rules_review(self, request: web.Request, body) -> web.Response:
        """SelfSubjectRulesReview (``kubectl auth can-i --list``): every rule the asking user's RBAC
        bindings grant in ``spec.namespace``, from the evaluator that authorizes requests, as kube-apiserver
        lists them."""
        if not isinstance(body, dict) or body.get("kind") not in (None, "SelfSubjectRulesReview"):
            raise bad_request(f"not a SelfSubjectRulesReview: {body!r}")
        spec = body.get("spec") if isinstance(body.get("spec"), dict) else {}
        namespace = spec.get("namespace") or ""
        if not namespace:
            raise bad_request("no namespace on request")
        resource_rules, non_resource_rules, error = self.authorizer.rules_for(request["identity"], namespace)
        status: dict = {
            "resourceRules": resource_rules,
            "nonResourceRules": non_resource_rules,
            "incomplete": False,
        }
        if error:
            status["evaluationError"] = error
        out = {
            "kind": "SelfSubjectRulesReview",
            "apiVersion": "authorization.k8s.io/v1",
            "metadata": {"creationTimestamp": None},
            "spec": {},
            "status": status,
        }
        return _json(out, 201)

    # -- reads -------------------------------------------------------------------------------

    def key(self, res: Resource) -> str:
        return res.name  # events.k8s.io events are the core events, converted on the way out

    def get(self, res: Resource, ns: str | None, name: str) -> dict:
        obj = self.store.get(self.key(res), ns or "", name)
        if obj is None:
            raise not_found(res.name, name, res.group)
        return obj

    def present(self, res: Resource, obj: dict) -> dict:
        if res.group == "events.k8s.io":
            return to_events_v1(obj)
        if res.group == KUEUE_GROUP:
            return kueue_present(obj, res.version)
        return obj

    def selectors(self, res: Resource, q) -> tuple:
        fs = q.get("fieldSelector")
        if res.group == "events.k8s.io" and fs:
            fs = fs.replace("regarding.", "involvedObject.").replace(
                "reportingController", "reportingComponent"
            )
        return parse_label_selector(q.get("labelSelector")), parse_field_selector(res.name, fs)

    def list(self, request: web.Request, res: Resource, ns: str | None) -> web.Response:
        q = request.query
        lp, fp = self.selectors(res, q)
        items = [o for o in self.store.list(self.key(res), ns) if lp(o) and fp(o)]
        meta: dict = {"resourceVersion": str(self.store.rv)}
        limit = int(q.get("limit") or 0)
        start = 0
        if q.get("continue"):
            try:
                start = int(json.loads(base64.b64decode(q["continue"]))["offset"])
            except (ValueError, KeyError, TypeError):
                raise ApiError(
                    410, "Expired", "the provided continue parameter is too old or invalid"
                ) from None
        if limit > 0:
            page = items[start : start + limit]
            if start + limit < len(items):
                meta["continue"] = base64.b64encode(json.dumps({"offset": start + limit}).encode()).decode()
                meta["remainingItemCount"] = len(items) - start - limit
            items = page
        else:
            items = items[start:]
        items = [self.present(res, o) for o in items]
        if wants_table(request):
            return _json(
                tables.table(res.name, items, q.get("includeObject", "Metadata"), meta["resourceVersion"])
            )
        return _json(
            {"kind": f"{res.kind}List", "apiVersion": res.api_version, "metadata": meta, "items": items}
        )

    async def watch(
        self, request: web.Request, res: Resource, ns: str | None, name: str | None
    ) -> web.StreamResponse:
        q = request.query
        lp, fp = self.selectors(res, q)
        if name is not None:
            base_fp = fp
            fp = lambda o, n=name: o["metadata"]["name"] == n and base_fp(o)  # noqa: E731
        rv_param = q.get("resourceVersion", "")
        since: int | None = None
        if rv_param not in ("", "0"):
            try:
                since = int(rv_param)
            except ValueError:
                raise bad_request(f'invalid resource version "{rv_param}"') from None
        try:
            timeout = float(q.get("timeoutSeconds") or 1800)
        except ValueError:
            raise bad_request(f'invalid timeoutSeconds "{q.get("timeoutSeconds")}"') from None
        bookmarks = q.get("allowWatchBookmarks") in TRUE
        initial_events = q.get("sendInitialEvents") in TRUE
        as_table = wants_table(request)
        key = self.key(res)

        def match(obj: dict | None) -> bool:
            return obj is not None and lp(obj) and fp(obj)

        watcher = self.store.subscribe(key, ns)
        queue: list[tuple[str, dict]] = []
        expired = False
        if since is None or initial_events:
            queue = [("ADDED", o) for o in self.store.list(key, ns) if match(o)]
        else:
            if since < self.store.oldest_rv:
                expired = True
            else:
                for change in self.store.changes_since(key, ns, since):
                    t = classify(change, match)
                    if t:
                        queue.append((t, change.obj))
        resp = web.StreamResponse(
            status=200, headers={"Content-Type": "application/json", "Cache-Control": "no-cache, private"}
        )
        resp.enable_chunked_encoding()
        first_table = True
        try:
            await resp.prepare(request)
            if expired:
                status = ApiError(
                    410, "Expired", f"too old resource version: {since} ({self.store.oldest_rv})"
                ).status()
                await resp.write(json.dumps({"type": "ERROR", "object": status}).encode() + b"\n")
                return resp

            async def send(type_: str, obj: dict) -> None:
                nonlocal first_table
                out = self.present(res, obj)
                if as_table and type_ != "BOOKMARK":
                    out = tables.table(
                        res.name,
                        [out],
                        q.get("includeObject", "Metadata"),
                        out["metadata"].get("resourceVersion", ""),
                        first_table,
                    )
                    first_table = False
                await resp.write(
                    json.dumps({"type": type_, "object": out}, separators=(",", ":")).encode() + b"\n"
                )

            def bookmark(extra: dict | None = None) -> dict:
                meta: dict = {"resourceVersion": str(self.store.rv)}
                if extra:
                    meta["annotations"] = extra
                return {"kind": res.kind, "apiVersion": res.api_version, "metadata": meta}

            for t, o in queue:
                await send(t, o)
            if initial_events:
                await send("BOOKMARK", bookmark({"k8s.io/initial-events-end": "true"}))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            next_bookmark = loop.time() + BOOKMARK_EVERY
            while True:
                now = loop.time()
                if now >= deadline:
                    break
                wait = min(deadline, next_bookmark) - now if bookmarks else deadline - now
                try:
                    change = await asyncio.wait_for(watcher.queue.get(), max(0.01, wait))
                except TimeoutError:
                    if bookmarks and loop.time() >= next_bookmark:
                        await send("BOOKMARK", bookmark())
                        next_bookmark = loop.time() + BOOKMARK_EVERY
                    continue
                t = classify(change, match)
                if t:
                    await send(t, change.obj)
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self.store.unsubscribe(watcher)
        with contextlib.suppress(ConnectionResetError, RuntimeError):
            await resp.write_eof()
        return resp

    # -- writes ------------------------------------------------------------------------------

    def check_namespace(self, ns: str) -> None:
        nso = self.store.get("namespaces", "", ns)
        if nso is None:
            raise not_found("namespaces", ns)
        if nso["metadata"].get("deletionTimestamp"):
            raise ApiError(
                403,
                "Forbidden",
                f"unable to create new content in namespace {ns} because it is being terminated",
            )

    def create(self, res: Resource, ns: str | None, body, q, dry: bool) -> tuple[dict, list[str]]:
        if res.name == "customresourcedefinitions":
            raise ApiError(
                405,
                "MethodNotAllowed",
                "the local Kubernetes API serves no custom resources: "
                "creating a CustomResourceDefinition is not supported",
            )
        if res.group == "events.k8s.io" or res.name == "nodes":
            raise ApiError(
                405,
                "MethodNotAllowed",
                f"the local Kubernetes API does not create {res.name} through this endpoint",
            )
        obj = self.check_body(res, body)
        meta = obj["metadata"]
        if res.namespaced:
            if meta.get("namespace") not in (None, "", ns):
                raise bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
            meta["namespace"] = ns
            self.check_namespace(ns)
        else:
            meta.pop("namespace", None)
        warnings = openapi.schema_check(res, obj, q.get("fieldValidation", "Warn"))
        if not meta.get("name") and meta.get("generateName"):
            for _ in range(10):
                meta["name"] = v.generate_name(meta["generateName"])
                if not self.store.get(res.name, ns or "", meta["name"]):
                    break
        for drop in (
            "uid",
            "resourceVersion",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generation",
        ):
            meta.pop(drop, None)
        if res.name == "pods":
            _, warn = podsecurity.levels(self.store.get("namespaces", "", ns or "default") or {})
            if podsecurity.violations(warn, obj):
                warnings.append(
                    f'would violate PodSecurity "{warn}:latest": '
                    + ", ".join(f"{name} ({detail})" for name, detail in podsecurity.violations(warn, obj))
                )
            return self.create_pod_object(obj, dry=dry), warnings
        if res.name == "jobs":
            obj.pop("status", None)
            v.default_job(obj)  # defaulting (at decode), then mutating admission, then validation
            if self.kueue is not None:
                self.kueue.mutate_job(obj)
            v.validate_job(obj)
            if dry:
                return obj, warnings
            meta["uid"] = str(uuid.uuid4())
            self.jobs.prepare(obj)
            obj["status"] = {}
            created = self.store.create("jobs", obj, "batch")
            self.jobs.on_created(created)
            if self.kueue is not None:
                self.kueue.job_created(created)
            return self.store.get("jobs", ns, meta["name"]) or created, warnings
        if res.name in ("secrets", "configmaps"):
            kind = "Secret" if res.name == "secrets" else "ConfigMap"
            v.validate_data_object(kind, obj)
            if kind == "Secret":
                normalize_secret(obj)
        elif res.name == "services":
            v.default_service(obj)
            v.validate_service(obj)
        elif res.name == "namespaces":
            v.validate_namespace(obj)
            obj.setdefault("spec", {"finalizers": ["kubernetes"]})
            obj["status"] = {"phase": "Active"}
            obj.setdefault("metadata", {}).setdefault("labels", {})["kubernetes.io/metadata.name"] = meta[
                "name"
            ]
        elif res.name == "events":
            v_causes: list = []
            v.check_metadata(v_causes, meta)
            if not obj.get("involvedObject"):
                v_causes.append(("involvedObject", "FieldValueRequired", "Required value"))
            if v_causes:
                raise v.invalid("Event", meta.get("name", ""), v_causes)
        if dry:
            return obj, warnings
        created = self.store.create(res.name, obj, res.group)
        if res.name == "services":
            self.cluster.refresh_hosts()
        if res.name == "namespaces":
            self.cluster.create_default_service_account(
                meta["name"]
            )  # as the service account controller does
        return created, warnings

    def create_pod_object(self, pod: dict, dry: bool = False) -> dict:
        pod["apiVersion"], pod["kind"] = "v1", "Pod"
        meta = pod.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = v.generate_name(meta["generateName"])
        namespace = meta.get("namespace") or "default"
        self.check_namespace(namespace)
        pod.pop("status", None)
        if self.kueue is not None:
            self.kueue.mutate_pod(pod)
        spec = pod.setdefault("spec", {})
        v.default_pod_spec(spec)
        v.validate_pod(pod)
        # Pod Security admission: the namespace's enforce level refuses what breaks it
        enforce, _ = podsecurity.levels(self.store.get("namespaces", "", namespace) or {})
        found = podsecurity.violations(enforce, pod)
        if found:
            raise ApiError(
                403,
                "Forbidden",
                f'pods "{meta.get("name", "")}" is forbidden: {podsecurity.summary(enforce, found)}',
                kind="pods",
                name=meta.get("name", ""),
            )
        # the ServiceAccount admission plugin: the pod's service account must exist
        account = spec.setdefault("serviceAccountName", spec.get("serviceAccount") or "default")
        if self.store.get("serviceaccounts", namespace, account) is None:
            raise ApiError(
                403,
                "Forbidden",
                f'pods "{meta.get("name", "")}" is forbidden: error looking up service '
                f'account {namespace}/{account}: serviceaccount "{account}" not found',
                kind="pods",
                name=meta.get("name", ""),
            )
        pod["status"] = {"phase": "Pending", "qosClass": "BestEffort"}
        if dry:
            return pod
        created = self.store.create("pods", pod)
        self.cluster.start_pod(created)
        if self.kueue is not None:
            self.kueue.pod_created(created)
        return self.store.get("pods", meta["namespace"], meta["name"]) or created

    def check_body(self, res: Resource, body) -> dict:
        if not isinstance(body, dict):
            raise bad_request(f"the body of the request must be a {res.kind} object")
        api_version, kind = body.get("apiVersion"), body.get("kind")
        if api_version and api_version != res.api_version:
            raise bad_request(
                f"the API version in the data ({api_version}) does not match the expected API version ({res.api_version})"
            )
        if kind and kind != res.kind:
            raise bad_request(f"the kind in the data ({kind}) does not match the expected kind ({res.kind})")
        obj = copy.deepcopy(body)
        obj["apiVersion"], obj["kind"] = res.api_version, res.kind
        if not isinstance(obj.get("metadata"), dict):
            obj["metadata"] = {}
        return obj

    def update(
        self,
        res: Resource,
        ns: str | None,
        name: str,
        body,
        sub: str | None,
        dry: bool,
        patch: tuple | None = None,
    ) -> dict:
        if res.group == "events.k8s.io" or res.name == "nodes":
            raise ApiError(405, "MethodNotAllowed", f"the local Kubernetes API does not update {res.name}")
        current = self.get(res, ns, name)
        if patch is not None:
            ctype, pbody = patch
            new = apply_patch(ctype, current, pbody)
            expect = (pbody.get("metadata") or {}).get("resourceVersion") if isinstance(pbody, dict) else None
        else:
            new = self.check_body(res, body)
            expect = new["metadata"].get("resourceVersion")
            if new["metadata"].get("name") not in (None, name):
                raise bad_request("the name of the object does not match the name on the URL")
        if not isinstance(new, dict):
            raise bad_request("the patched object is not a JSON object")
        new["apiVersion"], new["kind"] = res.api_version, res.kind
        meta = new.setdefault("metadata", {})
        if expect and expect != current["metadata"]["resourceVersion"]:
            raise conflict(res.name, name, res.group)
        meta.setdefault("name", name)
        if res.namespaced:
            meta.setdefault("namespace", ns)
        for keep in (
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generation",
        ):
            if keep in current["metadata"] and keep not in meta:
                meta[keep] = current["metadata"][keep]
        v.check_immutable_meta(current, new, res.kind, res.group)
        if sub == "status":
            merged = copy.deepcopy(current)
            merged["status"] = new.get("status", {})
            new = merged
        else:
            if "status" in current:
                new["status"] = copy.deepcopy(current["status"])
            if res.name == "pods":
                v.validate_pod_update(current, new)
            elif res.name == "jobs":
                v.default_job(new)
                v.validate_job_update(current, new)
            elif res.name == "services":
                v.default_service(new)
                v.validate_service_update(current, new)
            elif res.group == KUEUE_GROUP:
                openapi.schema_check(res, new, "Warn")  # its CRD's schema, as on create
            elif res.name in ("secrets", "configmaps"):
                kind = "Secret" if res.name == "secrets" else "ConfigMap"
                if current.get("immutable") and any(
                    current.get(f) != new.get(f) for f in ("data", "binaryData", "stringData")
                ):
                    raise v.invalid(
                        kind,
                        name,
                        [
                            (
                                "data",
                                "FieldValueForbidden",
                                "Forbidden: field is immutable when `immutable` is set",
                            )
                        ],
                    )
                v.validate_data_object(kind, new)
                if kind == "Secret":
                    normalize_secret(new)
        if dry:
            return new
        new["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        stored = self.store.replace(res.name, new, group=res.group)
        if res.name == "jobs" and sub != "status":
            self.jobs.reconcile(ns, name)
            stored = self.store.get("jobs", ns, name) or stored
        if res.name == "pods":
            self.cluster.pod_updated(stored)
        labels_changed = (current["metadata"].get("labels") or {}) != (stored["metadata"].get("labels") or {})
        if res.name == "services" or (res.name == "pods" and labels_changed):
            self.cluster.refresh_hosts()  # what the headless Services select may have changed
        return stored

    def evict(self, ns: str, name: str, body: object, dry: bool) -> web.Response:
        """``POST pods/<name>/eviction`` (policy/v1 Eviction): the pod gets the DisruptionTarget
        condition and is deleted gracefully (no PodDisruptionBudgets exist here to refuse it)."""
        if not isinstance(body, dict) or body.get("kind") not in (None, "Eviction"):
            raise ApiError(400, "BadRequest", "the body of an eviction must be a policy/v1 Eviction")
        given = (body.get("metadata") or {}).get("name")
        if given != name:
            raise ApiError(
                400,
                "BadRequest",
                f"name in URL does not match name in Eviction object: {given!r} != {name!r}",
            )
        self.store.must_get("pods", ns, name)
        options = body.get("deleteOptions") or {}
        grace = options.get("gracePeriodSeconds")
        if not dry:
            self.cluster.evict(ns, name, int(grace) if grace is not None else None)
        status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}
        return _json(status, 201)

    def delete(self, res: Resource, ns: str | None, name: str, q, body: dict, dry: bool) -> dict:
        if res.group == "events.k8s.io" or res.name == "nodes":
            raise ApiError(405, "MethodNotAllowed", f"the local Kubernetes API does not delete {res.name}")
        current = self.get(res, ns, name)
        pre = body.get("preconditions") or {}
        if pre.get("uid") and pre["uid"] != current["metadata"]["uid"]:
            raise conflict(res.name, name, res.group)
        if pre.get("resourceVersion") and pre["resourceVersion"] != current["metadata"]["resourceVersion"]:
            raise conflict(res.name, name, res.group)
        grace = body.get("gracePeriodSeconds", q.get("gracePeriodSeconds"))
        grace = int(grace) if grace not in (None, "") else None
        policy = body.get("propagationPolicy") or q.get("propagationPolicy")
        if policy is None and (body.get("orphanDependents") is True or q.get("orphanDependents") in TRUE):
            policy = "Orphan"
        if policy not in (None, "Orphan", "Background", "Foreground"):
            raise v.invalid(
                "DeleteOptions",
                "",
                [
                    (
                        "propagationPolicy",
                        "FieldValueNotSupported",
                        f'Unsupported value: "{policy}": supported values: "Foreground", "Background", "Orphan"',
                    )
                ],
            )
        if dry:
            return current
        if res.name == "pods":
            return self.cluster.delete_pod(ns, name, grace)
        if res.name == "jobs":
            return self.jobs.delete(current, policy or "Orphan")
        if res.name == "namespaces":
            return self.delete_namespace(name)
        removed = self.store.remove(res.name, ns or "", name) or current
        if res.name == "services":
            self.cluster.refresh_hosts()
        return removed

    def delete_collection(self, res: Resource, ns: str | None, q, body, dry: bool) -> dict:
        lp, fp = self.selectors(res, q)
        items = [o for o in self.store.list(self.key(res), ns) if lp(o) and fp(o)]
        out = []
        for obj in items:
            with contextlib.suppress(ApiError):
                out.append(
                    self.delete(
                        res, obj["metadata"].get("namespace"), obj["metadata"]["name"], q, body or {}, dry
                    )
                )
        return {
            "kind": f"{res.kind}List",
            "apiVersion": res.api_version,
            "metadata": {"resourceVersion": str(self.store.rv)},
            "items": out,
        }

    def delete_namespace(self, name: str) -> dict:
        if name in ("default", "kube-system", "kube-public"):
            raise ApiError(
                403, "Forbidden", f'namespaces "{name}" is forbidden: this namespace may not be deleted'
            )

        def mark(o: dict) -> None:
            o["metadata"]["deletionTimestamp"] = rfc3339()
            o["status"] = {"phase": "Terminating"}

        marked = self.store.mutate("namespaces", "", name, mark)
        asyncio.ensure_future(self._finish_namespace(name))
        return marked

    async def _finish_namespace(self, name: str) -> None:
        for job in self.store.list("jobs", name):
            with contextlib.suppress(ApiError):
                self.jobs.delete(job, "Background")
        for pod in self.store.list("pods", name):
            with contextlib.suppress(ApiError):
                self.cluster.delete_pod(name, pod["metadata"]["name"], None)
        while self.store.list("pods", name):
            await asyncio.sleep(0.1)
        for kind in (
            "secrets",
            "configmaps",
            "services",
            "events",
            "serviceaccounts",
            "roles",
            "rolebindings",
        ):
            for obj in self.store.list(kind, name):
                self.store.remove(kind, name, obj["metadata"]["name"])
        self.store.remove("namespaces", "", name)

    # -- pods/log ----------------------------------------------------------------------------

    async def pod_log(self, request: web.Request, ns: str, name: str) -> web.StreamResponse:
        if request.method != "GET":
            raise ApiError(
                405, "MethodNotAllowed", "the server does not allow this method on the requested resource"
            )
        q = request.query
        pod = self.store.must_get("pods", ns, name)
        spec = pod["spec"]
        names = [c["name"] for c in spec.get("containers") or []]
        init_names = [c["name"] for c in spec.get("initContainers") or []]
        container = q.get("container")
        if not container:
            if len(names) != 1:
                extra = f" or one of the init containers: [{' '.join(init_names)}]" if init_names else ""
                raise bad_request(
                    f"a container name must be specified for pod {name}, choose one of: [{' '.join(names)}]{extra}"
                )
            container = names[0]
        if container not in names + init_names:
            raise bad_request(f"container {container} is not valid for pod {name}")
        worker = self.cluster.worker_for(pod)
        c = worker.container(container) if worker else None
        if c is None:
            raise bad_request(
                f'container "{container}" in pod "{name}" is waiting to start: ContainerCreating'
            )
        opts = LogOptions(follow=q.get("follow") in TRUE, timestamps=q.get("timestamps") in TRUE)
        if q.get("sinceSeconds") and q.get("sinceTime"):
            raise v.invalid(
                "PodLogOptions",
                "",
                [
                    (
                        "sinceSeconds",
                        "FieldValueForbidden",
                        "Forbidden: at most one of `sinceTime` or `sinceSeconds` may be specified",
                    )
                ],
            )
        try:
            if q.get("sinceSeconds"):
                secs = int(q["sinceSeconds"])
                if secs < 1:
                    raise ValueError
                opts.since_ns = time.time_ns() - secs * 1_000_000_000
            if q.get("sinceTime"):
                opts.since_ns = parse_time_ns(q["sinceTime"])
            if q.get("tailLines") not in (None, ""):
                opts.tail_lines = int(q["tailLines"])
                if opts.tail_lines < 0:
                    raise ValueError
            if q.get("limitBytes"):
                opts.limit_bytes = int(q["limitBytes"])
                if opts.limit_bytes < 1:
                    raise ValueError
        except ValueError:
            raise bad_request(
                "sinceSeconds and limitBytes must be positive integers and tailLines a non-negative integer"
            ) from None
        index = c.restart_count
        if q.get("previous") in TRUE:
            index = c.restart_count - 1
            if index < 0 or not c.log_path(worker.dir, index).exists():
                raise bad_request(f'previous terminated container "{container}" in pod "{name}" not found')
            live = None
        else:
            path = c.log_path(worker.dir, index)
            if not path.exists():
                waiting = (c.state.get("waiting") or {}).get("reason", "ContainerCreating")
                if waiting in ("ErrImagePull", "ImagePullBackOff"):
                    raise bad_request(
                        f'container "{container}" in pod "{name}" is waiting to start: trying and failing to pull image'
                    )
                if waiting == "CreateContainerConfigError":
                    raise bad_request(
                        f'container "{container}" in pod "{name}" is waiting to start: {waiting}'
                    )
                raise bad_request(f'container "{container}" in pod "{name}" is waiting to start: {waiting}')
            live = c.log if c.log is not None and c.log.path == path else None
        path = c.log_path(worker.dir, index)
        uid = pod["metadata"]["uid"]

        def alive() -> bool:
            cur = self.store.get("pods", ns, name)
            return cur is not None and cur["metadata"]["uid"] == uid

        if not opts.follow:
            if live is not None:
                c.log_read_ns = time.time_ns()  # where an attach that follows this read picks up (pod_attach)
            chunks = [chunk async for chunk in stream_log(live, path, opts, alive)]
            return web.Response(body=b"".join(chunks), content_type="text/plain")
        resp = web.StreamResponse(
            status=200, headers={"Content-Type": "text/plain", "Cache-Control": "no-cache, private"}
        )
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        with contextlib.suppress(ConnectionResetError, asyncio.CancelledError):
            async for chunk in stream_log(live, path, opts, alive):
                await resp.write(chunk)
            await resp.write_eof()
        return resp

    # -- pods/attach -------------------------------------------------------------------------

    async def pod_attach(self, request: web.Request, ns: str, name: str) -> web.StreamResponse:
        """The container's output from now on, until it exits (``kubectl run -i``, ``kubectl attach``); an
        attach to a container that has just exited ends at once, with its output already read.

        Containers run without a terminal and with stdin closed, so what the client sends is read and dropped.
        """
        q = request.query
        pod = self.store.must_get("pods", ns, name)
        names = [c["name"] for c in pod["spec"].get("containers") or []]
        container = q.get("container") or names[0]
        worker = self.cluster.worker_for(pod)
        c = worker.container(container) if worker else None
        if c is None:
            raise bad_request(f"container {container} is not valid for pod {name}")
        if c.log is None or (c.proc is None and "running" not in c.state):
            raise bad_request(
                f"unable to upgrade connection: container {container} not found in pod {name}_{ns}"
            )
        if request.headers.get("Upgrade", "").lower() != "websocket":
            raise bad_request(
                "Upgrade request required: the local Kubernetes API serves attach over WebSocket "
                f"({', '.join(EXEC_PROTOCOLS[:2])}), not SPDY"
            )
        ws = web.WebSocketResponse(protocols=EXEC_PROTOCOLS, autoping=True, max_msg_size=0)
        await ws.prepare(request)
        proto = ws.ws_protocol or "channel.k8s.io"
        uid = pod["metadata"]["uid"]

        def alive() -> bool:
            cur = self.store.get("pods", ns, name)
            return cur is not None and cur["metadata"]["uid"] == uid

        async def drain_client() -> None:
            async for _msg in ws:
                pass

        reader = asyncio.ensure_future(drain_client())
        # kubectl reads the log so far, then attaches: go on from that read, so that no line is lost or repeated
        now = time.time_ns()
        opts = LogOptions(
            follow=True, since_ns=c.log_read_ns if now - c.log_read_ns < 10_000_000_000 else now
        )
        with contextlib.suppress(ConnectionResetError, asyncio.CancelledError):
            async for chunk in stream_log(c.log, c.log.path, opts, alive):
                if q.get("stdout", "true") in TRUE:
                    await ws.send_bytes(b"\x01" + chunk)
            if proto in ("v4.channel.k8s.io", "v5.channel.k8s.io"):
                await ws.send_bytes(b"\x03" + exec_status(0, None).encode())
        reader.cancel()
        await ws.close()
        return ws

    # -- pods/exec ---------------------------------------------------------------------------

    async def pod_exec(self, request: web.Request, ns: str, name: str) -> web.StreamResponse:
        q = request.query
        pod = self.store.must_get("pods", ns, name)
        command = q.getall("command", [])
        if not command:
            raise bad_request("you must specify at least 1 command")
        names = [c["name"] for c in pod["spec"].get("containers") or []]
        container = q.get("container") or (names[0] if len(names) == 1 else "")
        if not container:
            raise bad_request(
                f"a container name must be specified for pod {name}, choose one of: [{' '.join(names)}]"
            )
        worker = self.cluster.worker_for(pod)
        c = worker.container(container) if worker else None
        if c is None:
            raise bad_request(f"container {container} is not valid for pod {name}")
        if c.proc is None or c.proc.finished.is_set() or not c.proc.pid or "running" not in c.state:
            raise bad_request(f'unable to upgrade connection: container not found ("{container}")')
        if request.headers.get("Upgrade", "").lower() != "websocket":
            raise bad_request(
                "Upgrade request required: the local Kubernetes API serves exec over WebSocket "
                f"({', '.join(EXEC_PROTOCOLS[:2])}), not SPDY"
            )
        ws = web.WebSocketResponse(protocols=EXEC_PROTOCOLS, autoping=True, max_msg_size=0)
        await ws.prepare(request)
        proto = ws.ws_protocol or "channel.k8s.io"
        want_stdin = q.get("stdin") in TRUE
        want = {1: q.get("stdout", "true") in TRUE, 2: q.get("stderr", "true") in TRUE}
        out_q: asyncio.Queue = asyncio.Queue()

        def on_output(stream: str, data: bytes) -> None:
            ch = 1 if stream == "stdout" else 2
            if want[ch]:
                out_q.put_nowait(bytes([ch]) + data)

        try:
            proc, _ = await worker.exec(container, command, on_output, want_stdin)
        except Exception as exc:  # noqa: BLE001 - reported on the error channel as the kubelet does
            await ws.send_bytes(b"\x03" + exec_status(None, str(exc)).encode())
            await ws.close()
            return ws
        error = await proc.started
        stdin = proc.shim.stdin

        async def read_client() -> None:
            async for msg in ws:
                if msg.type not in (WSMsgType.BINARY, WSMsgType.TEXT):
                    continue
                data = (
                    msg.data if isinstance(msg.data, bytes) else msg.data.encode("utf-8", "surrogateescape")
                )
                if not data:
                    continue
                ch, payload = data[0], data[1:]
                if ch == 0 and stdin is not None and not stdin.is_closing():
                    stdin.write(payload)
                    with contextlib.suppress(ConnectionResetError, BrokenPipeError):
                        await stdin.drain()
                elif ch == 255 and payload[:1] == b"\x00" and stdin is not None:
                    stdin.close()

        async def send_output() -> None:
            while True:
                item = await out_q.get()
                if item is None:
                    return
                await ws.send_bytes(item)

        reader = asyncio.ensure_future(read_client())
        sender = asyncio.ensure_future(send_output())
        code = await proc.wait()
        if error:
            # as a shell reports it: 127 not found, 126 not executable; the reason goes to stderr
            code = 126 if "permission denied" in error.lower() else 127
            out_q.put_nowait(b"\x02" + f"failed to exec in container: {error}\n".encode())
            error = None
        out_q.put_nowait(None)
        with contextlib.suppress(Exception):
            await sender
        reader.cancel()
        if proto in ("v4.channel.k8s.io", "v5.channel.k8s.io"):
            await ws.send_bytes(b"\x03" + exec_status(code, error).encode())
        elif code or error:
            await ws.send_bytes(
                b"\x03" + (error or f"command terminated with non-zero exit code: {code}").encode()
            )
        await ws.close()
        return ws


# -- utilities -------------------------------------------------------------------------------


def v_invalid_review() -> ApiError:
    return ApiError(
        422,
        "Invalid",
        'SelfSubjectAccessReview.authorization.k8s.io "" is invalid: [spec.resourceAttributes: '
        'Invalid value: "null": exactly one of nonResourceAttributes or resourceAttributes must be specified]',
        kind="SelfSubjectAccessReview",
        group="authorization.k8s.io",
    )


def exec_status(code: int | None, error: str | None) -> str:
    if error:
        return json.dumps(
            {
                "metadata": {},
                "status": "Failure",
                "message": error,
                "reason": "InternalError",
                "details": {"causes": [{"message": error}]},
            }
        )
    if code == 0:
        return json.dumps({"metadata": {}, "status": "Success"})
    return json.dumps(
        {
            "metadata": {},
            "status": "Failure",
            "message": f"command terminated with non-zero exit code: error executing command, exit code {code}",
            "reason": "NonZeroExitCode",
            "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]},
        }
    )


def classify(change, match) -> str | None:
    """The watch event a selector-filtered watcher sees for one change (transitions become ADDED/DELETED)."""
    if change.type == "ADDED":
        return "ADDED" if match(change.obj) else None
    if change.type == "DELETED":
        return "DELETED" if match(change.obj) or match(change.old) else None
    now, before = match(change.obj), match(change.old)
    if now and before:
        return "MODIFIED"
    if now:
        return "ADDED"
    if before:
        return "DELETED"
    return None


def wants_table(request: web.Request) -> bool:
    accept = request.headers.get("Accept", "")
    first = accept.split(",")[0] if accept else ""
    return "as=Table" in first


def warning_headers(warnings: list[str]) -> dict | None:
    if not warnings:
        return None
    return {"Warning": ", ".join(f'299 - "{w}"' for w in warnings)}


# -- the router's tables ------------------------------------------------------------------------

# what the root path lists, as kube-apiserver's does (the groups' own paths come from discovery)
ROOT_PATHS = [
    "/api",
    "/api/v1",
    "/apis",
    "/apis/batch",
    "/apis/batch/v1",
    "/apis/events.k8s.io",
    "/apis/events.k8s.io/v1",
    "/apis/apiextensions.k8s.io",
    "/apis/apiextensions.k8s.io/v1",
    "/healthz",
    "/livez",
    "/openapi/v2",
    "/openapi/v3",
    "/readyz",
    "/version",
]


def _core_versions(request: web.Request, parts: list[str]) -> web.StreamResponse | None:
    if len(parts) > 1:
        return None  # /api/<version>...: a resource path
    return _json(
        {
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}],
        }
    )


def _groups(request: web.Request, parts: list[str]) -> web.StreamResponse | None:
    if len(parts) == 1:
        return _json(group_list())
    if len(parts) == 2:
        if parts[1] not in GROUPS:
            raise unsupported_group(parts[1])
        return _json(api_group(parts[1]))
    return None  # /apis/<group>/<version>...: a resource path


# The paths answered by the first segment alone, or by the discovery documents of /api and /apis (a handler
# that returns None leaves the path to the resource routing).
ROOTS = {
    "": lambda request, parts: _json({"paths": ROOT_PATHS}),
    "version": lambda request, parts: _json(SERVER_VERSION),
    "healthz": lambda request, parts: web.Response(text="ok"),
    "livez": lambda request, parts: web.Response(text="ok"),
    "readyz": lambda request, parts: web.Response(text="ok"),
    "openapi": lambda request, parts: openapi.handle(request, parts[1:]),
}
DISCOVERY_DOCUMENTS = {"api": _core_versions, "apis": _groups}


def is_discovery(parts: list[str]) -> bool:
    """Paths authorized as non-resource URLs (RBAC's nonResourceURLs): the root, health, OpenAPI and discovery."""
    return (
        not parts
        or parts[0] in ("version", "healthz", "livez", "readyz", "openapi")
        or (parts[0] == "api" and len(parts) <= 2)
        or (parts[0] == "apis" and len(parts) <= 3)
    )


def no_such_path() -> ApiError:
    return ApiError(404, "NotFound", "the server could not find the requested resource")


def not_allowed(detail: str = "") -> ApiError:
    return ApiError(
        405,
        "MethodNotAllowed",
        "the server does not allow this method on the requested resource"
        + (f" ({detail})" if detail else ""),
    )


def group_version(parts: list[str]) -> tuple[str, str, list[str]]:
    """``(group, version, the rest)`` of a path under /api/v1 or /apis/<group>/<version>, the version served."""
    if parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        raise no_such_path()
    if version not in served_versions(group):
        raise unsupported_group(group or "core", version)
    return group, version, rest


@dataclass(frozen=True)
class ResourcePath:
    """What a resource path names: ``[watch/][namespaces/<ns>/]<resource>[/<name>[/<subresource>]]``."""

    resource: str
    namespace: str | None = None
    name: str | None = None
    sub: str | None = None
    watch_path: bool = False  # the legacy /watch/ prefix

    def watching(self, query) -> bool:
        return self.watch_path or query.get("watch") in TRUE


def parse_resource_path(group: str, version: str, rest: list[str]) -> ResourcePath:
    watch_path = rest[0] == "watch"
    if watch_path:
        rest = rest[1:]
        if not rest:
            raise no_such_path()
    # namespaces/<ns>/status and namespaces/<ns>/finalize are the namespace's own subresources
    if rest[0] == "namespaces" and len(rest) >= 3 and rest[2] not in ("status", "finalize"):
        if len(rest) > 5:
            raise no_such_path()
        ns, rest = rest[1], rest[2:]
    else:
        if len(rest) > 3:
            raise no_such_path()
        ns = None
    return ResourcePath(
        resource=rest[0],
        namespace=ns,
        name=rest[1] if len(rest) > 1 else None,
        sub=rest[2] if len(rest) > 2 else None,
        watch_path=watch_path,
    )


# what a request for a subresource this local API does not serve is told it lacks
UNSERVED_SUBRESOURCES = {
    "portforward": "port-forward",
    "attach": "attach",
    "proxy": "proxy",
    "eviction": "eviction",
    "ephemeralcontainers": "ephemeral containers",
    "scale": "scale",
}


def check_scope(res: Resource, path: ResourcePath) -> None:
    """404 for a namespace on a cluster resource, a named namespaced object without its namespace, or a
    subresource the resource does not have."""
    if not res.namespaced and path.namespace is not None:
        raise no_such_path()
    if res.namespaced and path.namespace is None and path.name is not None:
        raise no_such_path()
    if path.sub is not None and path.sub not in res.subresources:
        what = UNSERVED_SUBRESOURCES.get(path.sub, path.sub)
        raise ApiError(
            404,
            "NotFound",
            f"the server could not find the requested resource ({res.name}/{path.sub}): "
            f"{what} is not supported by the local Kubernetes API",
        )


# the subresources that stream (whatever the method), the POSTs that review rather than create, and the
# handler of each method
STREAMS = {"log": Api.pod_log, "exec": Api.pod_exec, "attach": Api.pod_attach}
REVIEWS = {"selfsubjectaccessreviews": Api.access_review, "selfsubjectrulesreviews": Api.rules_review}
METHODS = {"GET": Api._get, "POST": Api._post, "PUT": Api._put, "PATCH": Api._patch, "DELETE": Api._delete}


async def read_body(request: web.Request):
    raw = await request.read()
    if not raw:
        return None
    ctype = request.content_type
    if ctype == protobuf.MEDIA_TYPE:
        return protobuf.decode(raw)
    if "yaml" in ctype:
        import yaml

        try:
            return yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise bad_request(f"the body is not valid YAML: {exc}") from None
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        if "apply-patch" in ctype:
            return raw
        raise bad_request(f"the body is not valid JSON: {exc}") from None


def normalize_secret(obj: dict) -> None:
    obj.setdefault("type", "Opaque")
    string_data = obj.pop("stringData", None) or {}
    if string_data:
        data = obj.setdefault("data", {}) or {}
        for k, val in string_data.items():
            data[k] = base64.b64encode(str(val).encode()).decode()
        obj["data"] = data


def to_events_v1(ev: dict) -> dict:
    if ev.get("kind") != "Event" or ev.get("apiVersion") != "v1":
        return ev
    first = ev.get("firstTimestamp")
    return {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": ev["metadata"],
        "eventTime": ev.get("eventTime") or rfc3339_micro(parse_time(first) if first else None),
        "reportingController": ev.get("reportingComponent") or ev.get("source", {}).get("component", ""),
        "reportingInstance": ev.get("reportingInstance", ""),
        "action": ev.get("reason", ""),
        "reason": ev.get("reason", ""),
        "regarding": ev.get("involvedObject", {}),
        "note": ev.get("message", ""),
        "type": ev.get("type", ""),
        "deprecatedSource": ev.get("source", {}),
        "deprecatedFirstTimestamp": first,
        "deprecatedLastTimestamp": ev.get("lastTimestamp"),
        "deprecatedCount": ev.get("count", 1),
    }


def resource_list(group: str, version: str) -> dict:
    gv = f"{group}/{version}" if group else version
    resources = []
    for (g, _), res in RESOURCES.items():
        if g != group:
            continue
        entry = {
            "name": res.name,
            "singularName": res.singular,
            "namespaced": res.namespaced,
            "kind": res.kind,
            "verbs": list(res.verbs),
        }
        if res.short_names:
            entry["shortNames"] = list(res.short_names)
        if res.categories:
            entry["categories"] = list(res.categories)
        resources.append(entry)
        for sub, verbs in res.subresources.items():
            kind = {"log": "Pod", "exec": "PodExecOptions", "status": res.kind}.get(sub, res.kind)
            resources.append(
                {
                    "name": f"{res.name}/{sub}",
                    "singularName": "",
                    "namespaced": res.namespaced,
                    "kind": kind,
                    "verbs": list(verbs),
                }
            )
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}


def api_group(group: str) -> dict:
    versions = [{"groupVersion": f"{group}/{v}", "version": v} for v in served_versions(group)]
    return {
        "kind": "APIGroup",
        "apiVersion": "v1",
        "name": group,
        "versions": versions,
        "preferredVersion": versions[0],
    }


def group_list() -> dict:
    return {
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": [api_group(g) | {"kind": None} for g in GROUPS],
    }


# -- main ------------------------------------------------------------------------------------


def build_app(
    cluster: Cluster, tokens: dict[str, rbac.Identity] | None = None, kueue_config: Path | None = None
) -> web.Application:
    api = Api(cluster, tokens, kueue_config)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", api.handle)

    async def on_startup(_app: web.Application) -> None:
        await cluster.remove_stale()
        api.jobs.start()

    async def on_shutdown(_app: web.Application) -> None:
        await cluster.shutdown()

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app["api"] = api
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m include.devstack.kubeapi", description="Local Kubernetes API server"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=6443)
    parser.add_argument("--state-dir", type=Path, required=True, help="where pods keep volumes and logs")
    parser.add_argument(
        "--strict-gpu",
        action="store_true",
        help="pods that request more nvidia.com/gpu than present stay Pending (FailedScheduling)",
    )
    parser.add_argument(
        "--image-store",
        type=Path,
        default=Path(os.environ.get("KUBETRAIN_IMAGE_STORE") or DEFAULT_STORE),
        help="the node's image store (layers unpacked once; may be shared by dev stacks on a machine)",
    )
    parser.add_argument(
        "--mirror",
        default=os.environ.get("KUBETRAIN_REGISTRY_MIRROR") or None,
        metavar="HOST:PORT",
        help="registry mirror for docker.io and quay.io images (the dev stack's, include/devstack/mirror.py)",
    )
    parser.add_argument(
        "--backoff-seconds",
        type=float,
        default=float(os.environ.get("KUBETRAIN_BACKOFF_SECONDS", "10")),
        help="initial restart back-off (the kubelet's is 10 s)",
    )
    parser.add_argument(
        "--kubernetes-version",
        default=None,
        metavar="1.MINOR",
        help=f"report this Kubernetes version instead of 1.{MINIMUM_MINOR}, the oldest kubetrain supports "
        "(to see how clients treat an older cluster)",
    )
    parser.add_argument(
        "--tls-cert-file",
        type=Path,
        default=None,
        help="serve HTTPS with this certificate (PEM), as every real API server does: kubectl sends a "
        "bearer token over HTTPS only",
    )
    parser.add_argument(
        "--tls-private-key-file", type=Path, default=None, help="the certificate's private key (PEM)"
    )
    parser.add_argument(
        "--kueue-config",
        type=Path,
        default=None,
        help="run the small Kueue stand-in (include/devstack/kubeapi/kueue.py) with these ClusterQueues, "
        "LocalQueues and WorkloadPriorityClasses (YAML)",
    )
    parser.add_argument(
        "--token-auth-file",
        type=Path,
        required=True,
        help='bearer tokens and the users they stand for, one token,user,uid,"groups" per line '
        "(kube-apiserver's format); every request is then authorized by RBAC",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout
    )
    state_dir = args.state_dir.resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    try:
        if args.kubernetes_version:
            set_version(args.kubernetes_version)
        tokens = rbac.read_token_file(args.token_auth_file)
        cluster = Cluster(
            state_dir,
            port=args.port,
            image_store=args.image_store,
            mirror=args.mirror,
            strict_gpu=args.strict_gpu,
            backoff=args.backoff_seconds,
        )
    except (RuntimeUnavailable, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log.info(
        "local Kubernetes API on http://%s:%d: runc %s, image store %s, mirror %s, %d GPU(s)%s",
        args.host,
        args.port,
        cluster.runc,
        args.image_store,
        args.mirror or "(none)",
        len(cluster.gpus),
        " (strict)" if args.strict_gpu else "",
    )
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    ssl_context = None
    if args.tls_cert_file:
        import ssl

        ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ssl_context.load_cert_chain(args.tls_cert_file, args.tls_private_key_file)
    web.run_app(
        build_app(cluster, tokens, args.kueue_config),
        host=args.host,
        port=args.port,
        access_log=None,
        print=None,
        shutdown_timeout=5,
        ssl_context=ssl_context,
    )
    return 0
