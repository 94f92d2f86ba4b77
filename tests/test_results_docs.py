"""The measured tables under ``docs/results/tables/`` are what the docs show: each ``table.md`` is the Markdown
of its ``table.json`` (as ``obow tables run`` writes it), its rows appear verbatim in the full record
(``docs/results/README.md``), and the headline tables' rows in the project README too."""

import json
from pathlib import Path

import pytest

from obow.experiments.tables import TABLES, markdown

ROOT = Path(__file__).resolve().parents[1]
RESULTS = sorted((ROOT / "docs" / "results" / "tables").glob("*/table.json"))
# The tables the project README shows beside the full record (its "What the tables measured" section).
HEADLINE = ("cifar10-mocov2", "imagenette-mocov2", "cifar10-table3")


def _rows(path: Path) -> list[str]:
    return [line for line in (path.parent / "table.md").read_text().splitlines() if line.startswith("| ")]


def test_there_are_measured_tables():
    assert RESULTS, "docs/results/tables/*/table.json: no measured table committed"
    names = {p.parent.name for p in RESULTS}
    assert set(HEADLINE) <= names, f"headline tables without files: {sorted(set(HEADLINE) - names)}"


@pytest.mark.parametrize("path", RESULTS, ids=[p.parent.name for p in RESULTS])
def test_committed_table_is_its_json_and_is_in_the_record(path):
    record = json.loads(path.read_text())
    text = (path.parent / "table.md").read_text()
    assert text == markdown(record, TABLES[record["table"]].columns)
    rows = _rows(path)
    full = (ROOT / "docs" / "results" / "README.md").read_text()
    assert rows and all(line in full for line in rows), f"docs/results/README.md lacks {path.parent.name}'s rows"
    if path.parent.name in HEADLINE:
        readme = (ROOT / "README.md").read_text()
        assert all(line in readme for line in rows), f"README.md does not show {path.parent.name}'s rows"


def test_the_readme_links_the_full_record():
    assert "docs/results/README.md" in (ROOT / "README.md").read_text()


def _sync_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("results_sync", ROOT / "docs" / "results" / "sync.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_table_has_its_block_and_every_block_is_its_table_md():
    """Each committed table is shown whole in the full record (a ``<!-- table NAME -->`` block equal to its
    table.md, heading one level down), the headline tables in the README too: ``python docs/results/sync.py``
    rewrites stale blocks."""
    sync = _sync_module()
    full = (ROOT / "docs" / "results" / "README.md").read_text()
    blocks = {m["name"] for m in sync.BLOCK.finditer(full)}
    assert blocks == {p.parent.name for p in RESULTS}
    readme_blocks = {m["name"] for m in sync.BLOCK.finditer((ROOT / "README.md").read_text())}
    assert readme_blocks == set(HEADLINE)
    for doc in sync.DOCS:
        assert sync.synced(doc.read_text())[1] == [], f"{doc.name}: stale blocks; run python docs/results/sync.py"


def test_sync_replaces_a_stale_block_and_leaves_the_rest():
    sync = _sync_module()
    name = RESULTS[0].parent.name
    stale = f"before\n<!-- table {name} -->\n#### old text\n<!-- /table {name} -->\nafter\n"
    new, changed = sync.synced(stale)
    assert changed == [name]
    assert new == f"before\n<!-- table {name} -->\n{sync.block_text(name)}<!-- /table {name} -->\nafter\n"
    assert sync.block_text(name).startswith("#### ") and sync.synced(new)[1] == []
    with pytest.raises(FileNotFoundError, match="no-such-table"):
        sync.synced("<!-- table no-such-table -->\nx\n<!-- /table no-such-table -->")
