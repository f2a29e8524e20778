"""Readers of question/response pairs: TSV, JSONL and the Cornell Movie-Dialogs files.

* TSV: ``question<TAB>response`` per line, UTF-8. An optional header line naming the two
  columns (e.g. ``question<TAB>response``) is skipped.
* JSONL: one object per line with a question key (``question``, ``input`` or ``prompt``)
  and a response key (``response``, ``reply`` or ``answer``), UTF-8.
* Cornell Movie-Dialogs: ``movie_lines.txt`` (``lineID +++$+++ characterID +++$+++
  movieID +++$+++ character name +++$+++ text``) and ``movie_conversations.txt``
  (``characterID +++$+++ characterID +++$+++ movieID +++$+++ ['L1', 'L2', ...]``),
  Latin-1. Each pair of consecutive lines of a conversation is one pair.

Every pair belongs to a group that the train/validation split keeps whole: a Cornell
conversation (its consecutive pairs share lines, so splitting them would show the
validation set's lines in training), a JSONL object's ``conversation``,
``conversation_id`` or ``dialogue_id`` when it has one, a TSV line's conversation column
when the file's header names one (``question<TAB>response<TAB>conversation``, as
``include/sample_data/dialogue.py`` writes), else the pair alone. Files without
conversation ids are still read; each of their pairs is then its own group, so two pairs
of one conversation may land on both sides of the split.

Before the split, pairs that the model cannot tell apart (the same question and response
tokens) are kept once: a duplicate on both sides would be validated on training data.

Records that cannot be parsed are skipped and counted, never fatal; no parsable pair at
all is a ``DataError``.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kubetrain_contract.flags import DIALOGUE_FORMATS
from trainer.common.contract import DataError, NoInputError

log = logging.getLogger("kubetrain.trainer")

CORNELL_SEPARATOR = " +++$+++ "
CORNELL_LINES = "movie_lines.txt"
CORNELL_CONVERSATIONS = "movie_conversations.txt"
CORNELL_ENCODING = "latin-1"
QUESTION_KEYS = ("question", "input", "prompt")
RESPONSE_KEYS = ("response", "reply", "answer")
GROUP_KEYS = ("conversation", "conversation_id", "dialogue_id")
FORMATS = DIALOGUE_FORMATS  # the --data-format choices, as the flag table has them
_LINE_ID = re.compile(r"'([^']+)'|\"([^\"]+)\"")


@dataclass
class Pairs:
    """Question/response pairs and where they came from.

    Attributes:
        pairs: (question, response) tuples, in file order.
        groups: for each pair, the conversation it comes from (the split keeps one whole).
        sources: the files read, relative to DATA_DIR.
        skipped: records that could not be parsed (bad lines, unknown line ids, empty text).
    """

    pairs: list[tuple[str, str]] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    skipped: int = 0

    def add(self, question: str, response: str, group: str) -> None:
        self.pairs.append((question, response))
        self.groups.append(group)


def _clean(text: str) -> str:
    return " ".join(text.split())


def _tsv_header(fields: list[str]) -> dict[str, int] | None:
    """Column positions when ``fields`` is a header line naming a question and a response column."""
    names = [f.strip().lower() for f in fields]
    question = next((i for i, n in enumerate(names) if n in QUESTION_KEYS), None)
    response = next((i for i, n in enumerate(names) if n in RESPONSE_KEYS), None)
    group = next((i for i, n in enumerate(names) if n in GROUP_KEYS), None)
    known = {i for i in (question, response, group) if i is not None}
    if question is None or response is None or len(known) != len(names):
        return None
    return {"question": question, "response": response, **({"group": group} if group is not None else {})}


def read_tsv(path: Path) -> Pairs:
    """Pairs from a ``question<TAB>response`` file.

    A first line that names the columns is a header: ``question<TAB>response``, in either
    order, optionally with a ``conversation`` (or ``conversation_id``, ``dialogue_id``)
    column whose value groups the pairs of one conversation. Without such a column each
    line is its own group.
    """
    out = Pairs(sources=[path.name])
    columns = {"question": 0, "response": 1}
    with open(path, encoding="utf-8", newline="") as lines:
        for number, line in enumerate(lines, 1):
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            fields = line.split("\t")
            if number == 1:
                header = _tsv_header(fields)
                if header is not None:
                    columns = header
                    continue
            if len(fields) != max(columns.values()) + 1:
                out.skipped += 1
                continue
            question, response = _clean(fields[columns["question"]]), _clean(fields[columns["response"]])
            group = _clean(fields[columns["group"]]) if "group" in columns else ""
            if question and response:
                out.add(question, response, f"{path.name}:{'c' + group if group else number}")
            else:
                out.skipped += 1
    return out


def read_jsonl(path: Path) -> Pairs:
    """Pairs from a file of JSON objects, one per line."""
    out = Pairs(sources=[path.name])
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                out.skipped += 1
                continue
            if not isinstance(record, dict):
                out.skipped += 1
                continue
            question = next((record[k] for k in QUESTION_KEYS if isinstance(record.get(k), str)), "")
            response = next((record[k] for k in RESPONSE_KEYS if isinstance(record.get(k), str)), "")
            question, response = _clean(question), _clean(response)
            group = next((record[k] for k in GROUP_KEYS if isinstance(record.get(k), str | int)), None)
            if question and response:
                out.add(
                    question, response, f"{path.name}:{'c' + str(group) if group is not None else number}"
                )
            else:
                out.skipped += 1
    return out


def read_cornell(folder: Path) -> Pairs:
    """Pairs of consecutive lines from the Cornell Movie-Dialogs corpus files in ``folder``."""
    out = Pairs(sources=[CORNELL_LINES, CORNELL_CONVERSATIONS])
    texts: dict[str, str] = {}
    with open(folder / CORNELL_LINES, encoding=CORNELL_ENCODING, newline="") as lines:
        for line in lines:
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            fields = line.split(CORNELL_SEPARATOR)
            if len(fields) != 5:
                # Some lines end with an empty text after a separator without the trailing space.
                fields = line.split(CORNELL_SEPARATOR.rstrip())
                fields = [f.strip() for f in fields]
            if len(fields) != 5 or not fields[0].strip():
                out.skipped += 1
                continue
            texts[fields[0].strip()] = _clean(fields[4])
    with open(folder / CORNELL_CONVERSATIONS, encoding=CORNELL_ENCODING, newline="") as lines:
        for number, line in enumerate(lines, 1):
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            fields = line.split(CORNELL_SEPARATOR)
            if len(fields) != 4:
                out.skipped += 1
                continue
            ids = [a or b for a, b in _LINE_ID.findall(fields[3])]
            if len(ids) < 2:
                out.skipped += 1
                continue
            for first, second in zip(ids, ids[1:], strict=False):
                question, response = texts.get(first), texts.get(second)
                if question and response:
                    out.add(question, response, f"{CORNELL_CONVERSATIONS}:{number}")
                else:
                    out.skipped += 1
    return out


def _format_of(path: Path) -> str:
    if path.is_dir():
        return "cornell"
    suffix = path.suffix.lower()
    if suffix in (".tsv", ".txt"):
        return "tsv"
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    raise DataError(
        f"cannot tell the format of {path.name!r} from its name; pass --data-format tsv, jsonl or cornell"
    )


def find_sources(
    data_dir: Path, data_format: str = "auto", data_file: str | None = None
) -> list[tuple[Path, str]]:
    """The files (or Cornell folder) to read and their formats.

    With ``data_file``, that path (relative to DATA_DIR) is read. Otherwise DATA_DIR is
    searched: a folder holding the two Cornell files wins; else every ``*.tsv`` and
    ``*.jsonl`` file is read, in name order.
    """
    if data_file:
        path = Path(data_file) if os.path.isabs(data_file) else data_dir / data_file
        if not path.exists():
            raise NoInputError(f"--data-file {data_file!r} does not exist under DATA_DIR {str(data_dir)!r}")
        fmt = _format_of(path) if data_format == "auto" else data_format
        if fmt == "cornell" and path.is_file():
            path = path.parent
        return [(path, fmt)]
    found: list[tuple[Path, str]] = []
    cornell: Path | None = None
    for dirpath, dirnames, filenames in os.walk(data_dir):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__MACOSX")
        if CORNELL_LINES in filenames and CORNELL_CONVERSATIONS in filenames and cornell is None:
            cornell = Path(dirpath)
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            suffix = Path(name).suffix.lower()
            kind = {".tsv": "tsv", ".jsonl": "jsonl"}.get(suffix)
            if kind and data_format in ("auto", kind):
                found.append((Path(dirpath) / name, kind))
    if data_format in ("auto", "cornell") and cornell is not None:
        return [(cornell, "cornell")]
    if not found:
        wanted = {
            "auto": f"*.tsv or *.jsonl files, or the Cornell {CORNELL_LINES} and {CORNELL_CONVERSATIONS}",
            "tsv": "*.tsv files",
            "jsonl": "*.jsonl files",
            "cornell": f"the Cornell {CORNELL_LINES} and {CORNELL_CONVERSATIONS}",
        }[data_format]
        raise DataError(f"no dialogue data in DATA_DIR {str(data_dir)!r}: expected {wanted}")
    return found


def load_pairs(
    data_dir: Path, data_format: str = "auto", data_file: str | None = None, max_pairs: int | None = None
) -> Pairs:
    """Read every source and return the pairs.

    Raises:
        DataError: no source found, a file is not valid text, or no pair could be parsed.
    """
    total = Pairs()
    for path, fmt in find_sources(data_dir, data_format, data_file):
        reader = {"tsv": read_tsv, "jsonl": read_jsonl, "cornell": read_cornell}[fmt]
        try:
            part = reader(path)
        except UnicodeDecodeError as exc:
            raise DataError(
                f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}); {fmt} files must be UTF-8"
            ) from exc
        except FileNotFoundError as exc:
            raise DataError(f"{fmt} data incomplete: {exc.filename} is missing") from exc
        log.info(
            "read %d pairs from %s (%s), skipped %d unparsable record(s)",
            len(part.pairs),
            path,
            fmt,
            part.skipped,
        )
        total.pairs.extend(part.pairs)
        total.groups.extend(f"{path}:{g}" for g in part.groups)
        names = [path / s for s in part.sources] if path.is_dir() else [path]
        total.sources.extend(os.path.relpath(n, data_dir) for n in names)
        total.skipped += part.skipped
    if not total.pairs:
        raise DataError(
            f"no parsable question/response pairs in {', '.join(total.sources) or str(data_dir)} "
            f"({total.skipped} record(s) skipped); expected question<TAB>response lines, JSON lines "
            f"with {'/'.join(QUESTION_KEYS)} and {'/'.join(RESPONSE_KEYS)} keys, or Cornell files"
        )
    if max_pairs is not None:
        total.pairs = total.pairs[:max_pairs]
        total.groups = total.groups[:max_pairs]
    return total


@dataclass
class Split:
    """The training and validation pairs, and what the split did to keep them apart.

    Attributes:
        train: training pairs.
        val: validation pairs.
        train_groups: the group of each training pair.
        val_groups: the group of each validation pair.
        pairs_read: pairs before duplicates were removed.
        duplicates_removed: pairs dropped because an earlier pair had the same key.
        key: what makes two pairs the same (see :func:`dedupe_pairs`).
    """

    train: list[tuple[str, str]]
    val: list[tuple[str, str]]
    train_groups: list[str]
    val_groups: list[str]
    pairs_read: int
    duplicates_removed: int
    key: Callable[[tuple[str, str]], Hashable] = field(default=tuple, repr=False)

    def report(self) -> dict[str, int]:
        """The split's numbers for metrics.json: what was removed, and what the two sides share (0 and 0)."""
        train_keys = {self.key(pair) for pair in self.train}
        train_groups, val_groups = set(self.train_groups), set(self.val_groups)
        return {
            "pairs_read": self.pairs_read,
            "duplicates_removed": self.duplicates_removed,
            "groups": len(train_groups | val_groups),
            "train_pairs": len(self.train),
            "val_pairs": len(self.val),
            "train_groups": len(train_groups),
            "val_groups": len(val_groups),
            "val_pairs_in_train": sum(1 for pair in self.val if self.key(pair) in train_keys),
            "groups_in_both": len(train_groups & val_groups),
        }


