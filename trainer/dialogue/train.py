"""Dialogue Transformer trainer: ``python -m trainer.dialogue``.

Trains an encoder-decoder Transformer to answer a question with a reply, from
question/response pairs in DATA_DIR: TSV, JSONL, or the raw Cornell Movie-Dialogs files.
Duplicate pairs are removed before the split, and the validation split keeps each
conversation whole (metrics.json's ``split`` shows that the two sides share nothing). A
word tokenizer is built from the training pairs and saved as JSON beside the model and
the checkpoints; a resumed run checks that the data still gives the same one. Learning
rate: the warm-up schedule of "Attention Is All You Need"; gradients are clipped by their
global norm over all devices.
Every --sample-every-steps steps the trainer logs greedy replies to a few validation
questions and keeps the latest in OUTPUT_DIR/samples.json. The SavedModel answers a
question by itself: its generate signature takes text and returns the reply.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from kubetrain_contract.flags import DIALOGUE, TrainerFlags
from trainer.common import cli
from trainer.common.cluster import placement, serves_only
from trainer.common.config import TrainerConfig, parse_config, table_field
from trainer.common.contract import (
    DataError,
    RunInfo,
    check_data_dir,
    prepare_dir,
    write_json_atomic,
    write_params,
)
from trainer.common.signals import StopRequest
from trainer.dialogue.data import load_pairs, make_split
from trainer.dialogue.tokenizer import SPECIALS, WordTokenizer

log = logging.getLogger("kubetrain.trainer")

TRAINER = "dialogue"
TOKENIZER_FILE = "tokenizer.json"
KEEP_SAMPLES = 30
# Warm-up when --warmup-steps is unset: this fraction of the planned optimizer steps. A fixed
# count (the paper's 4,000) never ends in a short run, whose learning rate then stays tiny.
WARMUP_FRACTION = 0.05
# Validation questions answered by the exported model in metrics.json.
FINAL_SAMPLES = 5


# the settings that shape the transformer (build_transformer's arguments besides the vocabulary)
MODEL_SHAPE = (
    "max_input_length",
    "max_output_length",
    "num_layers",
    "num_heads",
    "hidden_size",
    "ff_size",
    "dropout",
)


@dataclass
class DialogueConfig(TrainerConfig):
    """Flags of the dialogue trainer: the common ones and these; bounds and rules are the table's
    (:data:`kubetrain_contract.flags.DIALOGUE`)."""

    FLAGS: ClassVar[TrainerFlags] = DIALOGUE

    batch_size: int = table_field(DIALOGUE, "batch_size")
    validation_split: float = table_field(DIALOGUE, "validation_split")
    monitor: str = table_field(DIALOGUE, "monitor")
    data_format: str = table_field(DIALOGUE, "data_format")
    data_file: str | None = table_field(DIALOGUE, "data_file")
    max_pairs: int | None = table_field(DIALOGUE, "max_pairs")
    vocab_size: int = table_field(DIALOGUE, "vocab_size")
    min_count: int = table_field(DIALOGUE, "min_count")
    lowercase: bool = table_field(DIALOGUE, "lowercase")
    max_input_length: int = table_field(DIALOGUE, "max_input_length")
    max_output_length: int = table_field(DIALOGUE, "max_output_length")
    num_layers: int = table_field(DIALOGUE, "num_layers")
    num_heads: int = table_field(DIALOGUE, "num_heads")
    hidden_size: int = table_field(DIALOGUE, "hidden_size")
    ff_size: int = table_field(DIALOGUE, "ff_size")
    dropout: float = table_field(DIALOGUE, "dropout")
    warmup_steps: int | None = table_field(DIALOGUE, "warmup_steps")
    learning_rate_scale: float = table_field(DIALOGUE, "learning_rate_scale")
    clip_norm: float = table_field(DIALOGUE, "clip_norm")
    sample_every_steps: int = table_field(DIALOGUE, "sample_every_steps")
    num_samples: int = table_field(DIALOGUE, "num_samples")


@dataclass
class Encoded:
    """Token id arrays of a set of pairs, padded with 0."""

    encoder: Any  # (n, max_input_length) int32
    decoder: Any  # (n, max_output_length) int32: <s> + reply
    target: Any  # (n, max_output_length) int32: reply + </s>
    pairs: list[tuple[str, str]]


def encode_pairs(
    pairs: Sequence[tuple[str, str]], tokenizer: WordTokenizer, max_in: int, max_out: int
) -> Encoded:
    """Encode questions for the encoder and replies as decoder inputs and targets."""
    import numpy as np

    n = len(pairs)
    encoder = np.zeros((n, max_in), dtype=np.int32)
    decoder = np.zeros((n, max_out), dtype=np.int32)
    target = np.zeros((n, max_out), dtype=np.int32)
    for i, (question, reply) in enumerate(pairs):
        q = tokenizer.encode(question, max_in)
        r = tokenizer.encode(reply, max_out - 1)
        encoder[i, : len(q)] = q
        decoder[i, : len(r) + 1] = [tokenizer.bos_id, *r]
        target[i, : len(r) + 1] = [*r, tokenizer.eos_id]
    return Encoded(encoder, decoder, target, list(pairs))


def planned_warmup_steps(config: DialogueConfig, steps_per_epoch: int) -> int:
    """--warmup-steps, or when unset WARMUP_FRACTION of the planned optimizer steps (at least 1)."""
    if config.warmup_steps is not None:
        return config.warmup_steps
    planned = config.epochs * steps_per_epoch
    if config.max_steps is not None:
        planned = min(planned, config.max_steps)
    return max(1, round(WARMUP_FRACTION * planned))


def unigram_cross_entropy(train_targets: Any, val_targets: Any, vocab_size: int) -> float:
    """Validation loss, in nats, of an add-one unigram model of the training reply tokens.

    Counted and averaged as ``seq2seq_sums`` counts val_loss: the reply tokens and ``</s>``
    (padding masked out), a mean per reply, then a mean over replies. A model whose val_loss
    is not well under this figure has learnt no more than how often each word occurs.
    """
    import numpy as np

    counts = np.bincount(train_targets[train_targets != 0].ravel(), minlength=vocab_size).astype(np.float64)
    counts[0] = 0.0  # padding is never a target
    log_p = np.log(counts + 1.0) - np.log(counts.sum() + vocab_size)
    mask = val_targets != 0
    tokens = mask.sum(axis=1)
    per_reply = (-log_p[val_targets] * mask).sum(axis=1) / np.maximum(tokens, 1)
    return float(per_reply.mean())


class Sampler:
    """Logs greedy replies to fixed validation questions and keeps the latest ones."""

    def __init__(
        self, decoder: Any, tokenizer: WordTokenizer, data: Encoded, count: int, path: Path | None
    ) -> None:
        self.decoder, self.tokenizer, self.path = decoder, tokenizer, path
        self.inputs = data.encoder[:count]
        self.pairs = data.pairs[:count]
        self.samples: list[dict[str, Any]] = []
        self.last_step: int | None = None

    def __call__(self, step: int) -> None:
        if self.path is None:  # a worker other than the chief: it samples nothing and writes nothing
            self.last_step = step
            return
        replies = self.decoder(self.inputs)
        for (question, reference), ids in zip(self.pairs, replies, strict=True):
            reply = self.tokenizer.decode(ids)
            log.info("sample at step %d: %r -> %r (reference %r)", step, question, reply, reference)
            self.samples.append({"step": step, "input": question, "reply": reply, "reference": reference})
        self.samples = self.samples[-KEEP_SAMPLES:]
        self.last_step = step
        write_json_atomic(self.path, self.samples)


def get_tokenizer(
    config: DialogueConfig, train_pairs: Sequence[tuple[str, str]], checkpoint_dir: Path, save: bool = True
) -> WordTokenizer:
    """The tokenizer of the training pairs; when resuming, it must equal the checkpointed run's.

    Building it again from the same pairs and flags gives the same token ids (ties are
    broken alphabetically), so a tokenizer that differs from the one saved beside the
    checkpoints means that the data or the tokenizer flags changed: the checkpoint's
    embeddings would then read other words, and resuming is refused.

    Raises:
        DataError: the tokenizer differs from the checkpointed run's.
    """
    texts = (text for pair in train_pairs for text in pair)
    tokenizer = WordTokenizer.build(texts, config.vocab_size, config.min_count, config.lowercase)
    if tokenizer.size < 5:
        raise DataError(
            f"the training pairs yield only {tokenizer.size - 4} word(s) with --min-count "
            f"{config.min_count}; nothing to learn"
        )
    saved = checkpoint_dir / TOKENIZER_FILE
    if saved.exists() and (checkpoint_dir / "checkpoint").exists():
        difference = WordTokenizer.load(saved).difference(tokenizer)
        if difference:
            raise DataError(_vocabulary_changed(difference))
        log.info(
            "resuming: the training pairs give the checkpointed run's tokenizer (%d tokens)", tokenizer.size
        )
    else:
        if save:  # the chief's copy; the other workers build the same one and write nothing
            tokenizer.save(saved)
        log.info("tokenizer built from the training pairs: %d tokens", tokenizer.size)
    return tokenizer


def _vocabulary_changed(difference: str) -> str:
    return (
        f"the checkpoint in CHECKPOINT_DIR was trained with another vocabulary than the training pairs give "
        f"now ({difference}): the data, --vocab-size, --min-count or --lowercase changed since, and its "
        "embeddings would read other words; use an empty --checkpoint-dir to start a new run"
    )


def train(config: DialogueConfig, stop: StopRequest) -> None:
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
    checkpoint_dir = prepare_dir(config.checkpoint_dir, "CHECKPOINT_DIR")
    output_dir = prepare_dir(config.output_dir, "OUTPUT_DIR")
    data = load_pairs(data_dir, config.data_format, config.data_file, config.max_pairs)
    if len(data.pairs) < 2:
        raise DataError(
            f"only {len(data.pairs)} question/response pair found; training and validation need at least two"
        )
    # Two pairs that give the model the same tokens are one pair: kept twice, one copy could
    # validate on the other.
    words = WordTokenizer(SPECIALS, config.lowercase)
    split = make_split(
        data.pairs,
        config.validation_split,
        config.seed,
        data.groups,
        key=lambda pair: (tuple(words.split(pair[0])), tuple(words.split(pair[1]))),
    )
    train_pairs, val_pairs = split.train, split.val
    if len(train_pairs) < config.batch_size:
        raise DataError(
            f"{len(train_pairs)} training pairs are fewer than --batch-size {config.batch_size}; "
            "lower --batch-size or add data"
        )
    report = split.report()
    log.info(
        "split: %d training and %d validation pairs from %d and %d conversation(s) (seed %d); %d duplicate "
        "pair(s) removed; %d validation pair(s) and %d conversation(s) also in training",
        len(train_pairs),
        len(val_pairs),
        report["train_groups"],
        report["val_groups"],
        config.seed,
        split.duplicates_removed,
        report["val_pairs_in_train"],
        report["groups_in_both"],
    )
    tokenizer = get_tokenizer(config, train_pairs, checkpoint_dir, save=chief)
    run = RunInfo.from_env()
    if chief:
        tokenizer.save(output_dir / TOKENIZER_FILE)
        write_params(output_dir, TRAINER, config.hyperparameters(), run, sources=data.sources)

    import keras
    import numpy as np
    import tensorflow as tf

    from trainer.common.export import export_saved_model, save_keras_model
    from trainer.common.loop import TrainingLoop
    from trainer.common.metrics_doc import describe_exported, metrics_document
    from trainer.common.runtime import configure
    from trainer.dialogue.model import GreedyDecoder, WarmupSchedule, build_transformer, seq2seq_sums
    from trainer.dialogue.serving import add_generate_endpoint

    runtime = configure(config)
    train_data = encode_pairs(train_pairs, tokenizer, config.max_input_length, config.max_output_length)
    val_data = encode_pairs(val_pairs, tokenizer, config.max_input_length, config.max_output_length)
    batch = config.batch_size
    steps_per_epoch = len(train_pairs) // batch
    warmup_steps = planned_warmup_steps(config, steps_per_epoch)
    baseline = unigram_cross_entropy(train_data.target, val_data.target, tokenizer.size)
    log.info(
        "learning-rate warm-up: %d steps%s; unigram baseline (add-one word frequencies) val_loss %.4f",
        warmup_steps,
        "" if config.warmup_steps is not None else f" ({WARMUP_FRACTION:.0%} of the planned steps)",
        baseline,
    )

    def train_dataset(epoch: int, skip_batches: int) -> tf.data.Dataset:
        # The epoch's order is a pure function of (seed, epoch), so skipping the consumed
        # batches after a resume lands exactly where training stopped.
        order = np.random.default_rng([config.seed, epoch]).permutation(len(train_pairs))
        index = order[skip_batches * batch : steps_per_epoch * batch]
        ds = tf.data.Dataset.from_tensor_slices(
            (
                {"encoder_tokens": train_data.encoder[index], "decoder_tokens": train_data.decoder[index]},
                train_data.target[index],
            )
        )
        return ds.batch(batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE)

    val_dataset = (
        tf.data.Dataset.from_tensor_slices(
            (
                {"encoder_tokens": val_data.encoder, "decoder_tokens": val_data.decoder},
                val_data.target,
            )
        )
        .batch(batch)
        .prefetch(tf.data.AUTOTUNE)
    )

    with runtime.strategy.scope():
        shape = {name: getattr(config, name) for name in MODEL_SHAPE}
        model = build_transformer(vocab_size=tokenizer.size, **shape)
        schedule = WarmupSchedule(config.hidden_size, warmup_steps, config.learning_rate_scale)
        # The training loop applies global_clipnorm to the all-replica gradient, after
        # loss-scale unscaling.
        optimizer = keras.optimizers.Adam(
            schedule, beta_1=0.9, beta_2=0.98, epsilon=1e-9, global_clipnorm=config.clip_norm
        )
    log.info("transformer: %d parameters", model.count_params())

    sampler = Sampler(
        GreedyDecoder(model, config.max_output_length, tokenizer.bos_id, tokenizer.eos_id),
        tokenizer,
        val_data,
        config.num_samples,
        output_dir / "samples.json" if chief else None,
    )

    def check_resume(extra: dict[str, Any]) -> None:
        # tokenizer.json may be missing or replaced: the fingerprint in the checkpoint decides.
        saved = extra.get("vocabulary_fingerprint")
        if saved is not None and saved != tokenizer.fingerprint():
            raise DataError(
                _vocabulary_changed(
                    f"{extra.get('vocabulary_size')} vs {tokenizer.size} tokens, fingerprint {saved[:12]} vs "
                    f"{tokenizer.fingerprint()[:12]}"
                )
            )
        size = extra.get("vocabulary_size")
        if size is not None and size != tokenizer.size:
            raise DataError(_vocabulary_changed(f"{size} vs {tokenizer.size} tokens"))

    loop = TrainingLoop(
        trainer=TRAINER,
        config=config,
        runtime=runtime,
        model=model,
        optimizer=optimizer,
        compute_fn=seq2seq_sums,
        train_dataset_fn=train_dataset,
        val_dataset=val_dataset,
        steps_per_epoch=steps_per_epoch,
        global_batch_size=batch,
        stop=stop,
        extra_state={"vocabulary_size": tokenizer.size, "vocabulary_fingerprint": tokenizer.fingerprint()},
        check_resume=check_resume,
        on_step=sampler,
        on_step_every=config.sample_every_steps,
        dataset_version=run.dataset_version,
    )
    result = loop.run(history_path=output_dir / "history.csv")
    if not chief:
        log.info("done: %d steps; the chief writes the outputs", result.steps)
        return
    if sampler.last_step != result.steps:
        sampler(result.steps)
    # The exported weights (the best epoch's with --restore-best) answer held-out questions.
    replies = sampler.decoder(val_data.encoder[:FINAL_SAMPLES])
    val_samples = [
        {"input": question, "reply": tokenizer.decode(ids), "reference": reference}
        for (question, reference), ids in zip(val_data.pairs[:FINAL_SAMPLES], replies, strict=True)
    ]
    save_keras_model(model, output_dir)
    export_saved_model(
        model,
        output_dir,
        lambda archive: add_generate_endpoint(
            archive, model, tokenizer, config.max_input_length, config.max_output_length
        ),
        io_device=runtime.io_device,
    )
    write_json_atomic(
        output_dir / "metrics.json",
        metrics_document(
            trainer=TRAINER,
            task="seq2seq",
            metric="accuracy",
            result=result,
            runtime=runtime,
            config=config,
            runtime_facts=runtime.facts(),
            skipped_files=0,
            skipped_records=data.skipped,
            train_examples=len(train_pairs),
            val_examples=len(val_pairs),
            vocabulary_size=tokenizer.size,
            split=report,
            warmup_steps=warmup_steps,
            unigram_val_loss=round(baseline, 6),
            val_samples=val_samples,
        ),
    )
    log.info(
        "done: %d steps; %s (unigram baseline val_loss %.4f); outputs in %s",
        result.steps,
        describe_exported(result),
        baseline,
        output_dir,
    )


DESCRIPTION = __doc__.split("\n\n", 1)[1] if __doc__ else ""
EPILOG = """\
data (DATA_DIR, searched recursively unless --data-file is given):
  *.tsv    question<TAB>response per line (UTF-8); a header line question<TAB>response<TAB>conversation
           adds a conversation id column, and the split keeps each conversation on one side
  *.jsonl  {"question": ..., "response": ..., "conversation": ...} per line (also input/prompt,
           reply/answer, conversation_id/dialogue_id; the conversation is optional)
  movie_lines.txt + movie_conversations.txt   the Cornell Movie-Dialogs corpus (Latin-1)

outputs (OUTPUT_DIR):
  metrics.json history.csv params.json model.keras saved_model/<version>/ tokenizer.json samples.json
  (accuracy is next-token accuracy over non-padding reply tokens; metrics.json's unigram_val_loss is
  the val_loss of add-one word frequencies, and val_samples the exported model's replies to five
  validation questions)
  saved_model/<version>/ (a new, higher version at each export) has two signatures: serve (token ids
  -> next-token logits) and generate (text -> reply: tokenizer, greedy decoding and detokenizer in the
  graph)
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, train, and return the exit code."""
    cli.setup_logging()
    config = parse_config(
        DialogueConfig, argv, prog="python -m trainer.dialogue", description=DESCRIPTION, epilog=EPILOG
    )
    return cli.run(lambda stop: train(config, stop))


if __name__ == "__main__":
    cli.exit_process(main())
