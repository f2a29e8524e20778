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

from kubetrain.operators.distributed import DistributedTrainingOperator
from kubetrain.pipeline import DEFAULT_ARGS, common_params, schedule, training_pipeline

DATASET = "s3://datasets/digits/"

with DAG(
    dag_id=Path(__file__).stem,
    doc_md=__doc__,
    schedule=schedule(DATASET, "KUBETRAIN_IMAGE_CLASSIFIER_DISTRIBUTED_CRON", None),
    catchup=False,
    max_active_runs=1,
    default_args=DEFAULT_ARGS,
    tags=["kubetrain", "training", "image-classification", "distributed"],
    params={
        **common_params(dataset_uri=DATASET, model="image-classifier", gpus=1),
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
            pattern=r"^[0-9]+(\.[0-9]+)?m?$",
            title="CPU per parameter server",
            description="CPU request and limit of each ps replica.",
            section="Distributed",
        ),
        "ps_memory": Param(
            "2Gi",
            type="string",
            pattern=r"^[0-9]+(Ki|Mi|Gi|Ti|k|M|G|T)?$",
            title="Memory per parameter server",
            description="Memory of each ps replica.",
            section="Distributed",
        ),
        "chief_cpu": Param(
            None,
            type=["null", "string"],
            pattern=r"^[0-9]+(\.[0-9]+)?m?$",
            title="CPU of the chief (parameter servers)",
            description="With parameter servers the chief only coordinates: its CPU request and limit (empty: the "
            "workers' CPU).",
            section="Distributed",
        ),
        "chief_memory": Param(
            None,
            type=["null", "string"],
            pattern=r"^[0-9]+(Ki|Mi|Gi|Ti|k|M|G|T)?$",
            title="Memory of the chief (parameter servers)",
            description="With parameter servers, the chief's memory (empty: the workers' memory).",
            section="Distributed",
        ),
        "architecture": Param(
            "cnn",
            type="string",
            enum=["cnn", "mobilenet_v2"],
            title="Architecture",
            description="A small CNN, or MobileNetV2 (ImageNet weights only if the image ships them).",
            section="Model",
        ),
        "epochs": Param(
            5,
            type="integer",
            minimum=1,
            maximum=1000,
            title="Epochs",
            description="Passes over the training split.",
            section="Training",
        ),
        "max_steps": Param(
            None,
            type=["null", "integer"],
            minimum=1,
            title="Max steps",
            description="Stop after this many steps in total (empty: the epochs decide).",
            section="Training",
        ),
        "batch_size": Param(
            64,
            type="integer",
            minimum=1,
            maximum=4096,
            title="Batch size",
            description="Global batch size, split evenly over the workers (a multiple of their number).",
            section="Training",
        ),
        "learning_rate": Param(
            0.001,
            type="number",
            exclusiveMinimum=0,
            maximum=1,
            title="Learning rate",
            description="Adam learning rate.",
            section="Training",
        ),
        "image_size": Param(
            64,
            type="integer",
            minimum=16,
            maximum=512,
            title="Image size",
            description="Images are resized to SIZE x SIZE pixels.",
            section="Model",
        ),
        "checkpoint_every_steps": Param(
            100,
            type="integer",
            minimum=0,
            maximum=100000,
            title="Checkpoint every N steps",
            description="The chief's checkpoint interval: at most this many steps are lost when a worker dies.",
            section="Training",
        ),
        "validation_split": Param(
            0.2,
            type="number",
            exclusiveMinimum=0,
            exclusiveMaximum=1,
            title="Validation split",
            description="Fraction held out for validation (seeded split).",
            section="Training",
        ),
    },
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
        cmds=["python", "-m", "trainer.image_classifier"],
        arguments=[
            "--strategy=auto",
            "--model={{ params.architecture }}",
            "--epochs={{ params.epochs }}",
            "{{ '--max-steps=%d' % params.max_steps if params.max_steps else '--epochs=%d' % params.epochs }}",
            "--batch-size={{ params.batch_size }}",
            "--learning-rate={{ params.learning_rate }}",
            "--image-size={{ params.image_size }}",
            "--checkpoint-every-steps={{ params.checkpoint_every_steps }}",
            "--validation-split={{ params.validation_split }}",
        ],
    )
