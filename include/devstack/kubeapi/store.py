"""The object store: one resourceVersion counter, a change history for watches, subscribers.

Everything runs on one asyncio loop, so there are no locks: a read-modify-write without an
``await`` in between is atomic.
"""

from __future__ import annotations

import asyncio
import copy
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from include.devstack.kubeapi.meta import already_exists, conflict, not_found, rfc3339

HISTORY = 20000  # watch events kept for resuming from a resourceVersion


@dataclass
class Change:
    rv: int
    resource: str
    namespace: str
    type: str  # ADDED, MODIFIED, DELETED
    obj: dict
    old: dict | None


@dataclass(eq=False)
class Watcher:
    resource: str
    namespace: str | None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class Store:
    def __init__(self) -> None:
        self.rv = 1
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.history: deque[Change] = deque(maxlen=HISTORY)
        self.watchers: set[Watcher] = set()

    # -- reads -------------------------------------------------------------------------------

    def get(self, resource: str, namespace: str, name: str) -> dict | None:
        return self.objects.get((resource, namespace, name))

    def must_get(self, resource: str, namespace: str, name: str, group: str = "") -> dict:
        obj = self.get(resource, namespace, name)
        if obj is None:
            raise not_found(resource, name, group)
        return obj

    def list(self, resource: str, namespace: str | None = None) -> list[dict]:
        items = [
            obj
            for (res, ns, _), obj in self.objects.items()
            if res == resource and (namespace is None or ns == namespace)
        ]
        items.sort(key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))
        return items

    @property
    def oldest_rv(self) -> int:
        return self.history[0].rv if len(self.history) == self.history.maxlen else 0

    # -- writes ------------------------------------------------------------------------------

    def _next_rv(self) -> str:
        self.rv += 1
        return str(self.rv)

    def create(self, resource: str, obj: dict, group: str = "") -> dict:
        meta = obj.setdefault("metadata", {})
        key = (resource, meta.get("namespace", ""), meta["name"])
        if key in self.objects:
            raise already_exists(resource, meta["name"], group)
        meta["uid"] = meta.get("uid") or str(uuid.uuid4())
        meta["creationTimestamp"] = rfc3339()
        if "spec" in obj:
            meta.setdefault("generation", 1)
        meta["resourceVersion"] = self._next_rv()
        for empty in ("labels", "annotations"):
            if empty in meta and meta[empty] is None:
                del meta[empty]
        self.objects[key] = obj
        self._emit(resource, "ADDED", obj, None)
        return obj

    def replace(self, resource: str, obj: dict, *, expect_rv: str | None = None, group: str = "") -> dict:
        meta = obj["metadata"]
        key = (resource, meta.get("namespace", ""), meta["name"])
        old = self.objects.get(key)
        if old is None:
            raise not_found(resource, meta["name"], group)
        if expect_rv and expect_rv != old["metadata"]["resourceVersion"]:
            raise conflict(resource, meta["name"], group)
        if obj == old:
            return old
        if obj.get("spec") != old.get("spec"):
            meta["generation"] = old["metadata"].get("generation", 1) + 1
        meta["resourceVersion"] = self._next_rv()
        self.objects[key] = obj
        self._emit(resource, "MODIFIED", obj, old)
        return obj

    def mutate(self, resource: str, namespace: str, name: str, fn: Callable[[dict], None]) -> dict | None:
        """Apply ``fn`` to a copy; store it (new resourceVersion) only when something changed."""
        old = self.get(resource, namespace, name)
        if old is None:
            return None
        new = copy.deepcopy(old)
        fn(new)
        return self.replace(resource, new)

    def remove(self, resource: str, namespace: str, name: str) -> dict | None:
        old = self.objects.pop((resource, namespace, name), None)
        if old is None:
            return None
        final = copy.deepcopy(old)
        final["metadata"]["resourceVersion"] = self._next_rv()
        self._emit(resource, "DELETED", final, old)
        return final

    # -- watches -----------------------------------------------------------------------------

    def _emit(self, resource: str, type_: str, obj: dict, old: dict | None) -> None:
        change = Change(
            self.rv, resource, obj["metadata"].get("namespace", ""), type_, copy.deepcopy(obj), old
        )
        self.history.append(change)
        for watcher in list(self.watchers):
            if watcher.resource == resource and (watcher.namespace in (None, change.namespace)):
                watcher.queue.put_nowait(change)

    def subscribe(self, resource: str, namespace: str | None) -> Watcher:
        watcher = Watcher(resource, namespace)
        self.watchers.add(watcher)
        return watcher

    def unsubscribe(self, watcher: Watcher) -> None:
        self.watchers.discard(watcher)

    def changes_since(self, resource: str, namespace: str | None, rv: int) -> list[Change]:
        return [
            c
            for c in self.history
            if c.rv > rv and c.resource == resource and (namespace is None or c.namespace == namespace)
        ]
