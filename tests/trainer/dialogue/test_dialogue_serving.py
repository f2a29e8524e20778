"""The dialogue trainer's conversation-level split, greedy decoding, in-graph tokenizer, and the
vocabulary check on resume."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from include.sample_data import dialogue as dialogue_data
from trainer.common.contract import EXIT_DATAERR
from trainer.dialogue.data import load_pairs, read_cornell, read_jsonl, split_pairs
from trainer.dialogue.tokenizer import WordTokenizer

REPO = Path(__file__).resolve().parents[3]
CORNELL = Path(__file__).parent / "fixtures" / "cornell"
TINY = [
    "--num-layers",
    "1",
    "--num-heads",
    "2",
    "--hidden-size",
    "16",
    "--ff-size",
    "32",
    "--max-input-length",
    "8",
    "--max-output-length",
    "8",
    "--warmup-steps",
    "10",
]
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")


@pytest.mark.parametrize("seed", range(8))
def test_the_split_keeps_each_cornell_conversation_on_one_side(seed):
    parsed = read_cornell(CORNELL)
    assert len(parsed.groups) == len(parsed.pairs) == 12 and len(set(parsed.groups)) == 4
    train, val = split_pairs(parsed.pairs, 0.3, seed, parsed.groups)
    assert len(train) + len(val) == 12 and train and val
    # Consecutive pairs share a line: (A, B), (B, C). A random pair split puts B on both sides.
    lines = {
        side: {text for pair in pairs for text in pair} for side, pairs in (("train", train), ("val", val))
    }
    assert not lines["train"] & lines["val"]


def test_jsonl_conversation_ids_group_pairs(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text(
        "\n".join(
            [
                '{"question": "hi", "response": "hello", "conversation_id": 7}',
                '{"question": "hello", "response": "how are you", "conversation_id": 7}',
                '{"question": "a", "response": "b"}',
                '{"question": "c", "response": "d"}',
            ]
        )
        + "\n"
    )
    parsed = read_jsonl(path)
    assert parsed.groups[0] == parsed.groups[1] and len(set(parsed.groups)) == 3
    loaded = load_pairs(tmp_path, max_pairs=3)
    assert len(loaded.groups) == 3


def tiny_transformer(vocab_size: int):
    from trainer.dialogue.model import build_transformer

    return build_transformer(
        vocab_size=vocab_size,
        max_input_length=8,
        max_output_length=8,
        num_layers=1,
        num_heads=2,
        hidden_size=16,
        ff_size=32,
        dropout=0.0,
    )


def test_greedy_decoding_never_emits_pad_or_start_tokens():
    from trainer.dialogue.model import GreedyDecoder

    model = tiny_transformer(12)
    logits = model.get_layer("logits")
    kernel, bias = logits.get_weights()
    bias[:] = 0.0
    bias[0], bias[2], bias[5] = 60.0, 50.0, 40.0  # <pad> and <s> are the most likely tokens, then word 5
    logits.set_weights([kernel * 0.0, bias])
    encoder = np.zeros((3, 8), np.int32)
    encoder[:, :2] = [[4, 5], [6, 7], [8, 9]]
    replies = GreedyDecoder(model, 8, bos_id=2, eos_id=3)(encoder)
    assert replies.shape == (3, 8)
    assert (replies == 5).all(), replies  # the best allowed token, at every position


CORPUS = [
    "Hello, world! How're you?",
    "It's 3:45pm -- (really) [sic] {ok}.",
    "Ça va? Très bien, merci.",
    "ÉCOLE  Straße\u00a0naïve\tcafé\u2003end",
    "tab\there\nnew line\x0bvertical",
    "multiple!!! punctuation??",
    "emoji 🙂 and CJK 漢字 text",
    "under_score and don't",
    "ｆｕｌｌｗｉｄｔｈ ＡＢＣ",
    "",
    "   ",
]


def test_the_in_graph_tokenizer_gives_the_python_tokenizers_ids_and_texts(tmp_path):
    import tensorflow as tf

    from trainer.dialogue.serving import GraphTokenizer

    dialogue_data.main(["--out", str(tmp_path / "pairs.tsv")])
    sample = [text for pair in load_pairs(tmp_path).pairs for text in pair]
    texts = [*CORPUS, *(text for pair in read_cornell(CORNELL).pairs for text in pair), *sample]
    for lowercase in (True, False):
        tokenizer = WordTokenizer.build(texts, vocab_size=3000, lowercase=lowercase)
        graph = GraphTokenizer(tokenizer, max_input_length=12)
        ids = graph.encode(tf.constant(texts)).numpy()
        for text, row in zip(texts, ids, strict=True):
            expected = tokenizer.encode(text, 12)
            assert row.tolist() == expected + [0] * (12 - len(expected)), text
        rng = np.random.default_rng(1)
        random_ids = rng.integers(0, tokenizer.size, size=(200, 10)).astype(np.int32)
        decoded = [t.decode("utf-8") for t in graph.decode(tf.constant(random_ids)).numpy()]
        assert decoded == [tokenizer.decode(row) for row in random_ids]


def run_dialogue(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DATA_DIR", "CHECKPOINT_DIR", "OUTPUT_DIR")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return subprocess.run(
        [sys.executable, "-m", "trainer.dialogue", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("keep_tokenizer_file", [True, False], ids=["tokenizer-file", "fingerprint-only"])
def test_resume_refuses_a_checkpoint_of_another_vocabulary(tmp_path, keep_tokenizer_file):
    data = tmp_path / "data"
    dialogue_data.main(["--out", str(data / "pairs.tsv"), "--categories", "greetings"])
    args = [
        "--data-dir",
        str(data),
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--output-dir",
        str(tmp_path / "out"),
        *TINY,
        "--batch-size",
        "8",
        "--vocab-size",
        "40",
        "--max-steps",
        "2",
        "--log-every-steps",
        "100",
    ]
    first = run_dialogue(args)
    assert first.returncode == 0, first.stderr[-3000:]
    # The same number of pairs (same epoch length), other words: with --vocab-size 40 the
    # vocabulary keeps its size, its words change.
    pairs = data / "pairs.tsv"
    pairs.write_text(pairs.read_text().replace("you", "zebra").replace("I", "zebra"))
    if not keep_tokenizer_file:
        (tmp_path / "ckpt" / "tokenizer.json").unlink()
    second = run_dialogue([*args[:-4], "--max-steps", "4"])
    assert second.returncode == EXIT_DATAERR, second.stderr[-3000:]
    assert (
        "was trained with another vocabulary than the training pairs give now (40 vs 40 tokens"
        in second.stderr
    )
    assert not list((tmp_path / "ckpt").glob("ckpt-4.*"))
