"""
### Build the trainer and sync images

Keeps both images of the training pods in the private registry in step with the `trainer/`
package, and publishes them for the training DAGs.

**Steps**: hash `trainer/` (without `.venv`, caches and tests) and `trainer/sync` with its
`Dockerfile.sync` and `requirements-sync.txt`; stop here when both are what was published
last. The **trainer**: when its dependencies (`requirements*.txt`, the lock, the `Dockerfile`,
the build arguments) changed, build `trainer/Dockerfile` in full with buildah and tag it
`deps-<hash>` (`deps-<hash>-cpu` for the CPU variant); otherwise append one layer holding the
code to that image, without pulling it (seconds, kilobytes). The **sync image**: when its source
changed, build `trainer/Dockerfile.sync` and tag it `src-<hash>` (a tag already in the registry
is reused). Once **both** images are complete in the registry, move their release tags
(`latest` and `latest-gpu`, or `latest-cpu`; `latest` for the sync image), point the Variables
`kubetrain_trainer_image` and `kubetrain_sync_image` at them **by digest**, and emit events on
the `kubetrain_trainer_image` and `kubetrain_sync_image` Assets. Training DAGs use those
Variables by default. A failed build publishes nothing.

**Runs** hourly (cron in `KUBETRAIN_IMAGE_BUILD_CRON`; empty for manual runs only) and
when triggered. Params: `variant` (gpu or cpu; empty: the `trainer_variant` setting,
`KUBETRAIN_TRAINER_VARIANT`, default gpu), `mode` (auto, full, append) and `force`. The tags are
those of release `image_tag` (`KUBETRAIN_IMAGE_TAG`, default `latest`), as `make images` pushes them.

**Settings**: registry connection `KUBETRAIN_REGISTRY_CONN_ID` (default
`kubetrain_registry_default`); Variables `kubetrain_trainer_repository` (default
`kubetrain/trainer`), `kubetrain_sync_repository` (default `kubetrain/sync`),
`kubetrain_trainer_code_dir` (where the code lands in the image, default `/app/trainer`) and
`kubetrain_image_build_args` (JSON, e.g. `{"trainer-gpu": {"BASE_IMAGE": "..."}, "sync": {...}}`:
build arguments over the official bases); `KUBETRAIN_TRAINER_DIR` (default: `trainer/` next to `dags/`).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import Asset, Param, dag, task

from kubetrain import DEFAULT_ARGS, AppendLayerOperator, BuildImageOperator, environ, with_dialect

TRAINER_DIR = environ("KUBETRAIN_TRAINER_DIR") or str(Path(__file__).resolve().parents[1] / "trainer")
REGISTRY_CONN_ID = environ("KUBETRAIN_REGISTRY_CONN_ID", "kubetrain_registry_default")
SCHEDULE = environ("KUBETRAIN_IMAGE_BUILD_CRON", "@hourly") or None
TRAINER_IMAGE = Asset("kubetrain_trainer_image")
SYNC_IMAGE = Asset("kubetrain_sync_image")

PLAN = "ti.xcom_pull(task_ids='plan')"
REPOSITORY = f"{{{{ {PLAN}['trainer']['repository'] }}}}"
SYNC_REPOSITORY = f"{{{{ {PLAN}['sync']['repository'] }}}}"
CODE_DIR = "{{ var.value.get('kubetrain_trainer_code_dir', '/app/trainer') }}"


@dag(
    dag_id=Path(__file__).stem,
    doc_md=__doc__,
    schedule=SCHEDULE,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    default_args=DEFAULT_ARGS,
    tags=["kubetrain", "image", "build"],
    params=with_dialect(
        {
            "variant": Param(
                None,
                type=["null", "string"],
                enum=[None, "gpu", "cpu"],
                title="Trainer variant",
                description="gpu: on the TensorFlow GPU base, tagged <tag> and <tag>-gpu; cpu: tagged <tag>-cpu; "
                "empty: the trainer_variant setting.",
            ),
            "mode": Param(
                "auto",
                type="string",
                enum=["auto", "full", "append"],
                title="Mode",
                description="auto: full build when the dependencies changed, else a code layer; full or append: force one.",
            ),
            # a switch always has a value: "null" keeps the trigger form from marking it required
            "force": Param(
                False,
                type=["boolean", "null"],
                title="Force",
                description="Build even when trainer/ is unchanged.",
            ),
        }
    ),
)
def build_trainer_image():
    @task.short_circuit
    def plan(params: dict | None = None, ti=None) -> dict | bool:
        from kubetrain import plan_images

        planned = plan_images(
            TRAINER_DIR,
            registry_conn_id=REGISTRY_CONN_ID,
            variant=params["variant"],  # empty: the trainer_variant setting
            mode=params["mode"],
            force=bool(params["force"]),  # null (allowed, see the Param) is false
        )
        if planned:  # the builds take their arguments as mappings, not as rendered text
            for name in ("trainer", "sync"):
                ti.xcom_push(key=f"{name}_build_args", value=planned[name]["build_args"])
        return planned

    planned = plan()

    @task.branch
    def choose(planned: dict) -> list[str]:
        from kubetrain import image_build_tasks

        return image_build_tasks(planned)

    build_full = BuildImageOperator(
        task_id="build_full",
        context=TRAINER_DIR,
        dockerfile="Dockerfile",
        repository=REPOSITORY,
        tags=[f"{{{{ {PLAN}['trainer']['base_tag'] }}}}"],
        build_args=planned["trainer_build_args"],
        revision=f"{{{{ {PLAN}['trainer']['revision'] or '' }}}}",
        labels={"io.kubetrain.code.sha256": f"{{{{ {PLAN}['trainer']['code_hash'] }}}}"},
        registry_conn_id=REGISTRY_CONN_ID,
        execution_timeout=timedelta(hours=2),
    )
    append_code = AppendLayerOperator(
        task_id="append_code",
        base_image=f"{REPOSITORY}:{{{{ {PLAN}['trainer']['base_tag'] }}}}",
        repository=REPOSITORY,
        source=TRAINER_DIR,
        dest=CODE_DIR,
        labels={"org.opencontainers.image.revision": f"{{{{ {PLAN}['trainer']['revision'] or '' }}}}"},
        registry_conn_id=REGISTRY_CONN_ID,
        execution_timeout=timedelta(minutes=15),
    )
    build_sync = BuildImageOperator(
        task_id="build_sync",
        context=TRAINER_DIR,
        dockerfile="Dockerfile.sync",
        repository=SYNC_REPOSITORY,
        tags=[f"{{{{ {PLAN}['sync']['tag'] }}}}"],
        build_args=planned["sync_build_args"],
        revision=f"{{{{ {PLAN}['trainer']['revision'] or '' }}}}",
        labels={"io.kubetrain.source.sha256": f"{{{{ {PLAN}['sync']['source_hash'] }}}}"},
        registry_conn_id=REGISTRY_CONN_ID,
        execution_timeout=timedelta(minutes=30),
    )

    @task(trigger_rule="none_failed_min_one_success", outlets=[TRAINER_IMAGE, SYNC_IMAGE])
    def publish(planned: dict, ti=None, outlet_events=None) -> dict:
        from kubetrain import publish_images

        built_trainer = ti.xcom_pull(task_ids="build_full") or ti.xcom_pull(task_ids="append_code")
        record = publish_images(
            planned, built_trainer, ti.xcom_pull(task_ids="build_sync"), registry_conn_id=REGISTRY_CONN_ID
        )
        for asset, name in ((TRAINER_IMAGE, "trainer"), (SYNC_IMAGE, "sync")):
            outlet_events[asset].extra = {
                "reference": record[name]["reference"],
                "action": record[name]["action"],
            }
        return record

    chosen = choose(planned)
    published = publish(planned)
    chosen >> [build_full, append_code, build_sync, published]
    [build_full, append_code, build_sync] >> published


build_trainer_image()
