"""One table against itself: at several budgets (``obow tables budgets``, :func:`compare_budgets`), with
changes (``obow tables levers``, :func:`compare_levers`), and row against row (``obow tables paired``,
:func:`compare_rows`), paired by seed so that the seed spread cancels."""

from __future__ import annotations

import statistics
from typing import Any

from obow.experiments.tables.catalog import TABLES, select_rows


def _scores_measured(record: dict[str, Any]) -> list[str]:
    """The numeric scores a table's runs hold (knn, linear, fewshot_1, ...), confidence intervals and k aside."""
    return sorted(
        {
            k
            for row in [record["random_init"], *record["rows"]]
            for run in row["runs"]
            for k, v in run["scores"].items()
            if isinstance(v, (int, float)) and not k.endswith(("_ci", "_k"))
        }
    )


def _same_steps(base: dict[str, Any], lever: dict[str, Any]) -> bool:
    """Whether every trained row of ``lever`` is a row of ``base`` trained for the same steps (each seed's)."""
    rows = [row for row in lever["rows"] if row.get("runs")]

    def steps(record: dict[str, Any], slug: str) -> set[Any]:
        row = _find_row(record, slug)
        return {run.get("steps") for run in row["runs"]} if row else set()

    return bool(rows) and all(len(steps(lever, r["slug"])) == 1 and steps(lever, r["slug"]) == steps(base, r["slug"])
                              for r in rows)  # fmt: skip


def _find_row(record: dict[str, Any], name: str) -> dict[str, Any] | None:
    """A row by label or folder name (slug); ``random_init`` names the random-init row."""
    return next((row for row in [record["random_init"], *record["rows"]] if name in (row["label"], row["slug"])), None)


def _by_seed(row: dict[str, Any] | None, score: str, seeds: set[int] | None = None) -> dict[int, float]:
    if row is None:
        return {}
    return {
        run["seed"]: run["scores"][score]
        for run in row["runs"]
        if (seeds is None or run["seed"] in seeds) and isinstance(run["scores"].get(score), (int, float))
    }


def _paired(a: dict[int, float], b: dict[int, float]) -> list[float]:
    """``a - b`` for every seed both hold: differences of the same seed, so the seed spread cancels."""
    return [a[s] - b[s] for s in sorted(a) if s in b]


def _signed_cell(values: list[float], signed: bool = True) -> str:
    """Mean ± sample deviation (number of values), or ``-`` for none."""
    if not values:
        return "-"
    mean = statistics.fmean(values)
    spread = f" ± {statistics.stdev(values):.2f}" if len(values) > 1 else ""
    return f"{mean:+.2f}{spread} ({len(values)})" if signed else f"{mean:.2f}{spread} ({len(values)})"


def _check_score(record: dict[str, Any], score: str) -> None:
    known = _scores_measured(record)
    if score not in known:
        raise ValueError(f"score {score!r} was not measured; choose one of: {', '.join(known)}")


def _default_versus(slugs: list[str], versus: tuple[str, str] | None) -> tuple[str, str] | None:
    if versus is None and {"obow_full", "moco_v2_our_aug"} <= set(slugs):
        return ("obow_full", "moco_v2_our_aug")
    return versus


