"""`obow tables paired`: every row of a table minus one of its rows, seed by seed, with the verdict rule the
results use; numbers checked against float64 NumPy re-computations and hand-worked cases."""

import json
from pathlib import Path

import numpy as np
import pytest

from obow.experiments.tables import aggregate, compare_rows, paired_verdict, paper_direction

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results" / "tables"


@pytest.mark.parametrize(
    ("values", "verdict"),
    [
        ([0.44, 0.81], "ahead"),  # mean 0.625 > deviation 0.262, both positive
        ([-1.0, -1.2], "behind"),
        ([0.5, 2.5], "ahead"),  # mean 1.5 > deviation 1.414
        ([0.1, 3.0], "level"),  # same sign, but the deviation (2.05) exceeds the mean (1.55)
        ([0.1, -0.3], "level"),  # the seeds disagree
        ([0.0, 1.0], "level"),  # a zero is no sign
        ([0.3], "one seed"),
        ([], "-"),
    ],
)
def test_paired_verdict_needs_every_seed_to_agree_and_the_mean_to_exceed_the_spread(values, verdict):
    assert paired_verdict(values) == verdict


def test_paper_direction_compares_the_measured_verdict_with_the_papers_sign():
    assert paper_direction("ahead", 5.03) == "holds"
    assert paper_direction("behind", -28.39) == "holds"
    assert paper_direction("ahead", -28.39) == "reversed"
    assert paper_direction("behind", 1.0) == "reversed"
    assert paper_direction("level", 3.0) == "not judged"
    assert paper_direction("one seed", 3.0) == "not judged"
    assert paper_direction("ahead", None) == "-"
    # the paper's rows within half a point (one run each): it claims no ordering, whatever is measured
    assert paper_direction("behind", -0.10) == "paper level"  # Table 2: alpha 0.999 against the cosine
    assert paper_direction("level", 0.39) == "paper level" and paper_direction("ahead", 0.0) == "paper level"
    assert paper_direction("ahead", 0.5) == "holds"


def _record() -> dict:
    scores = {  # slug: seed: (knn, linear)
        "random_init": {0: (20.0, 25.0), 1: (22.0, 26.0)},
        "base": {0: (30.0, 31.0), 1: (31.0, 33.0)},
        "better": {0: (31.5, 33.5), 1: (32.1, 34.4)},
        "mixed": {0: (29.0, 32.0), 1: (31.8, 32.5), 2: (40.0, 40.0)},  # seed 2: no partner in the base row
        "unrun": {},
    }
    paper = {"base": 45.86, "better": 50.89, "mixed": 17.47}

    def row(slug: str) -> dict:
        runs = [
            {"seed": s, "scores": {"knn": k, "linear": lin}, "steps": 1, "minutes": 1.0}
            for s, (k, lin) in scores[slug].items()
        ]
        return aggregate(slug.upper(), slug, {"linear": paper[slug]} if slug in paper else {}, runs)

    return {
        "table": "table2",
        "title": "T",
        "random_init": row("random_init"),
        "rows": [row(s) for s in ("base", "better", "mixed", "unrun")],
    }


def _cell(row: dict[int, float], ref: dict[int, float]) -> str:
    """The expected cell, from NumPy in float64 (sample deviation: ddof=1)."""
    d = np.array([row[s] - ref[s] for s in sorted(row) if s in ref], dtype=np.float64)
    return f"{d.mean():+.2f} ± {d.std(ddof=1):.2f} ({d.size})"


def test_compare_rows_pairs_each_row_with_the_reference_seed_by_seed(tmp_path, obow_cli):
    record = _record()
    text = compare_rows(record, "base", scores=("knn", "linear"))
    better = _cell({0: 33.5, 1: 34.4}, {0: 31.0, 1: 33.0})  # +1.95 ± 0.78: 2.5 and 1.4
    better_knn = _cell({0: 31.5, 1: 32.1}, {0: 30.0, 1: 31.0})  # +1.30 ± 0.28
    assert f"| BETTER | {better_knn} ahead | {better} ahead | +5.03 | holds |" in text
    # seed 2 of MIXED has no partner and is left out; kNN -1.0, +0.8 disagree; linear +1.0, -0.5 disagree
    mixed_knn = _cell({0: 29.0, 1: 31.8}, {0: 30.0, 1: 31.0})
    mixed_linear = _cell({0: 32.0, 1: 32.5}, {0: 31.0, 1: 33.0})
    assert f"| MIXED | {mixed_knn} level | {mixed_linear} level | -28.39 | not judged |" in text
    assert "| BASE |" not in text and "| UNRUN |" not in text and "RANDOM_INIT |" not in text
    # against random init: every row's gain; the random-init row has no paper number
    gains = compare_rows(record, "random_init", scores=("linear",))
    assert f"| BASE | {_cell({0: 31.0, 1: 33.0}, {0: 25.0, 1: 26.0})} ahead | - | - |" in gains
    with pytest.raises(ValueError, match="no measured row 'unrun'.*choose one of: random_init, base, better, mixed"):
        compare_rows(record, "unrun")
    with pytest.raises(ValueError, match="score 'fewshot_1' was not measured"):
        compare_rows(record, "base")  # the default asks for the few-shot scores too
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "table.json").write_text(json.dumps(record))
    out = obow_cli("tables", "paired", tmp_path / "t", "--against", "BASE", "--scores", "knn", "linear").out
    assert f"{better} ahead | +5.03 | holds |" in out


def test_paired_reads_a_committed_table_as_its_record_states():
    """Table 2 as committed: alpha 0 minus the default row, the numbers its README gives (kNN -0.07 ± 0.18)."""
    record = json.loads((RESULTS / "cifar10-table2" / "table.json").read_text())
    text = compare_rows(record, "alpha_0_99_1_cosine_lr_x1")
    assert compare_rows(record, "1") == text  # the row's number in `obow tables table2`
    line = next(line for line in text.splitlines() if line.startswith("| alpha 0.0, lr x1 |"))
    assert "| -0.07 ± 0.18 (2) level |" in line and line.endswith("| -28.39 | reversed |")
