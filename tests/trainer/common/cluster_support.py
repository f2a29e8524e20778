"""Shared by the tests that run a multi-process TensorFlow cluster on this machine: free ports (the data: conftest.py)."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_hosts(replicas: int) -> str:
    """A host pattern ``127.0.0.1:<base>{replica}`` whose ports for replicas 0 to ``replicas - 1`` are free.

    The ports are below Linux's ephemeral range (32768 and up, ``net.ipv4.ip_local_port_range``): a port
    there, free when tried here, can be given to any process's outgoing connection before the replica
    binds it (the Airflow side's suite, run beside this one, makes many; a worker then failed with "Could
    not start gRPC server" on port 37380). Below it, only a process binding that very port can take it.
    """
    low, _ = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    for _ in range(200):
        base = random.randint(2000, (low - 10) // 10)
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
