"""A word-level tokenizer built from the training data and saved as JSON (never pickle).

Text is (optionally) lower-cased and split into words and single punctuation marks. The
vocabulary holds four special tokens, then the most frequent words (ties broken
alphabetically, so the same data always gives the same ids).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from trainer.common.contract import UsageError, write_json_atomic

KIND = "kubetrain/word-tokenizer"
FORMAT_VERSION = 1
PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<s>", "</s>"
SPECIALS = (PAD, UNK, BOS, EOS)
PATTERN = r"[\w']+|[^\w\s]"
_NO_SPACE_BEFORE = set(".,!?;:%)]}")
_NO_SPACE_AFTER = set("([{")


class WordTokenizer:
    """Maps text to token ids and back.

    Args:
        vocabulary: tokens by id; must start with the four special tokens.
        lowercase: whether text is lower-cased before splitting.
    """

    def __init__(self, vocabulary: Sequence[str], lowercase: bool = True) -> None:
        if tuple(vocabulary[: len(SPECIALS)]) != SPECIALS:
            raise ValueError(f"vocabulary must start with {list(SPECIALS)}, got {list(vocabulary[:4])}")
        self.vocabulary = list(vocabulary)
        self.lowercase = lowercase
        self.ids = {token: i for i, token in enumerate(self.vocabulary)}
        self._pattern = re.compile(PATTERN)

    pad_id, unk_id, bos_id, eos_id = 0, 1, 2, 3

    @property
    def size(self) -> int:
        """Number of tokens, specials included."""
        return len(self.vocabulary)

    def split(self, text: str) -> list[str]:
        """Words and punctuation marks of ``text``."""
        return self._pattern.findall(text.lower() if self.lowercase else text)

    @classmethod
    def build(
        cls,
        texts: Iterable[str],
        vocab_size: int,
        min_count: int = 1,
        lowercase: bool = True,
    ) -> WordTokenizer:
        """A tokenizer with the ``vocab_size`` most useful tokens of ``texts``."""
        probe = cls(SPECIALS, lowercase)
        counts = Counter(token for text in texts for token in probe.split(text))
        ranked = sorted((t for t, n in counts.items() if n >= min_count), key=lambda t: (-counts[t], t))
        return cls([*SPECIALS, *ranked[: max(0, vocab_size - len(SPECIALS))]], lowercase)

    def encode(self, text: str, max_length: int | None = None) -> list[int]:
        """Token ids of ``text`` (unknown words become ``<unk>``), cut to ``max_length``."""
        ids = [self.ids.get(token, self.unk_id) for token in self.split(text)]
        return ids[:max_length] if max_length is not None else ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` up to the first ``</s>``, without special tokens."""
        words: list[str] = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i in (self.pad_id, self.bos_id) or not 0 <= i < self.size:
                continue
            words.append(self.vocabulary[i])
        text = ""
        for word in words:
            if text and word not in _NO_SPACE_BEFORE and text[-1] not in _NO_SPACE_AFTER:
                text += " "
            text += word
        return text

    def fingerprint(self) -> str:
        """SHA-256 of what fixes the token ids: the vocabulary, the lower-casing and the split pattern."""
        doc = json.dumps(
            {"vocabulary": self.vocabulary, "lowercase": self.lowercase, "pattern": PATTERN},
            ensure_ascii=False,
            separators=(",", ":"),
        )
        return hashlib.sha256(doc.encode("utf-8")).hexdigest()

    def difference(self, other: WordTokenizer) -> str:
        """Where ``other`` differs from this tokenizer, in words (empty when they are the same)."""
        if self.fingerprint() == other.fingerprint():
            return ""
        parts = [f"{self.size} vs {other.size} tokens"]
        if self.lowercase != other.lowercase:
            parts.append(f"lowercase {self.lowercase} vs {other.lowercase}")
        for i, (a, b) in enumerate(zip(self.vocabulary, other.vocabulary, strict=False)):
            if a != b:
                parts.append(f"first difference at id {i}: {a!r} vs {b!r}")
                break
        return "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        """The JSON document that ``from_json`` reads back."""
        return {
            "kind": KIND,
            "format_version": FORMAT_VERSION,
            "lowercase": self.lowercase,
            "pattern": PATTERN,
            "special_tokens": {"pad": PAD, "unk": UNK, "bos": BOS, "eos": EOS},
            "vocabulary": self.vocabulary,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> WordTokenizer:
        """Read a tokenizer document, refusing kinds and versions it does not know."""
        if doc.get("kind") != KIND:
            raise UsageError(
                f"tokenizer file of kind {doc.get('kind')!r} is not understood; expected {KIND!r}"
            )
        if doc.get("format_version") != FORMAT_VERSION:
            raise UsageError(
                f"tokenizer format_version {doc.get('format_version')!r} is not understood; "
                f"expected {FORMAT_VERSION}"
            )
        if doc.get("pattern", PATTERN) != PATTERN:
            raise UsageError("tokenizer file uses a different split pattern than this trainer")
        return cls(doc["vocabulary"], bool(doc.get("lowercase", True)))

    def save(self, path: str | Path) -> Path:
        """Write the tokenizer as JSON, atomically."""
        return write_json_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> WordTokenizer:
        """Read a tokenizer written by ``save``."""
        return cls.from_json(json.loads(Path(path).read_text(encoding="utf-8")))
