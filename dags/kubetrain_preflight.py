"""
### Preflight: is the cluster ready for kubetrain?

Checks, in under a minute, what a first training run needs, one line each (PASS, FAIL with
the fix, WARN, INFO): the Kubernetes API and the namespace; the S3 Secret's keys (or the
workload identity's service account); that the trainer and sync images can be pulled (a
short-lived pod each, deleted afterwards); that a pod can reach the S3 endpoint and read the
datasets bucket; GPU nodes and their taints; the `gpu` pool (read through Airflow's REST API with
the `airflow_api` connection: the API server's URL and a user's login and password, or extra
`{"token": ...}`; without it the line says INFO and how to check by hand); the registry as the workers
reach it; and which distributed-training APIs the cluster serves (TFJob, TrainJob, Indexed
Job). The task fails when any check fails; its log lists every line. A second task reviews, from
the triggerer, what the triggerer's own account may do (deferred tasks are followed from there,
under another identity than the workers').

Also runnable without Airflow's scheduler: `make preflight` in the checkout, `kubetrain-preflight` where the
kubetrain wheel is installed.
Settings: the deployment's (`KUBETRAIN_*` or the `kubetrain_*` Variables), connections
`kubernetes_default`, `kubetrain_registry_default` and `airflow_api`.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from airflow.sdk import dag, task

from kubetrain import DEFAULT_ARGS, TriggererAccessOperator


@dag(
    dag_id=Path(__file__).stem,
    doc_md=__doc__,
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    default_args=DEFAULT_ARGS,  # a failed check raises AirflowFailException: never retried
    tags=["kubetrain", "preflight"],
)
def kubetrain_preflight():
    @task
    def preflight() -> list[str]:
        from kubetrain import fail_on_failures, run_preflight

        return fail_on_failures(run_preflight(lambda check: print(check.line(), flush=True)))

    preflight()
    TriggererAccessOperator(task_id="triggerer_access")


kubetrain_preflight()