def compare_budgets(records: list[dict[str, Any]], score: str = "knn", versus: tuple[str, str] | None = None) -> str:
    """One table measured at several ``--minutes`` budgets (its ``table.json`` records, each from its own
    ``--out``): every row's gain over the random init of the same seed (mean ± sample deviation over the seeds
    measured at every budget) at each budget, and for the pair ``versus`` (row labels or slugs; default OBoW (full)
    against MoCo v2 (our aug.) when the table has both) the gap per budget and where it would cross zero
    (:func:`obow.experiments.budget.crossing_budget`). Within one run the curve cannot answer that question:
    every run's learning-rate cosine ends at its own budget."""
    from obow.experiments.budget import crossing_budget

    if not records:
        raise ValueError("no tables to compare: give the table.json of each budget")
    first = records[0]
    for r in records:
        if "minutes" not in r["budget"]:
            raise ValueError(f"table {r['table']} was planned in epochs ({r['budget']}); compare --minutes tables")
        for key in ("table", "recipe", "train_images", "test_images", "overrides"):
            if r.get(key) != first.get(key):
                raise ValueError(f"tables differ in {key}: {first.get(key)!r} and {r.get(key)!r}; compare one table")
    _check_score(first, score)
    records = sorted(records, key=lambda r: r["budget"]["minutes"])
    minutes = [r["budget"]["minutes"] for r in records]
    if len(set(minutes)) != len(minutes):
        raise ValueError(f"two tables at the same budget ({minutes} minutes); give one table per budget")

    # seeds measured at every budget (random init included): a trend read from different seeds at different
    # budgets would mix the seed spread into it
    shared_seeds = set.intersection(*({run["seed"] for run in r["random_init"]["runs"]} for r in records))
    if not shared_seeds:
        raise ValueError("no seed has a random init row at every budget; run the same --seeds at each budget")

    slugs = list(dict.fromkeys(row["slug"] for r in records for row in r["rows"]))
    labels = {row["slug"]: row["label"] for r in records for row in r["rows"]}
    head = " | ".join(f"{m:g} min" for m in minutes)
    lines = [
        f"### {first['title']}: {score} gain over random init against budget",
        "",
        f"Recipe `{first['recipe']}`, {first['train_images']} training images; each cell: mean ± sample deviation "
        "over seeds of (row - random init of the same seed), number of seeds in brackets; only the seeds measured "
        f"at every budget count ({', '.join(map(str, sorted(shared_seeds)))}).",
        "",
        f"| row | {head} |",
        "|---|" + "---|" * len(minutes),
    ]
    for slug in slugs:
        cells = []
        for r in records:
            row = _find_row(r, slug)
            gains = _paired(_by_seed(row, score, shared_seeds), _by_seed(r["random_init"], score, shared_seeds))
            cells.append("-" if row is None else _signed_cell(gains))
        lines.append(f"| {labels[slug]} | {' | '.join(cells)} |")
    versus = _default_versus(slugs, versus)
    if versus is not None:
        a_name, b_name = versus
        gaps, at = [], []
        row_cells = []
        for r, m in zip(records, minutes, strict=True):
            values = _paired(
                _by_seed(_find_row(r, a_name), score, shared_seeds), _by_seed(_find_row(r, b_name), score, shared_seeds)
            )
            row_cells.append(_signed_cell(values))
            if values:
                gaps.append(statistics.fmean(values))
                at.append(m)
        a_label = next((labels[s] for s in slugs if a_name in (s, labels[s])), a_name)
        b_label = next((labels[s] for s in slugs if b_name in (s, labels[s])), b_name)
        lines.append(f"| gap: {a_label} - {b_label} | {' | '.join(row_cells)} |")
        lines.append("")
        if gaps:
            lines.append(crossing_budget(at, gaps).describe(a_label, b_label) + ".")
        else:
            lines.append(f"{a_label} and {b_label} were not both measured at any budget.")
    return "\n".join(lines) + "\n"