def dedupe_pairs(
    pairs: Sequence[tuple[str, str]],
    groups: Sequence[str],
    key: Callable[[tuple[str, str]], Hashable] = tuple,
) -> tuple[list[tuple[str, str]], list[str], int]:
    """The pairs without repeats, each kept where it first occurs; also how many were dropped.

    ``key`` says when two pairs are the same: the dialogue trainer passes the tokens the
    model sees, so pairs that differ only in case (with ``--lowercase``) or spacing count
    as one.
    """
    seen: set[Hashable] = set()
    kept_pairs: list[tuple[str, str]] = []
    kept_groups: list[str] = []
    for pair, group in zip(pairs, groups, strict=True):
        k = key(pair)
        if k in seen:
            continue
        seen.add(k)
        kept_pairs.append(pair)
        kept_groups.append(group)
    return kept_pairs, kept_groups, len(pairs) - len(kept_pairs)


def make_split(
    pairs: Sequence[tuple[str, str]],
    fraction: float,
    seed: int,
    groups: Sequence[str] | None = None,
    key: Callable[[tuple[str, str]], Hashable] = tuple,
) -> Split:
    """Remove duplicate pairs, then split by group with a seed: a conversation lands whole on one side.

    Groups are drawn in a seeded random order into validation until it holds
    ``fraction`` of the pairs (at least one pair); training keeps at least one group.
    With a single group there is nothing to keep apart: its last pairs validate (and
    :meth:`Split.report` counts that group on both sides).

    Raises:
        DataError: fewer than two distinct pairs are left.
    """
    import numpy as np

    groups = list(groups) if groups is not None else [str(i) for i in range(len(pairs))]
    if len(groups) != len(pairs):
        raise ValueError(f"{len(groups)} groups for {len(pairs)} pairs")
    read = len(pairs)
    pairs, groups, removed = dedupe_pairs(pairs, groups, key)
    if removed:
        log.info(
            "removed %d duplicate pair(s) of %d before the split (kept the first of each)", removed, read
        )
    if len(pairs) < 2:
        raise DataError(
            f"only {len(pairs)} distinct question/response pair(s) among {read} read; training and "
            "validation need at least two"
        )
    members: dict[str, list[int]] = {}
    for i, group in enumerate(groups):
        members.setdefault(group, []).append(i)
    target = min(len(pairs) - 1, max(1, round(len(pairs) * fraction)))
    if len(members) == 1:
        log.warning(
            "all %d pairs come from one conversation: validating on its last %d pairs", len(pairs), target
        )
        cut = len(pairs) - target
        return Split(list(pairs[:cut]), list(pairs[cut:]), groups[:cut], groups[cut:], read, removed, key)
    names = list(members)
    chosen: set[str] = set()
    taken = 0
    for k in np.random.default_rng(seed).permutation(len(names)):
        if taken >= target or len(chosen) == len(names) - 1:
            break
        chosen.add(names[k])
        taken += len(members[names[k]])
    val = [i for i, g in enumerate(groups) if g in chosen]
    train = [i for i, g in enumerate(groups) if g not in chosen]
    return Split(
        [pairs[i] for i in train],
        [pairs[i] for i in val],
        [groups[i] for i in train],
        [groups[i] for i in val],
        read,
        removed,
        key,
    )


def split_pairs(
    pairs: Sequence[tuple[str, str]],
    fraction: float,
    seed: int,
    groups: Sequence[str] | None = None,
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The training and validation pairs of :func:`make_split` (exact duplicates removed first)."""
    split = make_split(pairs, fraction, seed, groups)
    return split.train, split.val
