"""
### Local Kubernetes API: a failing pod fails its task (test-only DAG)

`failing_pod` runs a container that exits with code 3; the KubernetesPodOperator must fail the
task with the pod's exit code in its error. tests/e2e/test_kpo_devstack.py runs it with
`airflow dags test`.
"""

from __future__ import annotations

from pathlib import Path

import pendulum
from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.sdk import dag
from kubernetes.client import models as k8s

# the namespace enforces Pod Security level restricted
RESTRICTED = k8s.V1SecurityContext(
    allow_privilege_escalation=False,
    capabilities=k8s.V1Capabilities(drop=["ALL"]),
    run_as_non_root=True,
    run_as_user=10001,
    seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault"),
)


@dag(
    dag_id=Path(__file__).stem,
    doc_md=__doc__,
    schedule=None,
    start_date=pendulum.datetime(2025, 1, 1, tz="UTC"),
    catchup=False,
    tags=["kubetrain", "e2e"],
    default_args={"retries": 0},
)
def kpo_devstack_failure():
    KubernetesPodOperator(
        task_id="failing_pod",
        name="e2e-failing",
        namespace="kubetrain",
        image="busybox:1.36",
        cmds=["sh", "-c", "echo about to fail; exit 3"],
        get_logs=True,
        on_finish_action="delete_pod",
        termination_message_policy="FallbackToLogsOnError",
        container_security_context=RESTRICTED,
        startup_check_interval_seconds=1,
    )


kpo_devstack_failure()