def compare_levers(records: list[dict[str, Any]], score: str = "knn", versus: tuple[str, str] | None = None) -> str:
    """One table at one budget, run as it is (``records[0]``, the base) and with levers (each later record: the
    same table, recipe, images and budget with other ``key=value`` changes for every row, each its own
    ``--out``). Per row and table: the score (mean ± sample deviation over seeds), and for a lever its change
    against the base *of the same seed*; then the gap between the rows ``versus`` (default OBoW (full) against
    MoCo v2 (our aug.)) in each table and its change against the base's gap; for a lever run on one of the two
    rows only, also that row against the other as the base ran it (seed by seed): the method at its lever
    against its rival as it is. A lever is tried on every row, so that whatever helps one method is given to
    the other too. A lever planned in epochs (``--budget``) whose every row has the base row's steps is compared
    too, at equal steps rather than equal time, and the table says so: how a change that makes a step cheaper
    (``train.precision=bf16``) is checked for quality before it buys more steps."""
    if len(records) < 2:
        raise ValueError("give the base table first and at least one lever table (each a table.json or its folder)")
    base = records[0]
    equal_steps = []  # levers planned in epochs (--budget) whose rows all have the base rows' steps
    for r in records[1:]:
        by_steps = r.get("budget") != base.get("budget") and "epochs" in r.get("budget", {}) and _same_steps(base, r)
        if by_steps:
            equal_steps.append(r)
        for key in ("table", "recipe", "train_images", "test_images", *(() if by_steps else ("budget",))):
            if r.get(key) != base.get(key):
                raise ValueError(
                    f"tables differ in {key}: {base.get(key)!r} and {r.get(key)!r}; a lever changes only key=value "
                    "settings (run it with the base's command and budget)"
                )
        if sorted(r.get("overrides", [])) == sorted(base.get("overrides", [])):
            raise ValueError(f"a lever table has the base's own settings {base.get('overrides', [])}: nothing changed")
    _check_score(base, score)

    def changes(r: dict[str, Any]) -> str:
        extra = [o for o in r.get("overrides", []) if o not in base.get("overrides", [])]
        gone = [o for o in base.get("overrides", []) if o not in r.get("overrides", [])]
        return ", ".join([*(f"`{o}`" for o in extra), *(f"without `{o}`" for o in gone)])

    def describe(values: dict[int, float], base_values: dict[int, float] | None) -> str:
        text = _signed_cell(list(values.values()), signed=False)
        if base_values is not None and values:
            text += f"; {_signed_cell(_paired(values, base_values))} vs base"
        return text

    slugs = ["random_init", *dict.fromkeys(row["slug"] for r in records for row in r["rows"])]
    labels = {"random_init": base["random_init"]["label"]}
    labels |= {row["slug"]: row["label"] for r in records for row in r["rows"]}
    base_name = ", ".join(f"`{o}`" for o in base.get("overrides", [])) or "the recipe as it is"
    budget = (
        f"{base['budget']['minutes']:g} minutes"
        if "minutes" in base["budget"]
        else f"{base['budget']['epochs']} epochs"
    )
    lines = [
        f"### {base['title']}: {score} with levers, {budget} per row and seed",
        "",
        f"Recipe `{base['recipe']}`, {base['train_images']} training images. Each cell: {score} mean ± sample "
        "deviation (seeds); for a lever, then its change against the base table's same row and seed (mean ± "
        "deviation over the seeds both measured). Base: " + base_name + ".",
        "",
        *(
            [
                "Levers at the base's steps, not its time (planned in epochs, every row with the base row's "
                "steps: a change that alters a step's cost compared at equal steps): "
                + "; ".join(changes(r) or "the recipe as it is" for r in equal_steps)
                + ".",
                "",
            ]
            if equal_steps
            else []
        ),
        "| row | base | " + " | ".join(changes(r) for r in records[1:]) + " |",
        "|---|---|" + "---|" * (len(records) - 1),
    ]
    for slug in slugs:
        base_values = _by_seed(_find_row(base, slug), score)
        cells = [describe(base_values, None)]
        cells += [describe(_by_seed(_find_row(r, slug), score), base_values) for r in records[1:]]
        if any(c != "-" for c in cells):
            lines.append(f"| {labels[slug]} | {' | '.join(cells)} |")
    versus = _default_versus(slugs, versus)
    if versus is not None:
        a_name, b_name = versus

        def gaps(r: dict[str, Any], r_b: dict[str, Any] | None = None) -> dict[int, float]:
            """Seed by seed, row ``a_name`` of ``r`` minus row ``b_name`` of ``r_b`` (default ``r``)."""
            a, b = _by_seed(_find_row(r, a_name), score), _by_seed(_find_row(r if r_b is None else r_b, b_name), score)
            return {s: a[s] - b[s] for s in a if s in b}

        base_gaps = gaps(base)
        cells = [_signed_cell(list(base_gaps.values()))]
        for r in records[1:]:
            lever_gaps = gaps(r)
            cell = _signed_cell(list(lever_gaps.values()))
            if lever_gaps and base_gaps:
                cell += f"; {_signed_cell(_paired(lever_gaps, base_gaps))} vs base"
            cells.append(cell)
        a_label, b_label = labels.get(a_name, a_name), labels.get(b_name, b_name)
        lines.append(f"| gap: {a_label} - {b_label} | {' | '.join(cells)} |")

        def mixed(r: dict[str, Any]) -> str:
            """A lever given to one of the two rows only, against the other row as the base ran it."""
            has_a, has_b = bool(_by_seed(_find_row(r, a_name), score)), bool(_by_seed(_find_row(r, b_name), score))
            if has_a == has_b:
                return "-"
            return _signed_cell(list(gaps(r if has_a else base, r if has_b else base).values()))

        cells = [mixed(r) for r in records[1:]]
        if any(c != "-" for c in cells):
            lines.append(
                f"| gap, the row a lever lacks as in the base: {a_label} - {b_label} | - | {' | '.join(cells)} |"
            )
    return "\n".join(lines) + "\n"


_SCORE_NAMES = {"knn": "kNN", "linear": "linear", "fewshot_1": "1-shot", "fewshot_5": "5-shot"}


