"""The dialogue trainer's split: duplicates removed, conversations kept on one side, the numbers in
metrics.json."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from trainer.dialogue import train as dialogue_train
from trainer.dialogue.data import load_pairs, make_split, read_tsv, split_pairs

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
    "30",
    "--log-every-steps",
    "100",
    "--sample-every-steps",
    "1000",
    "--num-samples",
    "1",
]
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")


def duplicated_corpus(path: Path) -> Path:
    """24 conversations of three turns (two pairs each), every pair written twice: once more in its
    own conversation and once in conversation 'repeats', some of them in other letter case."""
    lines = ["question\tresponse\tconversation"]
    repeats = []
    for c in range(24):
        turns = [f"turn {t} of talk {c} about {['tea', 'rain', 'maps', 'jazz'][c % 4]}" for t in range(3)]
        pairs = list(zip(turns, turns[1:], strict=False))
        lines += [f"{q}\t{r}\ttalk-{c}" for q, r in pairs]
        lines += [f"{q}\t{r}\ttalk-{c}" for q, r in pairs[:1]]
        repeats += [(q.upper() if c % 2 else q, r) for q, r in pairs[1:]]
    lines += [f"{q}\t{r}\trepeats" for q, r in repeats]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_tsv_conversation_column_groups_pairs_and_files_without_ids_are_still_read(tmp_path):
    with_ids = tmp_path / "a.tsv"
    with_ids.write_text(
        "question\tresponse\tconversation\nhi\thello\tc1\nhello\thow are you\tc1\nbye\tciao\tc2\n"
        "two\tcolumns only\n",
        encoding="utf-8",
    )
    parsed = read_tsv(with_ids)
    assert (
        parsed.pairs == [("hi", "hello"), ("hello", "how are you"), ("bye", "ciao")] and parsed.skipped == 1
    )
    assert parsed.groups[0] == parsed.groups[1] != parsed.groups[2]
    # Columns in another order, named by the header.
    reordered = tmp_path / "b.tsv"
    reordered.write_text(
        "dialogue_id\tanswer\tprompt\n7\tfine\thow are you\n7\tyes\treally\n", encoding="utf-8"
    )
    parsed = read_tsv(reordered)
    assert parsed.pairs == [("how are you", "fine"), ("really", "yes")] and len(set(parsed.groups)) == 1
    # A file without ids (older sample data): two columns, each line its own group; a third
    # column without a header naming it is not a conversation id, the line is skipped.
    old = tmp_path / "c.tsv"
    old.write_text("hi\thello\nhello\thow are you\na\tb\tc\n", encoding="utf-8")
    parsed = read_tsv(old)
    assert parsed.pairs == [("hi", "hello"), ("hello", "how are you")] and parsed.skipped == 1
    assert len(set(parsed.groups)) == 2


@pytest.mark.parametrize("seed", [0, 1, 2, 42])
def test_a_duplicated_corpus_splits_without_a_shared_pair_or_conversation(tmp_path, seed):
    loaded = load_pairs(duplicated_corpus(tmp_path / "data" / "pairs.tsv").parent)
    assert len(loaded.pairs) == 24 * 2 + 24 + 24

    def lower(pair: tuple[str, str]) -> tuple[str, str]:
        return pair[0].lower(), pair[1].lower()

    split = make_split(loaded.pairs, 0.25, seed, loaded.groups, key=lower)
    train_keys = {lower(pair) for pair in split.train}
    assert not [pair for pair in split.val if lower(pair) in train_keys]
    assert not set(split.train_groups) & set(split.val_groups)
    # The first copy of each pair stays: 48 distinct pairs in the 24 talks; 'repeats' is empty.
    assert sorted(split.train + split.val) == sorted(set(loaded.pairs[:72]))
    assert split.report() == {
        "pairs_read": 96,
        "duplicates_removed": 48,
        "groups": 24,
        "train_pairs": len(split.train),
        "val_pairs": len(split.val),
        "train_groups": len(split.train) // 2,
        "val_groups": len(split.val) // 2,
        "val_pairs_in_train": 0,
        "groups_in_both": 0,
    }
    assert len(split.val) == 12
    # split_pairs (exact duplicates only) keeps the sides apart too.
    train, val = split_pairs(loaded.pairs, 0.25, seed, loaded.groups)
    assert not set(train) & set(val)


def test_the_trainer_reports_the_split_in_metrics(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    data = duplicated_corpus(tmp_path / "data" / "pairs.tsv").parent
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
        "--validation-split",
        "0.25",
        "--max-steps",
        "1",
    ]
    assert dialogue_train.main(args) == 0, caplog.text[-3000:]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["split"] == {
        "pairs_read": 96,
        "duplicates_removed": 48,
        "groups": 24,
        "train_pairs": 36,
        "val_pairs": 12,
        "train_groups": 18,
        "val_groups": 6,
        "val_pairs_in_train": 0,
        "groups_in_both": 0,
    }
    assert metrics["train_examples"] == 36 and metrics["val_examples"] == 12
    assert (
        "split: 36 training and 12 validation pairs from 18 and 6 conversation(s) (seed 42); 48 duplicate "
        "pair(s) removed; 0 validation pair(s) and 0 conversation(s) also in training"
    ) in caplog.text
