"""
### Example: your own Keras script, trained by kubetrain

The DAG of docs/extending.md in kubetrain's repository: a Keras script of your own
(`docs/examples/keras_model/train.py`) in an image of your own, trained on the cluster with
kubetrain's shared pipeline: stage the dataset, skip data already trained on, train (the data
in `/data`, checkpoints synced to S3 and restored on a retry), report, promote if better.

**Runs** when a new version of its dataset lands (the watch_datasets DAG announces it), and on
the cron schedule in `KUBETRAIN_KERAS_EXAMPLE_CRON` when that is set.
"""

from __future__ import annotations

from pathlib import Path

import airflow.providers.cncf.kubernetes.operators.pod  # noqa: F401  (the DAG processor pre-imports it once)
from airflow.sdk import DAG, Param

from kubetrain import DEFAULT_ARGS, common_params, schedule, training_pipeline

DATASET = "s3://datasets/keras-digits/"
IMAGE = "localhost:5000/examples/keras-model:1"  # your image: the script and its libraries

with DAG(
    dag_id=Path(__file__).stem,
    doc_md=__doc__,
    schedule=schedule(DATASET, "KUBETRAIN_KERAS_EXAMPLE_CRON", None),
    catchup=False,
    max_active_runs=1,
    default_args=DEFAULT_ARGS,
    tags=["kubetrain", "training", "example"],
    params=common_params(
        dataset_uri=DATASET,
        model="keras-digits",
        image=Param(IMAGE, type="string", title="Training image", section="Model"),
        epochs=Param(3, type="integer", minimum=1, title="Epochs", section="Training"),
        learning_rate=Param(
            0.001, type="number", exclusiveMinimum=0, title="Learning rate", section="Training"
        ),
    ),
    render_template_as_native_obj=True,
) as dag:
    training_pipeline(
        title="Keras digits",
        cmds=["python", "train.py"],
        arguments=["--epochs={{ params.epochs }}", "--learning-rate={{ params.learning_rate }}"],
    )