def paired_verdict(values: list[float]) -> str:
    """What paired differences (one per seed) say: ``ahead`` or ``behind`` *beyond the spread* when every seed's
    difference has the same sign and the mean's size exceeds the sample deviation; ``level`` otherwise;
    ``one seed`` (not judged) below two seeds, ``-`` for none."""
    if not values:
        return "-"
    if len(values) < 2:
        return "one seed"
    mean, spread = statistics.fmean(values), statistics.stdev(values)
    same_sign = all(v > 0 for v in values) or all(v < 0 for v in values)
    if same_sign and abs(mean) > spread:
        return "ahead" if mean > 0 else "behind"
    return "level"


#: paper differences (linear points) below this are read as level in the paper: it reports one run per row
PAPER_LEVEL = 0.5


def paper_direction(verdict: str, paper_difference: float | None) -> str:
    """The paper's ordering at this budget: ``holds`` when the measured verdict is beyond the spread in the
    paper's direction, ``reversed`` when beyond it in the other, ``not judged`` when level or one seed;
    ``paper level`` when the paper's two rows differ by less than :data:`PAPER_LEVEL` (one run each: no
    ordering claimed), ``-`` when the paper has no number for one of them."""
    if paper_difference is None:
        return "-"
    if abs(paper_difference) < PAPER_LEVEL:
        return "paper level"
    if verdict not in ("ahead", "behind"):
        return "not judged"
    return "holds" if (verdict == "ahead") == (paper_difference > 0) else "reversed"


def compare_rows(
    record: dict[str, Any], against: str, scores: tuple[str, ...] = ("knn", "linear", "fewshot_1", "fewshot_5")
) -> str:
    """Every row of one table (``table.json``) minus the row ``against`` (label, folder name or the row's number
    in ``obow tables``; ``random_init`` gives each row's gain), paired by seed: per score the mean ± sample
    deviation of the per-seed differences and :func:`paired_verdict`; then the paper's difference for the same
    two rows on its linear probe and whether its ordering holds here (:func:`paper_direction`). This is the rule
    the results' verdicts use (``docs/results/README.md``): with two seeds, a difference counts only when both
    seeds agree and the mean exceeds the spread."""
    if against.isdigit() and record.get("table") in TABLES:  # the row's number in `obow tables`
        against = select_rows(TABLES[record["table"]], [against])[0].slug
    reference = _find_row(record, against)
    if reference is None or not reference.get("runs"):
        names = [row["slug"] for row in [record["random_init"], *record["rows"]] if row.get("runs")]
        raise ValueError(f"no measured row {against!r} in {record['table']}; choose one of: {', '.join(names)}")
    for score in scores:
        _check_score(record, score)
    paper_of = reference.get("paper", {}).get("linear")
    head = " | ".join(_SCORE_NAMES.get(s, s) for s in scores)
    lines = [
        f"### {record['title']}: each row minus {reference['label']}, paired by seed",
        "",
        "Each cell: mean ± sample deviation of (row - reference) over the seeds both measured (their number in "
        "brackets), then the verdict: ahead / behind when every seed agrees in sign and the mean exceeds the "
        "deviation (beyond the spread), level otherwise. Paper: the same difference in the paper's linear probe; "
        "its ordering holds, is reversed, or is not judged (level) in this table's linear probe; paper level: "
        f"the paper's rows differ by less than {PAPER_LEVEL:g} points (one run each), so it orders nothing.",
        "",
        f"| row | {head} | paper linear | paper's ordering |",
        "|---|" + "---|" * (len(scores) + 2),
    ]
    for row in record["rows"]:
        if row is reference or not row.get("runs"):
            continue
        cells, verdicts = [], {}
        for score in scores:
            values = _paired(_by_seed(row, score), _by_seed(reference, score))
            verdicts[score] = paired_verdict(values)
            cells.append("-" if not values else f"{_signed_cell(values)} {verdicts[score]}")
        paper_row = row.get("paper", {}).get("linear")
        paper_difference = None if paper_row is None or paper_of is None else paper_row - paper_of
        paper_cell = "-" if paper_difference is None else f"{paper_difference:+.2f}"
        ordering = paper_direction(verdicts.get("linear", "-"), paper_difference) if "linear" in scores else "-"
        lines.append(f"| {row['label']} | {' | '.join(cells)} | {paper_cell} | {ordering} |")
    return "\n".join(lines) + "\n"
