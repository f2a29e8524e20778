"""The dialogue trainer: pair readers (Cornell, TSV, JSONL), tokenizer, a real short run, refusals."""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from include.sample_data import dialogue as dialogue_data
from trainer.common.contract import EXIT_DATAERR, EXIT_USAGE, UsageError
from trainer.common.export import latest_saved_model
from trainer.dialogue import train as dialogue_train
from trainer.dialogue.data import load_pairs, read_cornell, read_jsonl, read_tsv
from trainer.dialogue.tokenizer import WordTokenizer

REPO = Path(__file__).resolve().parents[3]
CORNELL = Path(__file__).parent / "fixtures" / "cornell"
TINY = [
    "--num-layers",
    "1",
    "--num-heads",
    "2",
    "--hidden-size",
    "32",
    "--ff-size",
    "64",
    "--max-input-length",
    "12",
    "--max-output-length",
    "12",
    "--warmup-steps",
    "30",
]
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")


def test_cornell_parser_pairs_consecutive_lines_and_counts_bad_records():
    parsed = read_cornell(CORNELL)
    assert parsed.pairs[:3] == [
        ("Did you lock the lighthouse door?", "Twice. The wind opens it anyway."),
        ("Twice. The wind opens it anyway.", "Then we sleep in shifts tonight."),
        ("Then we sleep in shifts tonight.", "I'll take the first watch."),
    ]
    # Latin-1 bytes decode to the intended characters.
    assert ("Is the café still open?", "Only for the regulars, señora.") in parsed.pairs
    assert len(parsed.pairs) == 12
    assert not any("map" in q or "Answer" in r for q, r in parsed.pairs)  # the empty line breaks both pairs
    assert parsed.pairs[-1] == ("Return or single?", "Single. I am not coming back.")
    # one line without separators, two pairs around an empty line, one unknown line id,
    # one conversation line with three fields
    assert parsed.skipped == 5


def test_cornell_files_are_found_in_a_nested_folder(tmp_path):
    shutil.copytree(CORNELL, tmp_path / "cornell movie-dialogs corpus")
    (tmp_path / "README.txt").write_text("about the corpus\n")
    loaded = load_pairs(tmp_path)
    assert len(loaded.pairs) == 12 and loaded.skipped == 5
    assert loaded.sources == [
        "cornell movie-dialogs corpus/movie_lines.txt",
        "cornell movie-dialogs corpus/movie_conversations.txt",
    ]


def test_tsv_and_jsonl_readers(tmp_path):
    tsv = tmp_path / "pairs.tsv"
    tsv.write_text(
        "question\tresponse\nhello there\thi!\nno tab on this line\n\na\tb\tc\n  spaced   out \t ok \n",
        encoding="utf-8",
    )
    parsed = read_tsv(tsv)
    assert parsed.pairs == [("hello there", "hi!"), ("spaced out", "ok")] and parsed.skipped == 2
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text(
        "\n".join(
            [
                json.dumps({"question": "how are you?", "response": "fine"}),
                json.dumps({"input": "and you?", "reply": "also fine"}),
                "{not json",
                json.dumps({"question": "missing reply"}),
                json.dumps(["a", "list"]),
            ]
        )
        + "\n",
        encoding="utf-8",
    )
    parsed = read_jsonl(jsonl)
    assert parsed.pairs == [("how are you?", "fine"), ("and you?", "also fine")] and parsed.skipped == 3


def test_tokenizer_is_deterministic_and_round_trips_through_json(tmp_path):
    texts = ["Hello, world!", "hello again", "The world is round.", "hello"]
    tok = WordTokenizer.build(texts, vocab_size=8)
    assert tok.vocabulary == ["<pad>", "<unk>", "<s>", "</s>", "hello", "world", "!", ","]
    assert tok.encode("Hello, moon!") == [4, 7, 1, 6]
    assert tok.decode([4, 7, 5, 6, 3, 4]) == "hello, world!"
    path = tok.save(tmp_path / "tokenizer.json")
    doc = json.loads(path.read_text())
    assert doc["kind"] == "kubetrain/word-tokenizer" and doc["format_version"] == 1
    again = WordTokenizer.load(path)
    assert again.vocabulary == tok.vocabulary and again.encode("round world") == tok.encode("round world")
    path.write_text(json.dumps({**doc, "format_version": 9}))
    with pytest.raises(UsageError, match="tokenizer format_version 9 is not understood; expected 1"):
        WordTokenizer.load(path)


