"""
### Train an image classifier

Trains a convolutional image classifier (a small CNN, or MobileNetV2 with weights from the
image) on a dataset of class folders — a zip such as `digits.zip` holding `0/`, `1/`, ...
folders of images — in a training pod on the cluster.

**Steps**: stage the dataset from S3 into an immutable snapshot, skip if this version was
already trained with these Params, train in a GPU pod (the dataset staged into `/data`,
checkpoints synced to S3 while it trains, so a retried pod resumes), write the report
(curves, confusion matrix), promote the model if it beats the promoted one.

**Runs** when triggered from the UI, on the cron schedule in
`KUBETRAIN_IMAGE_CLASSIFIER_CRON` (default: Mondays 03:00 UTC), and when the watch_datasets
DAG sees a new version of the default dataset.

Corrupt or non-image files in the dataset are skipped and counted in the report.
"""

from __future__ import annotations

from pathlib import Path

# The DAG processor imports a DAG file's `airflow.*` modules once, before it forks each parse
# ([dag_processor] parsing_pre_import_modules): naming the pod operator's module keeps the
# cncf-kubernetes provider and the Kubernetes clients loaded across parses.
import airflow.providers.cncf.kubernetes.operators.pod  # noqa: F401
from airflow.sdk import DAG, Param

from kubetrain.pipeline import DEFAULT_ARGS, common_params, form_order, schedule, training_pipeline

DATASET = "s3://datasets/digits/"

with DAG(
    dag_id=Path(__file__).stem,
    doc_md=__doc__,
    schedule=schedule(DATASET, "KUBETRAIN_IMAGE_CLASSIFIER_CRON", "0 3 * * 1"),
    catchup=False,
    max_active_runs=1,
    default_args=DEFAULT_ARGS,
    tags=["kubetrain", "training", "image-classification"],
    params=form_order(
        {
            **common_params(dataset_uri=DATASET, model="image-classifier"),
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
            "batch_size": Param(
                64,
                type="integer",
                minimum=1,
                maximum=4096,
                title="Batch size",
                description="Global batch size.",
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
            "augment": Param(
                False,
                type="boolean",
                title="Augment",
                description="Random shifts, brightness and contrast.",
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
            "mixed_precision": Param(
                False,
                type="boolean",
                title="Mixed precision",
                description="float16 compute on GPUs that support it.",
                section="Training",
            ),
        }
    ),
) as dag:
    training_pipeline(
        title="Image classifier",
        cmds=["python", "-m", "trainer.image_classifier"],
        arguments=[
            "--model={{ params.architecture }}",
            "--epochs={{ params.epochs }}",
            "--batch-size={{ params.batch_size }}",
            "--learning-rate={{ params.learning_rate }}",
            "--image-size={{ params.image_size }}",
            "--validation-split={{ params.validation_split }}",
            "{{ '--augment' if params.augment else '--no-augment' }}",
            "{{ '--mixed-precision' if params.mixed_precision else '--no-mixed-precision' }}",
        ],
    )
