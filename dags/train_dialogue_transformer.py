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
from airflow.sdk import DAG

from kubetrain import DEFAULT_ARGS, common_params, form_order, schedule, training_pipeline, with_dialect
from kubetrain import DIALOGUE_TRANSFORMER as TRAINER

DATASET = TRAINER.dataset_uri

with DAG(
    dag_id=Path(__file__).stem,
    doc_md=__doc__,
    schedule=schedule(DATASET, "KUBETRAIN_DIALOGUE_CRON", None),
    catchup=False,
    max_active_runs=1,
    default_args=DEFAULT_ARGS,
    tags=["kubetrain", "training", "nlp", "transformer"],
    params=with_dialect(
        form_order({**common_params(dataset_uri=DATASET, model=TRAINER.model), **TRAINER.params()})
    ),
    render_template_as_native_obj=True,
) as dag:
    training_pipeline(
        title=TRAINER.title, cmds=TRAINER.cmds, arguments=TRAINER.arguments, check_params=TRAINER.check_run
    )
