"""
### Build the trainer image

Keeps the training image in the private registry in step with the `trainer/` package,
and publishes it for the training DAGs.

**Steps**: hash `trainer/` (without `.venv`, caches and tests); stop here when the code
is what was published last. When the dependencies (`requirements*.txt`, the lock, the
`Dockerfile`) changed, build `trainer/Dockerfile` in full with buildah and tag it
`deps-<hash>`; otherwise append one layer holding the code to that image, without pulling
it (seconds, kilobytes). Then point the Variable `kubetrain_trainer_image` at the new image
**by digest**, move the `latest` tag, and emit an event on the `kubetrain_trainer_image`
Asset. Training DAGs use that Variable by default.

**Runs** hourly (cron in `KUBETRAIN_IMAGE_BUILD_CRON`; empty for manual runs only) and
when triggered. Params: `mode` (auto, full, append) and `force`.

**Settings**: registry connection `KUBETRAIN_REGISTRY_CONN_ID` (default
`kubetrain_registry_default`); Variables `kubetrain_trainer_repository` (default
`kubetrain/trainer`) and `kubetrain_trainer_code_dir` (where the code lands in the image,
default `/app/trainer`); `KUBETRAIN_TRAINER_DIR` (default: `trainer/` next to `dags/`).
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import Asset, Param, dag, task

from kubetrain.operators.build import AppendLayerOperator, BuildImageOperator

TRAINER_DIR = os.environ.get("KUBETRAIN_TRAINER_DIR") or str(Path(__file__).resolve().parents[1] / "trainer")
REGISTRY_CONN_ID = os.environ.get("KUBETRAIN_REGISTRY_CONN_ID", "kubetrain_registry_default")
SCHEDULE = os.environ.get("KUBETRAIN_IMAGE_BUILD_CRON", "@hourly") or None
TRAINER_IMAGE = Asset("kubetrain_trainer_image")

REPOSITORY = "{{ var.value.get('kubetrain_trainer_repository', 'kubetrain/trainer') }}"
CODE_DIR = "{{ var.value.get('kubetrain_trainer_code_dir', '/app/trainer') }}"
PLAN = "ti.xcom_pull(task_ids='plan')"


@dag(
    dag_id=Path(__file__).stem,
    doc_md=__doc__,
    schedule=SCHEDULE,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    default_args={"owner": "kubetrain", "retries": 2, "retry_delay": timedelta(seconds=30)},
    tags=["kubetrain", "image", "build"],
    params={
        "mode": Param(
            "auto", type="string", enum=["auto", "full", "append"], title="Mode",
            description="auto: full build when the dependencies changed, else a code layer; full or append: force one.",
        ),
        "force": Param(False, type="boolean", title="Force", description="Build even when trainer/ is unchanged."),
    },  # fmt: skip
)
def build_trainer_image():
    @task.short_circuit
    def plan(params: dict | None = None) -> dict | bool:
        from airflow.sdk import Variable

        from kubetrain.imagebuild.trainer_image import plan_trainer_image

        repository = Variable.get("kubetrain_trainer_repository", default="kubetrain/trainer")
        return plan_trainer_image(TRAINER_DIR, repository, registry_conn_id=REGISTRY_CONN_ID,
                                  mode=params["mode"], force=params["force"])  # fmt: skip

    @task.branch
    def choose(planned: dict) -> str:
        return "build_full" if planned["action"] == "full" else "append_code"

    build_full = BuildImageOperator(
        task_id="build_full",
        context=TRAINER_DIR,
        dockerfile="Dockerfile",
        repository=REPOSITORY,
        tags=[f"{{{{ {PLAN}['base_tag'] }}}}"],
        revision=f"{{{{ {PLAN}['revision'] or '' }}}}",
        labels={"io.kubetrain.code.sha256": f"{{{{ {PLAN}['code_hash'] }}}}"},
        registry_conn_id=REGISTRY_CONN_ID,
        execution_timeout=timedelta(hours=2),
    )
    append_code = AppendLayerOperator(
        task_id="append_code",
        base_image=f"{REPOSITORY}:{{{{ {PLAN}['base_tag'] }}}}",
        repository=REPOSITORY,
        source=TRAINER_DIR,
        dest=CODE_DIR,
        labels={"org.opencontainers.image.revision": f"{{{{ {PLAN}['revision'] or '' }}}}"},
        registry_conn_id=REGISTRY_CONN_ID,
        execution_timeout=timedelta(minutes=15),
    )

    @task(trigger_rule="none_failed_min_one_success", outlets=[TRAINER_IMAGE])
    def publish(planned: dict, ti=None, outlet_events=None) -> dict:
        from kubetrain.imagebuild.trainer_image import publish_trainer_image

        built = ti.xcom_pull(task_ids="build_full") or ti.xcom_pull(task_ids="append_code")
        record = publish_trainer_image(planned, built, registry_conn_id=REGISTRY_CONN_ID)
        outlet_events[TRAINER_IMAGE].extra = {"reference": record["reference"], "action": record["action"]}
        return record

    planned = plan()
    choose(planned) >> [build_full, append_code]
    [build_full, append_code] >> publish(planned)


build_trainer_image()