@pytest.mark.slow
def test_trains_on_the_generated_pairs_and_writes_the_contract_files(tmp_path):
    data = tmp_path / "data"
    dialogue_data.main(["--out", str(data / "pairs.tsv")])
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("DATA_DIR", "CHECKPOINT_DIR", "OUTPUT_DIR")}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", KUBETRAIN_DATASET_VERSION="00aa11bb22cc33dd")
    args = [
        "--data-dir",
        str(data),
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--output-dir",
        str(out),
        *TINY,
        "--batch-size",
        "32",
        "--vocab-size",
        "200",
        "--max-pairs",
        "1100",
        "--max-steps",
        "70",
        "--sample-every-steps",
        "20",
        "--num-samples",
        "2",
        "--checkpoint-every-steps",
        "20",
        "--log-every-steps",
        "5",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.dialogue", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sample at step 20:" in proc.stderr and "sample at step 40:" in proc.stderr

    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["trainer"] == "dialogue" and metrics["task"] == "seq2seq"
    assert metrics["steps"] == 70 and metrics["vocabulary_size"] == 200
    # Uniform guessing over the vocabulary costs ln(200) = 5.3 nats per token.
    assert metrics["final"]["val_loss"] < 0.7 * math.log(200), metrics["final"]
    assert 0.0 < metrics["final"]["val_accuracy"] <= 1.0

    with open(out / "history.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows[0]["step"] == str(
        metrics["train_examples"] // 32
    )  # 30 steps: two full epochs, then a partial one
    assert [r["epoch"] for r in rows] == ["1", "2", "3"] and rows[-1]["step"] == "70"
    # The sample data names each pair's conversation: neither a pair nor a conversation is on
    # both sides of the split.
    split = metrics["split"]
    assert split["pairs_read"] == 1100 and split["duplicates_removed"] < 0.05 * split["pairs_read"]
    assert split["train_pairs"] == metrics["train_examples"] and split["val_pairs"] == metrics["val_examples"]
    assert split["val_pairs_in_train"] == 0 and split["groups_in_both"] == 0
    assert 0 < float(rows[0]["learning_rate"]) < 1

    samples = json.loads((out / "samples.json").read_text())
    assert [s["step"] for s in samples] == [20, 20, 40, 40, 60, 60, 70, 70]
    assert all(
        set(s) == {"step", "input", "reply", "reference"} and s["input"] and s["reference"] for s in samples
    )

    tokenizer = WordTokenizer.load(out / "tokenizer.json")
    assert (
        tokenizer.size == 200
        and (tmp_path / "ckpt" / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()
    )
    params = json.loads((out / "params.json").read_text())
    assert params["dataset_version"] == "00aa11bb22cc33dd" and params["sources"] == ["pairs.tsv"]
    assert params["hyperparameters"]["hidden_size"] == 32 and params["hyperparameters"]["warmup_steps"] == 30

    import keras
    import numpy as np

    import trainer.dialogue.model  # noqa: F401  (registers the custom layers for loading)

    model = keras.saving.load_model(out / "model.keras")
    encoder = np.zeros((2, 12), np.int32)
    encoder[:, :3] = tokenizer.encode("what is ai?")[:3]
    decoder = np.zeros((2, 12), np.int32)
    decoder[:, 0] = tokenizer.bos_id
    logits = np.asarray(model({"encoder_tokens": encoder, "decoder_tokens": decoder}))
    assert logits.shape == (2, 12, 200) and np.isfinite(logits).all()

    # The SavedModel answers questions by itself: a process with TensorFlow and no line of
    # this project's code gives the replies that the Python tokenizer and decoder give.
    questions = ["What is AI?", "Where does Maya live?", "Repeat after me: red tree", "Héllo, WORLD!!", ""]
    served = subprocess.run(
        [sys.executable, "-c", SERVE, str(latest_saved_model(out / "saved_model")), json.dumps(questions)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert served.returncode == 0, served.stderr[-3000:]
    replies = json.loads(served.stdout.strip().splitlines()[-1])
    from trainer.dialogue.model import GreedyDecoder

    ids = np.zeros((len(questions), 12), np.int32)
    for i, question in enumerate(questions):
        encoded = tokenizer.encode(question, 12)
        ids[i, : len(encoded)] = encoded
    decoded = GreedyDecoder(model, 12, tokenizer.bos_id, tokenizer.eos_id)(ids)
    assert replies == [tokenizer.decode(row) for row in decoded]
    assert any(replies), replies


# Run in a fresh interpreter: only TensorFlow, no tokenizer, no model code of this project.
SERVE = """
import json, sys
import tensorflow as tf
loaded = tf.saved_model.load(sys.argv[1])
out = loaded.signatures["generate"](text=tf.constant(json.loads(sys.argv[2])))
assert not [m for m in sys.modules if m == "trainer" or m.startswith(("trainer.", "include."))]
print(json.dumps([r.decode("utf-8") for r in out["reply"].numpy()]))
"""


@pytest.mark.slow
def test_trains_on_raw_cornell_files(tmp_path, caplog):
    data = tmp_path / "data"
    shutil.copytree(CORNELL, data / "corpus")
    caplog.set_level(logging.INFO)
    rc = dialogue_train.main(
        [
            "--data-dir",
            str(data),
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            "--output-dir",
            str(tmp_path / "out"),
            *TINY,
            "--batch-size",
            "4",
            "--max-steps",
            "3",
            "--validation-split",
            "0.2",
        ]
    )
    assert rc == 0, caplog.text[-3000:]
    assert "read 12 pairs from" in caplog.text and "skipped 5 unparsable record(s)" in caplog.text
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["steps"] == 3 and metrics["skipped_records"] == 5
    assert metrics["train_examples"] + metrics["val_examples"] == 12
    samples = json.loads((tmp_path / "out" / "samples.json").read_text())
    assert samples and samples[-1]["step"] == 3


@pytest.mark.parametrize(
    ("files", "flags", "code", "message"),
    [
        (
            {"pairs.tsv": "no tab here\nnor here\n"},
            [],
            EXIT_DATAERR,
            "no parsable question/response pairs in pairs.tsv (2 record(s) skipped)",
        ),
        ({"notes.md": "# nothing\n"}, [], EXIT_DATAERR, "no dialogue data in DATA_DIR"),
        ({"pairs.tsv": "hi\tthere\n"}, [], EXIT_DATAERR, "only 1 question/response pair found"),
        (
            {"pairs.tsv": "hi\tthere\nhow are you\tfine\nbye\tsee you\n"},
            ["--batch-size", "8"],
            EXIT_DATAERR,
            "2 training pairs are fewer than --batch-size 8",
        ),
        ({"latin.tsv": "caf\xe9\tbien\n".encode("latin-1")}, [], EXIT_DATAERR, "is not UTF-8 text"),
        ({"pairs.tsv": "a\tb\n"}, ["--data-file", "other.tsv"], 66, "--data-file 'other.tsv' does not exist"),
    ],
    ids=[
        "no-parsable-pairs",
        "no-data-files",
        "one-pair",
        "fewer-than-batch",
        "not-utf8",
        "missing-data-file",
    ],
)
def test_bad_data_is_refused_before_training(tmp_path, caplog, files, flags, code, message):
    data = tmp_path / "data"
    data.mkdir()
    for name, content in files.items():
        (data / name).write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    caplog.set_level(logging.INFO)
    rc = dialogue_train.main(
        [
            "--data-dir",
            str(data),
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            "--output-dir",
            str(tmp_path / "out"),
            *flags,
        ]
    )
    assert rc == code
    assert message in caplog.text
    assert not (tmp_path / "out" / "metrics.json").exists()
    assert not list((tmp_path / "ckpt").glob("ckpt-*"))


def test_bad_flag_is_refused_with_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        dialogue_train.main(
            [
                "--data-dir",
                str(tmp_path),
                "--checkpoint-dir",
                str(tmp_path),
                "--output-dir",
                str(tmp_path),
                "--hidden-size",
                "30",
                "--num-heads",
                "4",
            ]
        )
    assert info.value.code == EXIT_USAGE
    assert "--hidden-size must be a multiple of --num-heads 4, got 30" in capsys.readouterr().err
