"""KUBETRAIN_STOP_FILE: a sweep's sidecar stops a trial; the loop ends as an early stop and the process exits 79."""

from __future__ import annotations

import json

import trainer_loop_support as tiny

from trainer.common import cli
from trainer.common.contract import EXIT_STOPPED
from trainer.common.signals import StopRequest


def test_the_stop_file_ends_the_run_with_the_best_epoch_exported(tmp_path):
    stop_file = tmp_path / ".kubetrain-stop"
    request = {"rule": "median", "step": 2}

    def on_batch(epoch: int, batch: int) -> None:
        if epoch == 2 and batch == 3:  # the sidecar decides during the third epoch
            stop_file.write_text(json.dumps(request))

    loop = tiny.make_loop(tmp_path, stop=StopRequest(stop_file), on_batch=on_batch, epochs=10)
    result = loop.run(history_path=tmp_path / "history.csv")
    assert result.stopped_early["by"] == "stop file" and result.stopped_early["request"] == request
    assert 2 * tiny.STEPS_PER_EPOCH < result.steps < 3 * tiny.STEPS_PER_EPOCH + 4 < 10 * tiny.STEPS_PER_EPOCH
    # the partial third epoch is closed, and the export is the best epoch's
    assert len(result.history) == 3 and result.history[-1]["partial"]
    assert result.exported["epoch"] == result.best["epoch"]
    state = json.loads((tmp_path / "ckpt" / "trainer_state.json").read_text())
    assert state["stopped_early"]["by"] == "stop file" and state["step"] == result.steps
    # a retried pod (the stop file is gone with its volume) does not train again
    again = tiny.make_loop(tmp_path, epochs=10).run()
    assert again.steps == result.steps


def test_the_process_exits_79_when_stopped_by_the_file(tmp_path, monkeypatch):
    stop_file = tmp_path / "stop"
    monkeypatch.setenv("KUBETRAIN_STOP_FILE", str(stop_file))

    def train(stop: StopRequest) -> None:
        stop_file.write_text("{}")
        assert stop.stop_file_request() == {}

    assert cli.run(train) == EXIT_STOPPED
    stop_file.unlink()
    assert cli.run(lambda stop: None) == 0
