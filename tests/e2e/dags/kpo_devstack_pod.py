"""
### Local Kubernetes API: pod and job operators end to end (test-only DAG)

Runs the cncf-kubernetes provider's operators against the dev stack's local Kubernetes API:

* `sync_pod`: a KubernetesPodOperator with an init container, a native sidecar
  (init container with `restartPolicy: Always`), an emptyDir shared by all three, an env var
  from the dev stack's S3 Secret, streamed logs and an XCom return value;
* `deferrable_pod`: the same pod in deferrable mode;
* `indexed_job`: a KubernetesJobOperator with two indexed completions.

tests/e2e/test_kpo_devstack.py runs it with `airflow dags test` and checks the outcomes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pendulum
from airflow.providers.cncf.kubernetes.operators.job import KubernetesJobOperator
from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.sdk import dag
from kubernetes.client import models as k8s

S3_SECRET = os.environ.get("KUBETRAIN_S3_SECRET", "kubetrain-s3")
# The namespace enforces Pod Security level restricted: every container, the provider's XCom sidecar too,
# runs as a non-root user without privileges or capabilities, under the runtime's default seccomp profile.
RESTRICTED = k8s.V1SecurityContext(
    allow_privilege_escalation=False,
    capabilities=k8s.V1Capabilities(drop=["ALL"]),
    run_as_non_root=True,
    seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault"),
)
POD_SECURITY = k8s.V1PodSecurityContext(
    run_as_user=10001,
    run_as_group=10001,
    run_as_non_root=True,
    seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault"),
)
SHARED = k8s.V1Volume(name="shared", empty_dir=k8s.V1EmptyDirVolumeSource())
SHARED_MOUNT = k8s.V1VolumeMount(name="shared", mount_path="/shared")

# The base container proves each feature from the inside and reports it in its log and XCom.
# The Secret value itself is never printed: only a short fingerprint of it.
BASE_SCRIPT = """
import hashlib, json, os, pathlib, time
shared = pathlib.Path("/shared")
greeting = (shared / "greeting.txt").read_text().strip()
beats_file = shared / "heartbeat.log"
for _ in range(50):
    if beats_file.exists() and beats_file.read_text().strip():
        break
    time.sleep(0.1)
beats = len(beats_file.read_text().splitlines())
fingerprint = hashlib.sha256(os.environ["S3_KEY_ID"].encode()).hexdigest()[:12]
print(f"greeting from init: {greeting}", flush=True)
print(f"sidecar heartbeats seen: {beats}", flush=True)
print(f"key fingerprint: {fingerprint}", flush=True)
print(f"pid in container: {os.getpid()}", flush=True)
for i in range(3):
    print(f"progress {i + 1}/3", flush=True)
    time.sleep(0.3)
result = {"greeting": greeting, "beats": beats, "fingerprint": fingerprint, "pid": os.getpid()}
pathlib.Path("/airflow/xcom/return.json").write_text(json.dumps(result))
"""

SIDECAR_SCRIPT = (
    "trap 'echo sidecar stopping >> /shared/heartbeat.log; exit 0' TERM; "
    "while true; do echo beat >> /shared/heartbeat.log; sleep 0.2; done"
)


def pod_task(task_id: str, *, deferrable: bool) -> KubernetesPodOperator:
    return KubernetesPodOperator(
        task_id=task_id,
        name=f"e2e-{task_id.replace('_', '-')}",
        namespace="kubetrain",
        image="python:3.11-slim",
        cmds=["python", "-c", BASE_SCRIPT],
        env_vars=[
            k8s.V1EnvVar(
                name="S3_KEY_ID",
                value_from=k8s.V1EnvVarSource(
                    secret_key_ref=k8s.V1SecretKeySelector(name=S3_SECRET, key="AWS_ACCESS_KEY_ID")
                ),
            )
        ],
        init_containers=[
            k8s.V1Container(
                name="stage-in",
                image="busybox:1.36",
                command=["sh", "-c", "echo hello-from-init > /shared/greeting.txt"],
                volume_mounts=[SHARED_MOUNT],
                security_context=RESTRICTED,
            ),
            k8s.V1Container(
                name="heartbeat",
                image="busybox:1.36",
                restart_policy="Always",
                command=["sh", "-c", SIDECAR_SCRIPT],
                volume_mounts=[SHARED_MOUNT],
                security_context=RESTRICTED,
            ),
        ],
        security_context=POD_SECURITY,
        container_security_context=RESTRICTED,
        xcom_sidecar_container_security_context=RESTRICTED,
        volumes=[SHARED],
        volume_mounts=[SHARED_MOUNT],
        get_logs=True,
        do_xcom_push=True,
        on_finish_action="delete_pod",
        deferrable=deferrable,
        poll_interval=1,
        startup_check_interval_seconds=1,
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
def kpo_devstack_pod():
    pod_task("sync_pod", deferrable=False)
    pod_task("deferrable_pod", deferrable=True)
    KubernetesJobOperator(
        task_id="indexed_job",
        name="e2e-indexed",
        namespace="kubetrain",
        image="busybox:1.36",
        cmds=["sh", "-c", 'echo "job index=$JOB_COMPLETION_INDEX host=$(hostname)"'],
        security_context=POD_SECURITY,
        container_security_context=RESTRICTED,
        completion_mode="Indexed",
        completions=2,
        parallelism=2,
        backoff_limit=0,
        wait_until_job_complete=True,
        job_poll_interval=1,
        get_logs=True,
    )


kpo_devstack_pod()
