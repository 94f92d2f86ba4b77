"""The measured tables under ``docs/results/tables/`` are what the docs show: each ``table.md`` is the Markdown
of its ``table.json`` (as ``obow tables run`` writes it), its rows appear verbatim in the full record
(``docs/results/README.md`` and its pages, one per table), the headline tables' rows in ``docs/paper-tables.md``
too, and every number of the project README's headline verdict is its table's mean ± deviation."""

import json
from pathlib import Path

import pytest

from obow.experiments.tables import TABLES, markdown

ROOT = Path(__file__).resolve().parents[1]
RESULTS = sorted((ROOT / "docs" / "results" / "tables").glob("*/table.json"))
# The tables docs/paper-tables.md shows beside the full record (its "What the tables measured" section).
HEADLINE = ("cifar10-mocov2", "imagenette-mocov2", "cifar10-table3")
SUMMARY = ROOT / "docs" / "paper-tables.md"


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
    full = _record_text()
    assert rows and all(line in full for line in rows), f"docs/results/*.md lack {path.parent.name}'s rows"
    if path.parent.name in HEADLINE:
        summary = SUMMARY.read_text()
        assert all(line in summary for line in rows), f"docs/paper-tables.md does not show {path.parent.name}'s rows"


def test_the_readme_links_the_full_record():
    assert "docs/results/README.md" in (ROOT / "README.md").read_text()


def _record_text() -> str:
    """The full record: docs/results/README.md and its pages."""
    return "".join(page.read_text() for page in _sync_module().RECORD)


def _sync_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("results_sync", ROOT / "docs" / "results" / "sync.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_table_has_its_block_and_every_block_is_its_table_md():
    """Each committed table is shown whole in the full record (a ``<!-- table NAME -->`` block equal to its
    table.md, heading one level down), the headline tables in docs/paper-tables.md too: ``python docs/results/sync.py``
    rewrites stale blocks."""
    sync = _sync_module()
    blocks = [m["name"] for m in sync.BLOCK.finditer(_record_text())]
    assert sorted(blocks) == sorted(set(blocks)), "a table shown on two pages of the record"
    blocks = set(blocks)
    assert blocks == {p.parent.name for p in RESULTS}
    summary_blocks = {m["name"] for m in sync.BLOCK.finditer(SUMMARY.read_text())}
    assert summary_blocks == set(HEADLINE)
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


# The README's headline verdict: its rows (each a table row's label, and the suffix of the tables it is read from:
# the shuffled-batch-norm re-runs live in tables of their own), and the table and score of each column.
VERDICT_ROWS = {
    "random init (same network)": (None, ""),  # the table's random_init entry
    "OBoW (full)": ("OBoW (full)", ""),
    "MoCo v2 (same augmentations as OBoW)": ("MoCo v2 (our aug.)", ""),
    "MoCo v2 (same augmentations, shuffled batch norm)": ("MoCo v2 (our aug.)", "-shufbn"),
}
VERDICT_COLUMNS = {
    "CIFAR-10 kNN": ("cifar10-mocov2", "knn"),
    "CIFAR-10 linear": ("cifar10-mocov2", "linear"),
    "Imagenette kNN": ("imagenette-mocov2", "knn"),
    "Imagenette linear": ("imagenette-mocov2", "linear"),
}


def _markdown_table(text: str, first_header: str) -> list[list[str]]:
    """The cells of the Markdown table whose header row starts with ``| first_header |`` (separator dropped)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        if not set(line) <= set("|-: "):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def test_the_readme_verdict_is_the_committed_tables():
    """Every cell of the README's headline table is ``mean ± sample deviation`` of its row and score in the
    committed table.json (2 decimals, as table.md writes them), and every row and column is one of those named
    here, so that a number edited by hand, or a table re-measured without the README, fails."""
    header, *body = _markdown_table((ROOT / "README.md").read_text(), "features")
    assert header[1:] == list(VERDICT_COLUMNS)
    assert [row[0] for row in body] == list(VERDICT_ROWS)
    for row in body:
        label, suffix = VERDICT_ROWS[row[0]]
        for cell, (name, score) in zip(row[1:], VERDICT_COLUMNS.values(), strict=True):
            table = json.loads((ROOT / "docs/results/tables" / (name + suffix) / "table.json").read_text())
            entry = table["random_init"] if label is None else next(r for r in table["rows"] if r["label"] == label)
            assert len(entry["runs"]) == 2  # the README says two seeds
            expected = f"{entry['mean'][score]:.2f} ± {entry['std'][score]:.2f}"
            assert cell == expected, f"README {row[0]!r}, {name} {score}: {cell!r}, the table says {expected!r}"


def test_the_readme_verdict_sentence_matches_the_numbers():
    """The README says MoCo v2 with the same augmentations is ahead of OBoW (full) on both datasets at both
    seeds, and gives OBoW's kNN gains over random init: both are checked against the table.json files."""
    readme = (ROOT / "README.md").read_text()
    assert "MoCo v2 with the same augmentations is ahead of OBoW (full) on both datasets" in readme
    gains = []
    for name in ("cifar10-mocov2", "imagenette-mocov2"):
        table = json.loads((ROOT / "docs/results/tables" / name / "table.json").read_text())
        rows = {r["label"]: r for r in table["rows"]}
        for score in ("knn", "linear"):
            obow = {r["seed"]: r["scores"][score] for r in rows["OBoW (full)"]["runs"]}
            moco = {r["seed"]: r["scores"][score] for r in rows["MoCo v2 (our aug.)"]["runs"]}
            assert obow.keys() == moco.keys() and all(moco[s] > obow[s] for s in obow), (name, score)
        gains.append(rows["OBoW (full)"]["mean"]["knn"] - table["random_init"]["mean"]["knn"])
    assert f"kNN +{gains[0]:.2f} and +{gains[1]:.2f} points over random init" in readme


def test_the_readme_gives_the_shuffled_batch_norm_rerun_as_committed():
    """Issue 44: the README's headline states MoCo v2 (our aug.) with shuffled batch norm on CIFAR-10 as the
    committed re-run's mean ± deviation (two seeds), beside the rows trained with plain batch norm."""
    readme = " ".join((ROOT / "README.md").read_text().split())  # the sentence wraps
    table = json.loads((ROOT / "docs/results/tables/cifar10-mocov2-shufbn/table.json").read_text())
    (row,) = [r for r in table["rows"] if r["label"] == "MoCo v2 (our aug.)"]
    assert [run["seed"] for run in row["runs"]] == [0, 1]
    assert all(run["scores"]["knn"] > 0 for run in row["runs"])
    knn = f"kNN {row['mean']['knn']:.2f} ± {row['std']['knn']:.2f}"
    linear = f"linear {row['mean']['linear']:.2f} ± {row['std']['linear']:.2f}"
    assert f"MoCo v2 (same augmentations, shuffled batch norm): {knn}, {linear}" in readme
