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
from airflow.sdk import DAG

from kubetrain import DEFAULT_ARGS, common_params, form_order, schedule, training_pipeline, with_dialect
from kubetrain import IMAGE_CLASSIFIER as TRAINER

DATASET = TRAINER.dataset_uri

with DAG(
    dag_id=Path(__file__).stem,
    doc_md=__doc__,
    schedule=schedule(DATASET, "KUBETRAIN_IMAGE_CLASSIFIER_CRON", "0 3 * * 1"),
    catchup=False,
    max_active_runs=1,
    default_args=DEFAULT_ARGS,
    tags=["kubetrain", "training", "image-classification"],
    params=with_dialect(
        form_order({**common_params(dataset_uri=DATASET, model=TRAINER.model), **TRAINER.params()})
    ),
    render_template_as_native_obj=True,
) as dag:
    training_pipeline(
        title=TRAINER.title, cmds=TRAINER.cmds, arguments=TRAINER.arguments, check_params=TRAINER.check_run
    )
