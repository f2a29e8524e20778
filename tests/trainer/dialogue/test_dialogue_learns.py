"""The dialogue trainer learns the demo corpus: well under the unigram baseline, and it answers."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from include.sample_data import dialogue as dialogue_data
from trainer.dialogue import train as dialogue_train

# The demo's model, smaller: a few minutes on a busy 2-core CPU.
SMALL = [
    "--num-layers",
    "2",
    "--num-heads",
    "4",
    "--hidden-size",
    "64",
    "--ff-size",
    "128",
    "--max-input-length",
    "12",
    "--max-output-length",
    "12",
]


def test_unigram_baseline_counts_what_val_loss_counts():
    # Training targets: token 4 three times, 5 once, </s> (3) twice; vocabulary of 6.
    train = np.array([[4, 4, 3, 0], [4, 5, 3, 0]])
    val = np.array([[4, 3, 0, 0], [5, 5, 5, 3]])
    p = {4: 4 / 12, 5: 2 / 12, 3: 3 / 12}  # (count + 1) / (6 targets + 6)
    per_reply = [-(np.log(p[4]) + np.log(p[3])) / 2, -(3 * np.log(p[5]) + np.log(p[3])) / 4]
    assert dialogue_train.unigram_cross_entropy(train, val, 6) == pytest.approx(np.mean(per_reply))


@pytest.mark.parametrize(
    ("flags", "warmup"),
    [({}, 15), ({"max_steps": 40}, 2), ({"max_steps": 5}, 1), ({"warmup_steps": 7}, 7)],
)
def test_warmup_defaults_to_a_twentieth_of_the_planned_steps(flags, warmup):
    dirs = {"data_dir": "d", "checkpoint_dir": "c", "output_dir": "o"}
    config = dialogue_train.DialogueConfig(**dirs, epochs=3, **flags)
    assert config.monitor == "val_loss"
    assert dialogue_train.planned_warmup_steps(config, steps_per_epoch=100) == warmup
    with pytest.raises(ValueError, match="--warmup-steps must be an integer >= 1"):
        dialogue_train.DialogueConfig(**dirs, warmup_steps=0)


@pytest.mark.slow
def test_the_demo_corpus_is_learnt_beyond_word_frequencies(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    data = tmp_path / "data"
    assert dialogue_data.main(["--out", str(data / "pairs.tsv")]) == 0
    out = tmp_path / "out"
    args = ["--data-dir", str(data), "--checkpoint-dir", str(tmp_path / "ckpt"), "--output-dir", str(out)]
    flags = ["--batch-size", "64", "--epochs", "3", "--checkpoint-every-steps", "0", "--no-tensorboard"]
    assert dialogue_train.main([*args, *SMALL, *flags, "--sample-every-steps", "1000"]) == 0, caplog.text[
        -3000:
    ]

    metrics = json.loads((out / "metrics.json").read_text())
    baseline, final = metrics["unigram_val_loss"], metrics["final"]
    assert metrics["monitor"] == "val_loss" and metrics["warmup_steps"] >= 1
    assert final["val_loss"] <= baseline - 1.0, (final, baseline)
    samples = metrics["val_samples"]
    assert len(samples) == 5 and all(s["input"] and s["reference"] and s["reply"].strip() for s in samples)
    # The last line names the exported epoch's figures, not the last epoch's.
    done = [r.getMessage() for r in caplog.records if r.getMessage().startswith("done:")][-1]
    exported = metrics["exported"]
    assert f"exported epoch {exported['epoch']} (step {exported['step']}," in done
    assert (
        f"val_loss {final['val_loss']:.4f}" in done and f"(unigram baseline val_loss {baseline:.4f})" in done
    )
