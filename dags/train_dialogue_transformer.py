"""
### Train a dialogue Transformer

Trains an encoder-decoder Transformer chatbot on question/response pairs — TSV, JSONL, or
the raw Cornell Movie-Dialogs files (`movie_lines.txt`, `movie_conversations.txt`) — in a
training pod on the cluster. The tokenizer is built from the data and saved beside the model.

**Resumes by itself**: checkpoints are synced to S3 while it trains; when the pod dies, the
Airflow retry restores the last checkpoint and the step counter and loss curve continue.
There is no restore flag to remember.

**Runs** when triggered from the UI, on the cron schedule in
`KUBETRAIN_DIALOGUE_CRON` (default: none), and when the watch_datasets DAG sees a new
version of the default dataset. The report shows the loss curves and sample replies.
"""

from __future__ import annotations

from pathlib import Path

# The DAG processor imports a DAG file's `airflow.*` modules once, before it forks each parse
# ([dag_processor] parsing_pre_import_modules): naming the pod operator's module keeps the
# cncf-kubernetes provider and the Kubernetes clients loaded across parses.
import airflow.providers.cncf.kubernetes.operators.pod  # noqa: F401
from airflow.sdk import DAG, Param

from kubetrain.pipeline import DEFAULT_ARGS, common_params, form_order, schedule, training_pipeline

DATASET = "s3://datasets/dialogue/"

with DAG(
    dag_id=Path(__file__).stem,
    doc_md=__doc__,
    schedule=schedule(DATASET, "KUBETRAIN_DIALOGUE_CRON", None),
    catchup=False,
    max_active_runs=1,
    default_args=DEFAULT_ARGS,
    tags=["kubetrain", "training", "nlp", "transformer"],
    params=form_order(
        {
            **common_params(dataset_uri=DATASET, model="dialogue-transformer"),
            "epochs": Param(
                20,
                type="integer",
                minimum=1,
                maximum=10000,
                title="Epochs",
                description="Passes over the pairs.",
                section="Training",
            ),
            "max_steps": Param(
                0,
                type="integer",
                minimum=0,
                title="Iterations",
                description="Stop after this many steps (0: run all epochs).",
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
            "sample_every_steps": Param(
                200,
                type="integer",
                minimum=1,
                title="Sample steps",
                description="Log generated replies every N steps.",
                section="Training",
            ),
            "log_every_steps": Param(
                50,
                type="integer",
                minimum=1,
                title="Display steps",
                description="Log the loss every N steps.",
                section="Training",
            ),
            "warmup_steps": Param(
                4000,
                type="integer",
                minimum=1,
                title="Warm-up steps",
                description="Linear learning-rate warm-up.",
                section="Training",
            ),
            "num_layers": Param(
                2,
                type="integer",
                minimum=1,
                maximum=24,
                title="Layers",
                description="Encoder and decoder layers.",
                section="Model",
            ),
            "num_heads": Param(
                4,
                type="integer",
                minimum=1,
                maximum=64,
                title="Heads",
                description="Attention heads; must divide the hidden size.",
                section="Model",
            ),
            "hidden_size": Param(
                128,
                type="integer",
                minimum=8,
                maximum=4096,
                title="Hidden size",
                description="Model width.",
                section="Model",
            ),
            "ff_size": Param(
                512,
                type="integer",
                minimum=8,
                maximum=16384,
                title="Feed-forward size",
                description="Feed-forward width.",
                section="Model",
            ),
            "dropout": Param(
                0.1,
                type="number",
                minimum=0,
                exclusiveMaximum=1,
                title="Dropout",
                description="Dropout rate.",
                section="Model",
            ),
            "max_length": Param(
                24,
                type="integer",
                minimum=4,
                maximum=512,
                title="Max length",
                description="Tokens kept per question and per reply.",
                section="Model",
            ),
            "vocab_size": Param(
                8000,
                type="integer",
                minimum=16,
                maximum=200000,
                title="Vocabulary",
                description="Tokenizer vocabulary size.",
                section="Model",
            ),
        }
    ),
) as dag:
    training_pipeline(
        title="Dialogue Transformer",
        cmds=["python", "-m", "trainer.dialogue"],
        arguments=[
            "--epochs={{ params.epochs }}",
            "{{ '--max-steps=%d' % params.max_steps if params.max_steps else '--epochs=%d' % params.epochs }}",
            "--batch-size={{ params.batch_size }}",
            "--sample-every-steps={{ params.sample_every_steps }}",
            "--log-every-steps={{ params.log_every_steps }}",
            "--warmup-steps={{ params.warmup_steps }}",
            "--num-layers={{ params.num_layers }}",
            "--num-heads={{ params.num_heads }}",
            "--hidden-size={{ params.hidden_size }}",
            "--ff-size={{ params.ff_size }}",
            "--dropout={{ params.dropout }}",
            "--max-input-length={{ params.max_length }}",
            "--max-output-length={{ params.max_length }}",
            "--vocab-size={{ params.vocab_size }}",
        ],
    )
