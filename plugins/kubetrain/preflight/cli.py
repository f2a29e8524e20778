"""The command line: ``kubetrain-preflight`` where the wheel is installed, ``python -m kubetrain.preflight``
(what ``make preflight`` runs) in the checkout. Prints one line per check and a count; the exit status is 1
when any check failed."""

from __future__ import annotations

import argparse
import logging

import kubetrain.preflight
from kubetrain.preflight.airflow_api import AIRFLOW_API_CONN_ID, configured_api_url
from kubetrain.preflight.suite import run_preflight


def main(argv: list[str] | None = None) -> int:
    """Run the preflight with the command line's options, print its lines; 1 when a check failed, else 0."""
    parser = argparse.ArgumentParser(
        prog="python -m kubetrain.preflight", description=kubetrain.preflight.__doc__.split("\n\n")[0]
    )
    parser.add_argument("--kubernetes-conn-id", default="kubernetes_default")
    parser.add_argument("--registry-conn-id", default="kubetrain_registry_default")
    parser.add_argument(
        "--pool", default="gpu", help="the Airflow pool of GPU training tasks (default %(default)s)"
    )
    parser.add_argument(
        "--pod-timeout", type=float, default=45.0, help="seconds per preflight pod (default %(default)s)"
    )
    parser.add_argument(
        "--airflow-api-conn-id",
        default=AIRFLOW_API_CONN_ID,
        help="connection to Airflow's REST API, where the pool is read (default %(default)s)",
    )
    parser.add_argument(
        "--airflow-api-url",
        help="the Airflow API server's URL, over the connection's host (default: the connection's host, "
        "else [api] base_url)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        preflight = run_preflight(
            lambda check: print(check.line(), flush=True),
            kubernetes_conn_id=args.kubernetes_conn_id,
            registry_conn_id=args.registry_conn_id,
            pool=args.pool,
            pod_timeout=args.pod_timeout,
            airflow_api_conn_id=args.airflow_api_conn_id,
            airflow_api_url=args.airflow_api_url or None,
            airflow_api_default_url=configured_api_url() or None,
        )
    except ValueError as exc:  # a setting that does not parse
        print(f"FAIL  settings: {exc}", flush=True)
        return 1
    failed = preflight.failed
    print(f"{len(preflight.results) - len(failed)} passed or noted, {len(failed)} failed", flush=True)
    return 1 if failed else 0
