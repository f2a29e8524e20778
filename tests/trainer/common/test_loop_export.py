"""The exported epoch on a tiny real run: the result and the trainer's last line give the best epoch's
figures, not the last epoch's, and metrics.json's ``final`` agrees with the model as exported."""

from __future__ import annotations

import pytest
import trainer_loop_support as tiny

from trainer.common.metrics_doc import describe_exported, metrics_document

pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")


def test_the_last_line_and_metrics_json_describe_the_best_epoch_not_the_last(tmp_path):
    loop = tiny.make_loop(tmp_path, data=tiny.examples(flip_validation=True), epochs=4, log_every_steps=1000)
    result = loop.run()
    best = result.best["epoch"]
    assert result.restored_best and best < len(result.history)  # the data makes an early epoch the best
    exported, last = result.history[best - 1], result.history[-1]
    assert exported["val_loss"] != last["val_loss"]

    line = describe_exported(result)
    assert line == (
        f"exported epoch {best} (step {exported['step']}, the best by val_accuracy): "
        f"val_accuracy {exported['val_accuracy']:.4f} val_loss {exported['val_loss']:.4f}"
    )
    val_loss, val_accuracy = loop.evaluate()  # the model as the trainer exports it
    assert (val_loss, val_accuracy) == pytest.approx(
        (exported["val_loss"], exported["val_accuracy"]), abs=1e-6
    )

    runtime = tiny.default_runtime()
    doc = metrics_document(
        trainer="tiny", task="classification", metric="accuracy", result=result, runtime=runtime
    )
    assert doc["final"]["val_loss"] == exported["val_loss"] and doc["last"]["val_loss"] == last["val_loss"]
    assert doc["exported"] == {"epoch": best, "step": exported["step"], "restored_best": True}
