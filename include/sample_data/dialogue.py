"""Write a dialogue dataset of question/response pairs from the chatterbot-corpus package.

Each YAML conversation in the package (a list of utterances) gives one pair per pair of
consecutive utterances, and every pair carries the id of its conversation
(``<category>-<number>``, e.g. ``greetings-3``), so that the trainer's validation split
keeps a conversation on one side. Whitespace, line breaks included, is collapsed to
single spaces so every pair fits one TSV line. The output format follows the file name:
``.tsv`` (a header line ``question TAB response TAB conversation``, then one pair per
line) or ``.jsonl`` ({"question": ..., "response": ..., "conversation": ...} per line).
Same arguments, same bytes.

Usage: python -m include.sample_data.dialogue --out pairs.tsv [--language english]
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib.util import find_spec
from pathlib import Path

# Code listings with multi-line answers make poor chat replies.
DEFAULT_EXCLUDE = "coding"


def corpus_dir() -> Path:
    """The chatterbot-corpus package's data folder (found without importing it)."""
    spec = find_spec("chatterbot_corpus")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the chatterbot-corpus package is not installed in this environment")
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def clean(text: object) -> str:
    """One line of text with single spaces."""
    return " ".join(str(text).split())


def pairs_from_corpus(
    language: str,
    categories: list[str] | None,
    exclude: list[str],
) -> list[tuple[str, str, str]]:
    """(question, response, conversation id) of consecutive utterances, in file and file order."""
    folder = corpus_dir() / language
    if not folder.is_dir():
        known = sorted(p.name for p in corpus_dir().iterdir() if p.is_dir())
        raise SystemExit(f"--language {language!r} is not in the corpus; expected one of {', '.join(known)}")
    files = sorted(folder.glob("*.yml"))
    if categories:
        unknown = sorted(set(categories) - {f.stem for f in files})
        if unknown:
            raise SystemExit(
                f"--categories {','.join(unknown)} not found in {language}; expected some of "
                f"{', '.join(f.stem for f in files)}"
            )
        files = [f for f in files if f.stem in categories]
    files = [f for f in files if f.stem not in exclude]
    try:
        import yaml  # PyYAML: pinned in trainer/requirements.txt for this generator only
    except ImportError:
        raise SystemExit("PyYAML is needed to read the corpus: install trainer/requirements.txt") from None
    pairs = []
    for path in files:
        doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for number, conversation in enumerate(doc.get("conversations") or [], 1):
            turns = [clean(t) for t in conversation if t is not None and clean(t)]
            pairs.extend((q, r, f"{path.stem}-{number}") for q, r in zip(turns, turns[1:], strict=False))
    return pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m include.sample_data.dialogue",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", required=True, type=Path, help="file to write: .tsv or .jsonl")
    parser.add_argument("--language", default="english", help="corpus language folder (default: english)")
    parser.add_argument("--categories", default="", help="comma-separated categories (default: all)")
    parser.add_argument(
        "--exclude",
        default=DEFAULT_EXCLUDE,
        help=f"comma-separated categories to leave out (default: {DEFAULT_EXCLUDE})",
    )
    args = parser.parse_args(argv)
    suffix = args.out.suffix.lower()
    if suffix not in (".tsv", ".jsonl"):
        parser.error(f"--out must end in .tsv or .jsonl, got {str(args.out)!r}")
    split = lambda text: [c.strip() for c in text.split(",") if c.strip()]  # noqa: E731
    pairs = pairs_from_corpus(args.language, split(args.categories), split(args.exclude))
    if not pairs:
        parser.error("the selected categories hold no conversation pairs")
    if suffix == ".tsv":
        text = "question\tresponse\tconversation\n" + "".join(f"{q}\t{r}\t{c}\n" for q, r, c in pairs)
    else:
        text = "".join(
            json.dumps({"question": q, "response": r, "conversation": c}, ensure_ascii=False) + "\n"
            for q, r, c in pairs
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(
        f"wrote {args.out}: {len(pairs)} question/response pairs of {len({c for _, _, c in pairs})} "
        f"conversations from chatterbot-corpus/{args.language}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
