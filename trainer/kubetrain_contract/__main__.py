"""``python -m kubetrain_contract [--write]``: check (or write) ``schemas/`` against the records."""

from __future__ import annotations

import sys

from kubetrain_contract.records import SCHEMA_DIR, registered, schema_text


def main(argv: list[str]) -> int:
    write = "--write" in argv
    stale = []
    for cls in registered():
        path = SCHEMA_DIR / cls.schema_file()
        text = schema_text(cls)
        if write:
            SCHEMA_DIR.mkdir(exist_ok=True)
            path.write_text(text)
        elif not path.exists() or path.read_text() != text:
            stale.append(path.name)
    if stale:
        print("schemas out of date with their records: " + ", ".join(stale), file=sys.stderr)
        print("regenerate with: python -m kubetrain_contract --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
