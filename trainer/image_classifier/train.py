"""Image classifier trainer: ``python -m trainer.image_classifier``.

Reads a directory of class folders from DATA_DIR (the extracted dataset; one top-level
folder holding the class folders is detected and entered), skips and counts files that
are not readable images, splits the rest into seeded, stratified training and validation
sets, and trains a small CNN or a MobileNetV2 (``--model mobilenet_v2``) on a tf.data pipeline
that streams the images' prepared copy (decoded once per dataset version and preprocessing:
trainer.image_classifier.prepare). Writes the pod contract's outputs to OUTPUT_DIR, plus
confusion_matrix.json (rows: true class, columns: predicted class, on the validation set).

Transfer learning uses MobileNetV2 weights only from a local file (``--weights PATH``);
nothing is ever downloaded, and without the flag the network starts from random weights.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainer.common import cli
from trainer.common.cluster import placement, serves_only
from trainer.common.config import parse_config
from trainer.common.contract import (
    DataError,
    RunInfo,
    check_data_dir,
    prepare_dir,
    write_json_atomic,
    write_params,
)
from trainer.common.signals import StopRequest
from trainer.image_classifier.config import ClassifierConfig
from trainer.image_classifier.data import ImagePipeline, split_indices
from trainer.image_classifier.model import build_model, classification_sums, confusion_matrix
from trainer.image_classifier.prepare import decodes, prepare_images

log = logging.getLogger("kubetrain.trainer")

TRAINER = "image_classifier"


def train(config: ClassifierConfig, stop: StopRequest) -> None:
    """Run the whole training job described by ``config``.

    With several workers every worker runs this; only the chief writes CHECKPOINT_DIR and
    OUTPUT_DIR. In parameter-server mode the worker and ps replicas only serve the chief.
    """
    cluster, mode = placement(config.strategy)
    if serves_only(cluster, mode):
        from trainer.common.runtime import serve

        return serve(cluster, stop)
    chief = cluster.is_chief
    data_dir = check_data_dir(config.data_dir)
    prepare_dir(config.checkpoint_dir, "CHECKPOINT_DIR")
    output_dir = prepare_dir(config.output_dir, "OUTPUT_DIR")
    asked = config.hyperparameters()  # params.json records what was asked; configure() resolves the autos
    from trainer.common.runtime import configure

    # the devices first (virtual CPUs, memory growth): preparing the images starts TensorFlow
    runtime = configure(config)
    decoded_before = decodes()
    folder = prepare_images(data_dir, config, Path(config.prepared_dir) if config.prepared_dir else None)
    # What this run's preparation cost: 0 when it found the copy (a retry, a trial, the next run).
    prepared = {"made": folder.made, "decoded": decodes() - decoded_before}
    log.info("images decoded by this run: %d", prepared["decoded"])
    # Indices into folder.files: no per-file Python before the first batch.
    train_index, val_index = split_indices(folder.labels, config.validation_split, config.seed)
    if not len(val_index):
        raise DataError("the validation split is empty: every class has a single image")
    if len(train_index) < config.batch_size:
        raise DataError(
            f"{len(train_index)} training images are fewer than --batch-size {config.batch_size}; "
            "lower --batch-size or add images"
        )
    log.info(
        "split: %d training and %d validation images (seed %d)", len(train_index), len(val_index), config.seed
    )
    run = RunInfo.from_env()
    if chief:
        write_params(output_dir, TRAINER, asked, run, classes=folder.class_names)

    import keras

    from trainer.common.export import export_saved_model, save_keras_model
    from trainer.common.loop import TrainingLoop
    from trainer.common.metrics_doc import describe_exported, metrics_document
    from trainer.image_classifier.serving import add_image_endpoints

    pipeline = ImagePipeline(folder, train_index, val_index, config)
    steps_per_epoch = pipeline.train_count // config.batch_size
    with runtime.strategy.scope():
        model = build_model(config, len(folder.class_names), steps_per_epoch)
        optimizer = keras.optimizers.Adam(config.learning_rate)

    def check_resume(extra: dict[str, Any]) -> None:
        saved = extra.get("classes")
        if saved is not None and saved != folder.class_names:
            raise DataError(
                f"the checkpoint in CHECKPOINT_DIR was trained on classes {saved} but DATA_DIR now "
                f"holds {folder.class_names}; use an empty --checkpoint-dir for a new run"
            )

    loop = TrainingLoop(
        trainer=TRAINER,
        config=config,
        runtime=runtime,
        model=model,
        optimizer=optimizer,
        compute_fn=classification_sums,
        train_dataset_fn=pipeline.train_dataset,
        val_dataset=pipeline.val_dataset(),
        steps_per_epoch=steps_per_epoch,
        global_batch_size=config.batch_size,
        stop=stop,
        extra_state={"classes": folder.class_names},
        check_resume=check_resume,
        dataset_version=run.dataset_version,
    )
    result = loop.run(history_path=output_dir / "history.csv")
    if not chief:
        # The model is exported from the chief's weights; every worker holds the same ones.
        log.info("done: %d steps; the chief writes the outputs", result.steps)
        return

    write_json_atomic(
        output_dir / "confusion_matrix.json",
        {
            "classes": folder.class_names,
            "matrix": confusion_matrix(model, pipeline.val_dataset(), len(folder.class_names)),
            "split": "validation",
            "rows": "true class",
            "columns": "predicted class",
        },
    )
    save_keras_model(model, output_dir)
    export_saved_model(
        model,
        output_dir,
        lambda archive: add_image_endpoints(
            archive, model, folder.class_names, config.image_size, config.channels
        ),
        io_device=runtime.io_device,
        serve_model=False,
    )
    dropped = folder.undecodable
    # The examples that trained and validated: the files TensorFlow decoded.
    train_examples, val_examples = pipeline.train_count, pipeline.val_count
    if dropped:
        root = str(folder.root)
        log.warning(
            "TensorFlow could not decode %d file(s) that Pillow read; they were left out: %s%s",
            len(dropped),
            "; ".join(os.path.relpath(p, root) for p in dropped[:10]),
            " ..." if len(dropped) > 10 else "",
        )
    # metrics.json comes last: its presence tells readers the run's outputs are complete.
    write_json_atomic(
        output_dir / "metrics.json",
        metrics_document(
            trainer=TRAINER,
            task="classification",
            metric="accuracy",
            result=result,
            runtime=runtime,
            config=config,
            runtime_facts=runtime.facts(),
            skipped_files=len(folder.skipped) + len(dropped),
            undecodable_files=len(dropped),
            classes=folder.class_names,
            train_examples=train_examples,
            val_examples=val_examples,
            prepared=prepared,
        ),
    )
    log.info("done: %d steps; %s; outputs in %s", result.steps, describe_exported(result), output_dir)


DESCRIPTION = __doc__.split("\n\n", 1)[1] if __doc__ else ""
EPILOG = """\
data layout:
  DATA_DIR/<class>/<image>   or   DATA_DIR/<one folder>/<class>/<image>
  PNG, JPEG, GIF, BMP and WEBP files are used; anything else is skipped and counted.

outputs (OUTPUT_DIR):
  metrics.json history.csv params.json model.keras saved_model/<version>/ confusion_matrix.json
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, train, and return the exit code."""
    cli.setup_logging()
    config = parse_config(
        ClassifierConfig,
        argv,
        prog="python -m trainer.image_classifier",
        description=DESCRIPTION,
        epilog=EPILOG,
    )
    return cli.run(lambda stop: train(config, stop))


if __name__ == "__main__":
    cli.exit_process(main())
