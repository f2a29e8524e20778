"""Shared by the tests that run a multi-process TensorFlow cluster on this machine: free ports (the data: conftest.py)."""

from __future__ import annotations

import random
import socket


def free_hosts(replicas: int) -> str:
    """A host pattern ``127.0.0.1:<base>{replica}`` whose ports for replicas 0 to ``replicas - 1`` are free."""
    for _ in range(200):
        base = random.randint(2000, 6500)
        free = True
        for replica in range(replicas):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", int(f"{base}{replica}")))
                except OSError:
                    free = False
        if free:
            return f"127.0.0.1:{base}{{replica}}"
    raise RuntimeError(f"no {replicas} free ports")
