"""The measured tables under ``docs/results/tables/`` are what the README shows: each ``table.md`` is the
Markdown of its ``table.json`` (as ``obow tables run`` writes it) and its rows appear in the README verbatim."""

import json
from pathlib import Path

import pytest

from obow.experiments.tables import TABLES, markdown

ROOT = Path(__file__).resolve().parents[1]
RESULTS = sorted((ROOT / "docs" / "results" / "tables").glob("*/table.json"))


def test_there_are_measured_tables():
    assert RESULTS, "docs/results/tables/*/table.json: no measured table committed"


@pytest.mark.parametrize("path", RESULTS, ids=[p.parent.name for p in RESULTS])
def test_committed_table_is_its_json_and_is_in_the_readme(path):
    record = json.loads(path.read_text())
    text = (path.parent / "table.md").read_text()
    assert text == markdown(record, TABLES[record["table"]].columns)
    readme = (ROOT / "README.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert rows and all(line in readme for line in rows), f"README does not show {path.parent.name}'s rows"
