"""
### Train an image classifier on several workers

The image classifier of `train_image_classifier`, trained by several pods at once: with
**MultiWorkerMirroredStrategy** (every worker computes the gradient of its share of each global
batch; one all-reduce per step), or with **parameter servers** when *Parameter servers* > 0.

The job runs on an engine the cluster already has (*Backend*): a Kubeflow **TFJob**, a Kubeflow
Trainer **TrainJob**, or one **Indexed Job** per role behind a headless Service, which needs no
operator; *auto* takes the first of these the cluster serves. Every replica stages the dataset in;
only the chief (worker 0) writes and syncs checkpoints, and every replica of a restarted job resumes
from the chief's newest checkpoint, so a killed worker costs at most one checkpoint interval.

**Steps** as in `train_image_classifier`: stage the dataset, skip if already trained, train (here:
the multi-worker job), report (it names the workers), promote if better, record.

*Batch size* is the global batch: each of the N workers computes batch/N examples per step, so the
learning rate needs no change when N changes (trainer/README.md, "Several workers").
"""

from __future__ import annotations

from pathlib import Path

# Pre-imported by the DAG processor once ([dag_processor] parsing_pre_import_modules).
import airflow.providers.cncf.kubernetes.operators.pod  # noqa: F401
from airflow.sdk import DAG, Param

from kubetrain import (
    CPU_PATTERN,
    DEFAULT_ARGS,
    IMAGE_CLASSIFIER,
    MEMORY_PATTERN,
    DistributedTrainingOperator,
    common_params,
    schedule,
    training_pipeline,
    with_dialect,
)

# Max steps bound a run of many workers; the checkpoint interval is what a dead worker costs.
TRAINER = IMAGE_CLASSIFIER.extended("max_steps", "checkpoint_every_steps")
DATASET = TRAINER.dataset_uri

with DAG(
    dag_id=Path(__file__).stem,
    doc_md=__doc__,
    schedule=schedule(DATASET, "KUBETRAIN_IMAGE_CLASSIFIER_DISTRIBUTED_CRON", None),
    catchup=False,
    max_active_runs=1,
    default_args=DEFAULT_ARGS,
    tags=["kubetrain", "training", "image-classification", "distributed"],
    params=with_dialect(
        {
            **common_params(dataset_uri=DATASET, model=TRAINER.model, gpus=1),
            "backend": Param(
                "auto",
                type="string",
                enum=["auto", "tfjob", "trainjob", "indexed_job"],
                title="Backend",
                description="Engine that runs the replicas: auto (the first the cluster serves of TFJob, TrainJob and "
                "Indexed Job), a Kubeflow TFJob, a Kubeflow Trainer TrainJob, or Indexed Jobs with a headless Service.",
                section="Distributed",
            ),
            "workers": Param(
                2,
                type="integer",
                minimum=1,
                maximum=64,
                title="Workers",
                description="Training replicas, each with the GPUs, CPU and memory of Resources (the chief is the first).",
                section="Distributed",
            ),
            "ps_replicas": Param(
                0,
                type="integer",
                minimum=0,
                maximum=16,
                title="Parameter servers",
                description="0: MultiWorkerMirroredStrategy. More: parameter-server training, a chief coordinating the "
                "workers and this many ps replicas holding the variables.",
                section="Distributed",
            ),
            "gpus_per_ps": Param(
                0,
                type="integer",
                minimum=0,
                maximum=8,
                title="GPUs per parameter server",
                description="Parameter servers move variables; they rarely need a GPU.",
                section="Distributed",
            ),
            "ps_cpu": Param(
                "1",
                type="string",
                pattern=CPU_PATTERN,
                title="CPU per parameter server",
                description="CPU request and limit of each ps replica.",
                section="Distributed",
            ),
            "ps_memory": Param(
                "2Gi",
                type="string",
                pattern=MEMORY_PATTERN,
                title="Memory per parameter server",
                description="Memory of each ps replica.",
                section="Distributed",
            ),
            "chief_cpu": Param(
                None,
                type=["null", "string"],
                pattern=CPU_PATTERN,
                title="CPU of the chief (parameter servers)",
                description="With parameter servers the chief only coordinates: its CPU request and limit (empty: the "
                "workers' CPU).",
                section="Distributed",
            ),
            "chief_memory": Param(
                None,
                type=["null", "string"],
                pattern=MEMORY_PATTERN,
                title="Memory of the chief (parameter servers)",
                description="With parameter servers, the chief's memory (empty: the workers' memory).",
                section="Distributed",
            ),
            # the image classifier's training Params, and two that several workers need (its flag table's)
            **TRAINER.params(),
        }
    ),
    render_template_as_native_obj=True,
) as dag:
    training_pipeline(
        title="Image classifier (distributed)",
        train_operator=DistributedTrainingOperator,
        backend="{{ params.backend }}",
        workers="{{ params.workers }}",
        ps_replicas="{{ params.ps_replicas }}",
        gpus_per_ps="{{ params.gpus_per_ps }}",
        ps_cpu="{{ params.ps_cpu }}",
        ps_memory="{{ params.ps_memory }}",
        chief_cpu="{{ params.chief_cpu or '' }}",
        chief_memory="{{ params.chief_memory or '' }}",
        cmds=list(TRAINER.cmds),
        arguments=["--strategy=auto", *TRAINER.arguments],
        check_params=TRAINER.check_run,
    )
