"""Copy each measured table into the docs that show it: every ``<!-- table NAME -->`` ... ``<!-- /table NAME -->``
block of the record's pages (``docs/results/*.md``: the index and one page per table) and of
``docs/paper-tables.md`` becomes ``docs/results/tables/NAME/table.md`` with its heading one level down (``###`` ->
``####``). Run after copying a finished ``table.json``/``table.md`` here:

    python docs/results/sync.py          # rewrite the blocks
    python docs/results/sync.py --check  # exit 1 and name the stale blocks, change nothing

``tests/test_results_docs.py`` checks the same, so a stale block fails the suite."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TABLES = ROOT / "docs" / "results" / "tables"
#: The full record: its index (README.md) and one page per table.
RECORD = tuple(sorted((ROOT / "docs" / "results").glob("*.md")))
DOCS = (*RECORD, ROOT / "docs" / "paper-tables.md")
BLOCK = re.compile(r"<!-- table (?P<name>[\w.\-]+) -->\n(?P<body>.*?)<!-- /table (?P=name) -->", re.S)


def block_text(name: str) -> str:
    """What the block for table ``name`` holds: its table.md, the heading one level down."""
    path = TABLES / name / "table.md"
    if not path.is_file():
        raise FileNotFoundError(f"a block names table {name!r}, but {path} does not exist")
    text = path.read_text()
    return re.sub(r"^### ", "#### ", text, count=1, flags=re.M)


def synced(text: str) -> tuple[str, list[str]]:
    """``text`` with every table block replaced by :func:`block_text`, and the names of the blocks that changed."""
    stale = []

    def replace(match: re.Match) -> str:
        body = block_text(match["name"])
        if match["body"] != body:
            stale.append(match["name"])
        return f"<!-- table {match['name']} -->\n{body}<!-- /table {match['name']} -->"

    return BLOCK.sub(replace, text), stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report stale blocks, change nothing")
    args = parser.parse_args(argv)
    any_stale = False
    for doc in DOCS:
        new, stale = synced(doc.read_text())
        for name in stale:
            print(f"{doc.relative_to(ROOT)}: table {name} {'is stale' if args.check else 'updated'}")
        any_stale |= bool(stale)
        if stale and not args.check:
            doc.write_text(new)
    return 1 if (args.check and any_stale) else 0


if __name__ == "__main__":
    sys.exit(main())
