"""`obow tables`: every row of every table is a valid recipe, and a tiny real table run trains, evaluates,
writes its table and resumes without retraining."""

import json
import math
import os
import socket
import sys
from pathlib import Path

import pytest

from obow.config import load_config
from obow.experiments.budget import crossing_budget, plan_epochs, seconds_per_step, short_run_warmup
from obow.experiments.tables import (
    TABLES,
    aggregate,
    compare_budgets,
    compare_levers,
    curves_text,
    fill_placeholders,
    list_tables,
    markdown,
    monitor_curves,
    placeholders,
    select_rows,
    training_minutes,
)
from obow.experiments.tables.plan import table_pipeline, table_precision
from obow.experiments.tables.records import _shared_text, machine_description
from obow.training.run import precision as prec

sys.path.insert(0, str(Path(__file__).parent))
from conftest import TWO_LEVEL_RECIPE  # noqa: E402


def test_every_row_of_every_table_is_a_valid_recipe():
    base = load_config("cifar10_fast")
    values = placeholders(base, train_images=5000)
    assert values["moco_queue"] == 2432  # the largest multiple of 128 at most 2,500
    assert math.isclose(values["lr_x06"], 0.03) and values["teacher_size"] == 40
    for table in TABLES.values():
        for row in table.rows:
            for stage in row.plan():
                items = fill_placeholders(stage.overrides, values)
                if stage.teacher:
                    items.append("bownet.teacher=some/checkpoint.pt")
                cfg = load_config("cifar10_fast", items)
                # the row's change is really applied
                for item in items:
                    key, _, _ = item.partition("=")
                    section, name = key.split(".")
                    assert hasattr(getattr(cfg, section), name)
    one_224 = load_config("cifar10_fast", fill_placeholders(TABLES["table4"].rows[0].overrides, values))
    assert one_224.views.crop_size == one_224.views.teacher_size == 40 and one_224.views.num_patches == 0
    vanilla = load_config("cifar10_fast", fill_placeholders(TABLES["table3"].rows[1].overrides, values))
    assert vanilla.model.levels == ("conv5",) and vanilla.views.num_crops == 1 and vanilla.model.assignment == "hard"
    slow = load_config("cifar10_fast", fill_placeholders(TABLES["table2"].rows[-1].overrides, values))
    assert math.isclose(slow.optim.lr, 0.2 * base.optim.lr) and slow.model.teacher_momentum == 0.0
    assert "table5" in list_tables() and "MoCo v2 (our aug.)" in list_tables()


def test_select_rows_by_number_label_or_slug_and_clear_error():
    t = TABLES["table3"]
    assert [r.label for r in select_rows(t, ["1", "hard, dynamic", "soft_fixed"])] == [
        "soft, dynamic",
        "hard, dynamic",
        "soft, fixed",
    ]
    with pytest.raises(ValueError, match="table3 has no row 'nine'.*1 \\(soft_dynamic\\)"):
        select_rows(t, ["nine"])


def test_plan_epochs_fits_whole_epochs_in_the_minutes():
    # 25 min = 1,500 s; 4.5 s a step and 39 steps an epoch = 175.5 s an epoch -> 8.55 -> 8 whole epochs
    assert plan_epochs(25, 4.5, 39) == 8
    assert plan_epochs(25, 1.5, 39) == 25  # a step 3x cheaper: 25.6 -> 25 epochs
    assert plan_epochs(0.01, 4.5, 39) == 1  # never less than one epoch
    with pytest.raises(ValueError, match="seconds_per_step > 0"):
        plan_epochs(25, 0.0, 39)


def test_short_run_warmup_keeps_the_recipes_epochs_up_to_half_the_run():
    assert short_run_warmup(1.0, 8) == 1.0  # not scaled down with the run (the old rule: 1 * 8 / 15)
    assert short_run_warmup(10.0, 8) == 4.0  # a long recipe's warm-up: at most half the run
    assert short_run_warmup(1.0, 1) == 0.5
    assert short_run_warmup(0.0, 3) == 0.0
    with pytest.raises(ValueError, match="epochs must be >= 1"):
        short_run_warmup(1.0, 0)


def test_aggregate_is_the_mean_and_sample_deviation_over_seeds():
    runs = [
        {"seed": s, "scores": {"knn": v, "notes": []}, "steps": 4, "minutes": m}
        for s, v, m in ((0, 30.0, 1.0), (1, 34.0, 3.0), (2, 35.0, 2.0))
    ]
    row = aggregate("x", "x", {}, runs)
    assert row["mean"]["knn"] == pytest.approx(33.0)
    assert row["std"]["knn"] == pytest.approx(math.sqrt(((30 - 33) ** 2 + 1 + 4) / 2))  # n - 1 = 2
    assert row["minutes"] == pytest.approx(2.0) and row["steps"] == 4
    assert aggregate("x", "x", {}, runs[:1])["std"]["knn"] is None  # one seed: no spread claimed


def test_seconds_per_step_times_every_config_in_alternating_rounds(tmp_path, write_images):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TWO_LEVEL_RECIPE)
    write_images(tmp_path / "train", per_class=4, size=28)  # 3 batches of 8: the rounds wrap around the epoch
    base = [f"data.path={tmp_path / 'train'}"]
    configs = {
        "obow": load_config(recipe, base),
        "moco": load_config(recipe, [*base, "model.method=mocov2", "moco.queue_size=16"]),
    }
    timed = seconds_per_step(configs, rounds=2, block=2)
    assert set(timed) == {"obow", "moco"} and all(0 < t < 60 for t in timed.values())


def _tiny_table(tmp_path, write_images):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TWO_LEVEL_RECIPE)
    data = tmp_path / "data"
    write_images(data / "train", per_class=8, size=28)
    write_images(data / "test", per_class=6, size=28, seed=1)
    return recipe, data, tmp_path / "tables"


@pytest.mark.slow
def test_tiny_minutes_table_with_two_seeds_plans_trains_and_aggregates(tmp_path, write_images, obow_cli):
    recipe, data, out = _tiny_table(tmp_path, write_images)
    args = ["tables", "run", "table3", "--data", data, "--minutes", "0.001", "--recipe", recipe, "--out", out]
    printed = obow_cli(*args, "--rows", "4", "--seeds", "0", "1", "--k", "5", "--episodes", "5").out
    assert "| hard, fixed |" in printed and "seeds 0, 1" in printed

    plan = json.loads((out / "table3" / "plan.json").read_text())
    stage = plan["stages"]["hard_fixed/pretrain"]
    assert plan["budget"] == {"minutes": 0.001} and plan["steps_per_epoch"] == 2  # 16 images, batch 8
    assert stage["epochs"] == 1 and stage["warmup_epochs"] == 0.5 and stage["seconds_per_step"] > 0
    record = json.loads((out / "table3" / "table.json").read_text())
    (row,) = record["rows"]
    assert [r["seed"] for r in row["runs"]] == [0, 1] and [r["seed"] for r in record["random_init"]["runs"]] == [0, 1]
    knn = [r["scores"]["knn"] for r in row["runs"]]
    assert row["mean"]["knn"] == pytest.approx(sum(knn) / 2)
    assert row["std"]["knn"] == pytest.approx(abs(knn[0] - knn[1]) / math.sqrt(2))
    for seed in (0, 1):  # each seed is its own run, with its own seed
        saved = load_config(out / "table3" / "hard_fixed" / f"seed{seed}" / "config.yaml")
        assert saved.train.seed == seed and saved.optim.epochs == 1 and saved.optim.warmup_epochs == 0.5
        log_path = out / "table3" / "hard_fixed" / f"seed{seed}" / "log.jsonl"
        epoch_s = [
            r["epoch_time_s"] for r in map(json.loads, log_path.read_text().splitlines()) if r.get("type") == "epoch"
        ]
        assert len(epoch_s) == 1 and row["runs"][seed]["minutes"] == pytest.approx(epoch_s[0] / 60)  # train min
    assert (out / "table3" / "table.md").read_text() == markdown(record, TABLES["table3"].columns)

    # the folder's budget is fixed: another budget is refused, naming both
    with pytest.raises(
        ValueError, match="planned for 0.001 minutes a row and 2 steps an epoch; this call asks for 2 epochs and 2"
    ):
        from obow.experiments.tables import run_table

        run_table("table3", data, 2, recipe=str(recipe), out=out, rows=["4"], k=5, episodes=5)


def test_training_minutes_sum_the_epochs_across_resumes_and_stages(tmp_path):
    def log(path, records):
        path.mkdir(parents=True)
        (path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    run = tmp_path / "seed0"
    log(
        run / "first",
        [
            {"epoch": 1, "iteration": 1, "lr": 0.1},  # a step record: no time of its own
            {"type": "epoch", "epoch": 1, "iteration": 2, "epoch_time_s": 60.0},
            {"type": "epoch", "epoch": 2, "iteration": 4, "epoch_time_s": 100.0},
            {"type": "epoch", "epoch": 2, "iteration": 4, "epoch_time_s": 120.0},  # logged again after a resume
        ],
    )
    log(run / "second", [{"type": "epoch", "epoch": 1, "iteration": 2, "epoch_time_s": 30.0}])
    assert training_minutes(run) == pytest.approx((60 + 120 + 30) / 60)
    assert training_minutes(tmp_path / "nothing") is None


def test_plan_only_times_the_rows_and_trains_nothing_then_the_run_keeps_that_plan(tmp_path, write_images, obow_cli):
    recipe, data, out = _tiny_table(tmp_path, write_images)
    args = ["tables", "run", "table3", "--data", data, "--minutes", "0.001", "--recipe", recipe, "--out", out]
    printed = obow_cli(*args, "--rows", "4", "--plan-only").out
    folder = out / "table3"
    plan = json.loads((folder / "plan.json").read_text())
    assert json.loads(printed[: printed.rindex("}") + 1]) == plan and "without --plan-only" in printed
    assert set(plan["stages"]) == {"hard_fixed/pretrain"} and plan["stages"]["hard_fixed/pretrain"]["steps"] == 2
    assert sorted(p.name for p in folder.iterdir() if p.name != ".obow.lock") == ["plan.json"]  # nothing trained

    timed = plan["stages"]["hard_fixed/pretrain"]["seconds_per_step"]
    obow_cli(*args, "--rows", "4", "--k", "5", "--episodes", "5")  # trains with the plan, not a new timing
    assert json.loads((folder / "plan.json").read_text())["stages"]["hard_fixed/pretrain"]["seconds_per_step"] == timed
    record = json.loads((folder / "table.json").read_text())
    assert record["plan"] == plan and record["rows"][0]["runs"][0]["steps"] == 2


def test_timing_from_plans_a_second_budget_from_another_folders_timed_steps(tmp_path, write_images, obow_cli):
    recipe, data, out = _tiny_table(tmp_path, write_images)
    source = out / "first" / "table3"
    source.mkdir(parents=True)
    timed = {"minutes": 25.0}, {"hard_fixed/pretrain": {"epochs": 1, "seconds_per_step": 3.0, "steps": 2}}
    (source / "plan.json").write_text(json.dumps({"budget": timed[0], "steps_per_epoch": 2, "stages": timed[1]}))
    args = ["tables", "run", "table3", "--data", data, "--recipe", recipe, "--out", out / "second", "--plan-only"]
    obow_cli(*args, "--minutes", "0.5", "--rows", "1", "4", "--timing-from", source)
    plan = json.loads((out / "second" / "table3" / "plan.json").read_text())
    lent = plan["stages"]["hard_fixed/pretrain"]
    # 0.5 minutes at the lent 3.0 s a step, 2 steps an epoch: 30 / 6 = 5 epochs, no new timing
    assert plan["budget"] == {"minutes": 0.5} and lent["seconds_per_step"] == 3.0 and lent["epochs"] == 5
    assert plan["timing_from"] == {"hard_fixed/pretrain": str(source / "plan.json")}
    own = plan["stages"]["soft_dynamic/pretrain"]  # row 1 was not in the source folder: timed here
    assert 0 < own["seconds_per_step"] < 3.0
    (source / "plan.json").write_text(json.dumps({"budget": timed[0], "steps_per_epoch": 9, "stages": timed[1]}))
    other = obow_cli(*args[:-2], out / "third", "--plan-only", "--minutes", "1", "--timing-from", source, check=False)
    assert other.code == 2 and "9 steps an epoch, this table has 2" in other.err
    nowhere = obow_cli(*args[:-2], out / "third", "--plan-only", "--minutes", "1", "--timing-from", out, check=False)
    assert nowhere.code == 2 and "no plan.json there" in nowhere.err
    epochs = obow_cli(*args[:-2], out / "third", "--plan-only", "--budget", "2", "--timing-from", source, check=False)
    assert epochs.code == 2 and "--budget EPOCHS times nothing" in epochs.err


def test_time_against_plans_a_lever_that_changes_the_step_at_the_base_rows_seconds_times_the_ratio(
    tmp_path, write_images, obow_cli, monkeypatch
):
    """A lever that halves the batch (twice the steps an epoch) is timed in turns with the base row as the base
    table ran it, and planned at the base's seconds there x (its step here / the base's step here)."""
    from obow.experiments import budget

    recipe, data, out = _tiny_table(tmp_path, write_images)
    source = out / "base" / "table3"
    source.mkdir(parents=True)
    stage = {"epochs": 1, "warmup_epochs": 0.5, "seconds_per_step": 3.0, "steps": 2}
    (source / "plan.json").write_text(
        json.dumps({"budget": {"minutes": 0.5}, "steps_per_epoch": 2, "stages": {"hard_fixed/pretrain": stage}})
    )
    (source / "table.json").write_text(json.dumps({"overrides": ["model.kappa=2.5"]}))
    timed = []

    def fake_seconds(configs, rounds=3, block=4):  # the machine's timing, made exact for the arithmetic
        timed.append({name: (cfg.data.batch_size, cfg.model.kappa, cfg.train.threads) for name, cfg in configs.items()})
        return {name: (1.0 if "[as there]" in name else 0.4) for name in configs}

    monkeypatch.setattr(budget, "seconds_per_step", fake_seconds)
    args = ["tables", "run", "table3", "--data", data, "--recipe", recipe, "--out", out / "lever", "--plan-only"]
    obow_cli(*args, "--minutes", "0.5", "--rows", "4", "--time-against", source, "data.batch_size=4", "train.threads=1")
    plan = json.loads((out / "lever" / "table3" / "plan.json").read_text())
    # 16 images at batch 4: 4 steps an epoch; the base row as there (batch 8, kappa 2.5) and the lever in turns,
    # both on the lever's threads
    assert timed == [{"hard_fixed/pretrain [as there]": (8, 2.5, 1), "hard_fixed/pretrain": (4, 5.0, 1)}]
    lever = plan["stages"]["hard_fixed/pretrain"]
    assert plan["steps_per_epoch"] == 4 and lever["seconds_per_step"] == pytest.approx(3.0 * 0.4 / 1.0)
    # 30 s at 1.2 s a step, 4 steps an epoch: 6.25 -> 6 whole epochs (the base: 30 / 3 / 2 = 5 epochs of 2 steps)
    assert lever["epochs"] == 6 and lever["steps"] == 24
    record = plan["timing_against"]["hard_fixed/pretrain"]
    assert record["plan"] == str(source / "plan.json") and record["changes_there"] == ["model.kappa=2.5"]
    assert record["scale"] == pytest.approx(3.0) and record["base_seconds_per_step_here"] == 1.0
    assert f"Timed against `{source / 'plan.json'}`" in _shared_text(plan) and "`hard_fixed` x0.40" in _shared_text(
        plan
    )
    again = obow_cli(*args, "--minutes", "1", "--time-against", source, "data.batch_size=4", check=False)
    assert again.code == 2 and "a lever gets its base's budget" in again.err
    both = obow_cli(*args, "--minutes", "0.5", "--time-against", source, "--timing-from", source, check=False)
    assert both.code == 2 and "cannot be combined with --timing-from" in both.err
    epochs = obow_cli(*args, "--budget", "2", "--time-against", source, check=False)
    assert epochs.code == 2 and "--budget EPOCHS times nothing" in epochs.err
    nowhere = obow_cli(*args, "--minutes", "0.5", "--time-against", out, check=False)
    assert nowhere.code == 2 and "no plan.json there" in nowhere.err


@pytest.mark.slow
def test_shared_from_takes_the_rows_another_table_has_in_common_and_times_the_others_against_one(
    tmp_path, write_images, obow_cli
):
    """OBoW vanilla is Table 3's "soft, dynamic" and Table 2's first row: trained once, shown in both, with the
    same steps; Table 2's other rows are timed in turns with it and planned at the ratio of their step to its."""
    recipe, data, out = _tiny_table(tmp_path, write_images)
    common = ["--data", data, "--minutes", "0.001", "--recipe", recipe, "--k", "5", "--episodes", "5"]
    obow_cli("tables", "run", "table3", *common, "--out", out / "a", "--rows", "1")
    source = out / "a" / "table3"
    (source / "plan.json").write_text(  # as if timed on a slower day: 2 epochs of the 2-step epochs
        json.dumps(
            {
                "budget": {"minutes": 0.001},
                "steps_per_epoch": 2,
                "stages": {
                    "soft_dynamic/pretrain": {"epochs": 2, "warmup_epochs": 1.0, "seconds_per_step": 0.01, "steps": 4}
                },
            }
        )
    )
    first = json.loads((source / "table.json").read_text())
    args = ["tables", "run", "table2", *common, "--out", out / "b", "--shared-from", source]
    obow_cli(*args, "--rows", "1", "4", "--plan-only")
    folder = out / "b" / "table2"
    plan = json.loads((folder / "plan.json").read_text())
    shared, timed = plan["stages"]["alpha_0_99_1_cosine_lr_x1/pretrain"], plan["stages"]["alpha_0_9_lr_x1/pretrain"]
    assert shared == {"epochs": 2, "warmup_epochs": 1.0, "seconds_per_step": 0.01, "steps": 4}
    vanilla = "alpha_0_99_1_cosine_lr_x1/pretrain"
    assert plan["shared_from"] == {vanilla: f"{source / 'plan.json'}: soft_dynamic/pretrain"}
    anchor = plan["timing_anchor"]["alpha_0_9_lr_x1/pretrain"]
    assert anchor["anchor"] == vanilla and anchor["anchor_plan"] == str(source / "plan.json")
    # its seconds: its own timed step x (the anchor's seconds there / the anchor's timed step here)
    assert math.isclose(anchor["scale"], 0.01 / anchor["anchor_seconds_per_step_here"])
    assert math.isclose(timed["seconds_per_step"], anchor["seconds_per_step_here"] * anchor["scale"])
    assert timed["steps"] == timed["epochs"] * 2 == plan_epochs(0.001, timed["seconds_per_step"], 2) * 2
    # the shared row's and the random init's finished seeds are this table's, marked, and nothing was trained
    for mine, theirs in (("alpha_0_99_1_cosine_lr_x1", first["rows"][0]), ("random_init", first["random_init"])):
        result = json.loads((folder / mine / "seed0" / "result.json").read_text())
        assert result["scores"] == theirs["runs"][0]["scores"] and result["from"] == str(source / "table.json")
    assert not (folder / "alpha_0_99_1_cosine_lr_x1" / "seed0" / "checkpoint.pt").exists()

    printed = obow_cli(*args, "--rows", "1").out  # nothing left to train for row 1: the table is written
    record = json.loads((folder / "table.json").read_text())
    assert [r["label"] for r in record["rows"]] == ["alpha 0.99 -> 1 (cosine), lr x1"]
    assert record["rows"][0]["mean"] == first["rows"][0]["mean"]
    assert "Rows shared with another table" in printed and "`alpha_0_99_1_cosine_lr_x1` (= " in printed

    # a shared row not finished in its table is left to that table, not trained here as well
    unfinished = out / "e" / "table3"
    unfinished.mkdir(parents=True)
    (unfinished / "plan.json").write_text((source / "plan.json").read_text())
    (unfinished / "table.json").write_text(json.dumps({**first, "rows": []}))
    left = obow_cli(*args[:-4], "--out", out / "e", "--shared-from", unfinished, "--rows", "1")
    assert "not trained here, shared with the table" in left.err + left.out
    assert not (out / "e" / "table2" / "alpha_0_99_1_cosine_lr_x1").exists()
    assert json.loads((out / "e" / "table2" / "table.json").read_text())["rows"] == []

    # refused: the same table (that is --results-from), another protocol, a folder with no row in common
    same = obow_cli("tables", "run", "table3", *common, "--out", out / "c", "--shared-from", source, check=False)
    assert same.code == 2 and "continue it with --results-from" in same.err
    other = obow_cli(*args[:-4], "--episodes", "7", "--out", out / "c", "--shared-from", source, check=False)
    assert other.code == 2 and "its protocol" in other.err and "'episodes': 7" in other.err
    fixed = out / "d" / "table3"
    fixed.mkdir(parents=True)
    (fixed / "plan.json").write_text(
        json.dumps({**json.loads((source / "plan.json").read_text()), "stages": {"hard_fixed/pretrain": shared}})
    )
    (fixed / "table.json").write_text((source / "table.json").read_text())
    none = obow_cli(*args[:-4], "--out", out / "c", "--shared-from", fixed, "--plan-only", check=False)
    assert none.code == 2 and "no row of table2 has the configuration of a row planned" in none.err


def test_markdown_names_the_changes_made_to_every_row():
    record = {
        "table": "table3",
        "title": "T",
        "note": "n",
        "recipe": "r",
        "budget": {"epochs": 1},
        "train_images": 4,
        "test_images": 2,
        "protocol": {"k": 5, "temperature": 0.1, "episodes": 5},
        "seeds": [0],
        "rows": [],
        "random_init": aggregate("random init", "random_init", {}, []),
    }
    assert "Changes to the recipe" not in markdown({**record, "overrides": []}, ("linear",))
    text = markdown({**record, "overrides": ["model.teacher_momentum=0.9", "model.num_words=256"]}, ("linear",))
    assert "Changes to the recipe for every row: `model.teacher_momentum=0.9`, `model.num_words=256`." in text


@pytest.mark.slow
def test_tiny_table3_run_writes_the_table_and_resumes_without_retraining(tmp_path, write_images, obow_cli):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TWO_LEVEL_RECIPE)
    data = tmp_path / "data"
    write_images(data / "train", per_class=8, size=28)
    write_images(data / "test", per_class=6, size=28, seed=1)
    out = tmp_path / "tables"
    args = ["tables", "run", "table3", "--data", data, "--budget", "1", "--recipe", recipe, "--out", out]
    printed = obow_cli(*args, "--rows", "1", "4", "--k", "5", "--episodes", "10").out
    assert "| random init (same network) |" in printed and "| soft, dynamic | 42.11 | 62.44 | 45.86 |" in printed

    record = json.loads((out / "table3" / "table.json").read_text())
    assert [r["label"] for r in record["rows"]] == ["soft, dynamic", "hard, fixed"]
    for r in [record["random_init"], *record["rows"]]:
        s = r["runs"][0]["scores"]
        for key in ("knn", "linear", "fewshot_1", "fewshot_5", "effective_rank", "mean_cosine"):
            assert math.isfinite(s[key]), (r["label"], key)
        assert 0 <= s["knn"] <= 100 and 0 <= s["fewshot_1"] <= 100
    assert record["rows"][0]["steps"] == 2 and record["random_init"]["steps"] == 0  # 16 images / batch 8
    # each row trained with its own change
    saved = load_config(out / "table3" / "hard_fixed" / "seed0" / "config.yaml")
    assert (saved.model.assignment, saved.model.head, saved.model.levels) == ("hard", "fixed", ("conv5",))

    # resumable: finished rows are not retrained, a new row is added, the table keeps every finished row
    checkpoint = out / "table3" / "soft_dynamic" / "seed0" / "checkpoint.pt"
    stamp = checkpoint.stat().st_mtime_ns
    obow_cli(*args, "--rows", "soft_dynamic", "2", "--k", "5", "--episodes", "10")
    assert checkpoint.stat().st_mtime_ns == stamp
    record = json.loads((out / "table3" / "table.json").read_text())
    assert [r["label"] for r in record["rows"]] == ["soft, dynamic", "hard, dynamic", "hard, fixed"]
    text = (out / "table3" / "table.md").read_text()
    assert text == markdown(record, TABLES["table3"].columns) and text.count("\n| ") == 5


def test_results_from_continues_a_published_table_on_another_machine_without_retraining(
    tmp_path, write_images, obow_cli
):
    """A table is finished over several sessions on machines that share only the published table.json and
    plan.json: the run folders of the first machine are gone, its finished row seeds count, the plan is kept."""
    recipe, data, out = _tiny_table(tmp_path, write_images)
    args = ["tables", "run", "table3", "--data", data, "--budget", "1", "--recipe", recipe, "--k", "5"]
    obow_cli(*args, "--out", out / "first", "--rows", "4", "--episodes", "5")
    published = tmp_path / "published"  # what a session commits: the text files, not the run folders
    published.mkdir()
    for name in ("table.json", "plan.json"):
        (published / name).write_text((out / "first" / "table3" / name).read_text())
    source = json.loads((published / "table.json").read_text())
    # each run records where it trained; say the row's seed was trained on a GPU machine
    run = source["rows"][0]["runs"][0]
    assert (
        (run["device"], run["machine"])
        == ("cpu", machine_description())
        == (
            source["random_init"]["runs"][0]["device"],
            source["random_init"]["runs"][0]["machine"],
        )
    )
    run.update(device="cuda", machine="Some Xeon, 16 cores, NVIDIA H100 80GB HBM3; torch 2.11.0")
    (published / "table.json").write_text(json.dumps(source))

    printed = obow_cli(*args, "--out", out / "next", "--rows", "4", "--episodes", "5", "--results-from", published).out
    folder = out / "next" / "table3"
    assert not (folder / "hard_fixed" / "seed0" / "checkpoint.pt").exists()  # nothing trained again
    assert not (folder / "random_init" / "seed0" / "log.jsonl").exists()
    record = json.loads((folder / "table.json").read_text())
    assert [r["scores"] for r in record["rows"][0]["runs"]] == [r["scores"] for r in source["rows"][0]["runs"]]
    assert record["random_init"]["mean"] == source["random_init"]["mean"]
    assert record["rows"][0]["minutes"] == source["rows"][0]["minutes"]  # the first machine's training time
    assert record["continued_from"] == [str(published / "table.json")] and "Continued from" in printed
    label = record["rows"][0]["label"]  # only the run from another machine is named, with its device
    assert printed.count("Trained and evaluated on") == 1
    assert (
        f"Trained and evaluated on Some Xeon, 16 cores, NVIDIA H100 80GB HBM3; torch 2.11.0 (cuda): {label} seed 0."
        in printed
    )
    plan = json.loads((folder / "plan.json").read_text())
    assert plan["stages"] == source["plan"]["stages"] and plan["plan_from"] == str(published / "plan.json")

    # a different setting is refused, naming the key and both values
    wrong = obow_cli(
        *args, "--out", out / "third", "--episodes", "5", "--results-from", published, "model.kappa=6", check=False
    )
    assert wrong.code == 2 and "its overrides is []" in wrong.err and "model.kappa=6" in wrong.err
    fewer = obow_cli(*args, "--out", out / "third", "--episodes", "7", "--results-from", published, check=False)
    assert fewer.code == 2 and "its protocol" in fewer.err and "'episodes': 7" in fewer.err
    nothing = obow_cli(*args, "--out", out / "third", "--results-from", tmp_path, check=False)
    assert nothing.code == 2 and "needs table.json and plan.json" in nothing.err


@pytest.mark.slow
def test_a_table_keeps_the_precision_it_was_planned_at_on_any_machine(tmp_path, write_images, obow_cli, monkeypatch):
    """Rows are compared only at one precision: a table's plan.json records it, and a machine that would choose
    another for train.precision=auto (bf16 where native) continues the table at the plan's."""
    monkeypatch.setattr(prec, "native_bf16", lambda device: True)  # this machine would choose bf16
    new, legacy, other = tmp_path / "new", tmp_path / "legacy", tmp_path / "other"
    assert table_precision(new, "auto", "cpu", [None]) == "bf16"  # a new table: the machine's choice
    assert table_precision(new, "fp32", "cpu", [None]) == "fp32"  # or what the call asks for
    for folder, plan in ((legacy, {"stages": {}}), (other, {"precision": "bf16", "stages": {}})):
        folder.mkdir()
        (folder / "plan.json").write_text(json.dumps(plan))
    assert table_precision(legacy, "auto", "cpu", [None]) == "fp32"  # plans written before the key: all fp32
    assert table_precision(new, "auto", "cpu", [other, None]) == "bf16"  # continued or shared from a bf16 plan
    with pytest.raises(ValueError, match="planned at train.precision=fp32, this call asks for bf16"):
        table_precision(legacy, "bf16", "cpu", [None])
    with pytest.raises(
        ValueError,
        match="different train.precision values.*legacy/plan.json: fp32.*other/plan.json: bf16",
    ):
        table_precision(legacy, "auto", "cpu", [other])

    # a real (tiny) table, its recipe asking for auto: the plan records the choice, every run trains at it, and
    # a folder planned before the key existed keeps training in fp32 on this bf16 machine
    recipe, data, out = _tiny_table(tmp_path, write_images)
    args = ["tables", "run", "table3", "--data", data, "--budget", "1", "--recipe", recipe, "--rows", "4"]
    args += ["--k", "5", "--episodes", "5", "train.precision=auto"]
    obow_cli(*args, "--out", out / "auto")
    assert json.loads((out / "auto" / "table3" / "plan.json").read_text())["precision"] == "bf16"
    assert load_config(out / "auto" / "table3" / "hard_fixed" / "seed0" / "config.yaml").train.precision == "bf16"
    assert "Every run trained with `train.precision=bf16`" in (out / "auto" / "table3" / "table.md").read_text()
    old = out / "old" / "table3"
    old.mkdir(parents=True)
    planned = json.loads((out / "auto" / "table3" / "plan.json").read_text())
    (old / "plan.json").write_text(json.dumps({k: v for k, v in planned.items() if k != "precision"}))
    obow_cli(*args, "--out", out / "old")
    assert json.loads((old / "plan.json").read_text())["precision"] == "fp32"
    assert load_config(old / "hard_fixed" / "seed0" / "config.yaml").train.precision == "fp32"
    assert "Every run trained with" not in (old / "table.md").read_text()  # as every table before the key


def test_a_table_keeps_the_data_pipeline_it_was_planned_with_on_any_machine(tmp_path, write_images, obow_cli):
    """As the precision: a table begun in loader workers (a CPU's auto, and every plan before the key) goes on in
    loader workers on a machine where auto means the device pipeline (a GPU), and says so in its plan."""
    new, legacy, other = tmp_path / "new", tmp_path / "legacy", tmp_path / "other"
    assert table_pipeline(new, "auto", "cpu", [None]) == "workers"  # a new table: the machine's choice
    assert table_pipeline(new, "auto", "cuda", [None]) == "device"
    assert table_pipeline(new, "device", "cpu", [None]) == "device"  # or what the call asks for
    for folder, plan in ((legacy, {"stages": {}}), (other, {"pipeline": "device", "stages": {}})):
        folder.mkdir()
        (folder / "plan.json").write_text(json.dumps(plan))
    assert table_pipeline(legacy, "auto", "cuda", [None]) == "workers"  # plans written before the key
    assert table_pipeline(new, "auto", "cpu", [other, None]) == "device"  # continued or shared from a device plan
    with pytest.raises(ValueError, match="planned at data.pipeline=workers, this call asks for device"):
        table_pipeline(legacy, "device", "cuda", [None])
    with pytest.raises(ValueError, match="different data.pipeline values.*legacy/plan.json: workers.*other/plan"):
        table_pipeline(legacy, "auto", "cpu", [other])

    recipe, data, out = _tiny_table(tmp_path, write_images)
    args = ["tables", "run", "table3", "--data", data, "--budget", "1", "--recipe", recipe, "--rows", "4"]
    args += ["--k", "5", "--episodes", "5", "data.pipeline=device", f"data.cache_dir={tmp_path / 'cache'}"]
    obow_cli(*args, "--out", out)
    assert json.loads((out / "table3" / "plan.json").read_text())["pipeline"] == "device"
    assert load_config(out / "table3" / "hard_fixed" / "seed0" / "config.yaml").data.pipeline == "device"
    assert "Every run made its views with `data.pipeline=device`" in (out / "table3" / "table.md").read_text()


def test_crossing_budget_reads_the_gap_as_a_line_in_log_minutes():
    # hand-worked: the gap closes by one point per doubling, -2 at 10 minutes, so it is zero at 40 minutes
    c = crossing_budget([10, 20], [-2.0, -1.0])
    assert c.verdict == "crossing" and c.change_per_doubling == pytest.approx(1.0)
    assert c.minutes == pytest.approx(40.0) and c.gap_at_largest == -1.0
    assert "near 40 minutes" in c.describe("OBoW", "MoCo")
    # three noisy budgets: least squares in log2(minutes), checked against numpy's fit
    np = pytest.importorskip("numpy")
    minutes, gap = [6.25, 12.5, 50.0], [-3.0, -2.5, -0.4]
    slope, intercept = np.polyfit(np.log2(minutes), gap, 1)
    c = crossing_budget(minutes, gap)
    assert c.change_per_doubling == pytest.approx(slope) and c.minutes == pytest.approx(2 ** (-intercept / slope))
    assert crossing_budget([10, 20], [-1.0, -2.0]).verdict == "not closing"  # widening: no crossing claimed
    assert crossing_budget([10, 20], [-1.0, -2.0]).minutes is None
    assert crossing_budget([10, 20], [-1.0, 0.5]).verdict == "ahead"
    one = crossing_budget([25], [-1.2])
    assert one.verdict == "one budget" and one.change_per_doubling is None and "second budget" in one.describe("a", "b")
    with pytest.raises(ValueError, match="positive"):
        crossing_budget([0, 10], [1.0, 2.0])
    with pytest.raises(ValueError, match="one gap per budget"):
        crossing_budget([10, 20], [1.0])


def _budget_record(minutes: float, scores: dict[str, dict[int, float]], **extra) -> dict:
    """A table.json record with the given knn per row slug and seed (``random_init`` among them)."""

    def row(slug: str) -> dict:
        runs = [{"seed": s, "scores": {"knn": v}, "steps": 1, "minutes": minutes} for s, v in scores[slug].items()]
        return aggregate(slug.upper(), slug, {}, runs)

    return {
        "table": "mocov2",
        "title": "T",
        "recipe": "r",
        "train_images": 10,
        "test_images": 5,
        "overrides": [],
        "budget": {"minutes": minutes},
        "random_init": row("random_init"),
        "rows": [row(s) for s in scores if s != "random_init"],
        **extra,
    }


def test_compare_budgets_pairs_seeds_and_extrapolates_the_gap(tmp_path, obow_cli):
    short = _budget_record(
        10, {"random_init": {0: 20.0, 1: 24.0}, "obow_full": {0: 23.0, 1: 27.0}, "moco_v2_our_aug": {0: 25.0, 1: 29.0}}
    )
    long = _budget_record(
        20, {"random_init": {0: 20.0, 1: 24.0}, "obow_full": {0: 26.0, 1: 29.0}, "moco_v2_our_aug": {0: 27.0, 1: 30.0}}
    )
    text = compare_budgets([long, short])  # any order: sorted by budget
    assert "| row | 10 min | 20 min |" in text
    assert "| OBOW_FULL | +3.00 ± 0.00 (2) | +5.50 ± 0.71 (2) |" in text  # gains 3, 3 then 6, 5: paired by seed
    assert "| gap: OBOW_FULL - MOCO_V2_OUR_AUG | -2.00 ± 0.00 (2) | -1.00 ± 0.00 (2) |" in text
    assert "+1.00 per doubling" in text and "near 40 minutes" in text
    assert "-1.00 at the largest budget" in compare_budgets([short, long], versus=("obow_full", "MOCO_V2_OUR_AUG"))
    # one seed of a row missing at one budget: only the seeds measured in both count
    partial = _budget_record(
        20, {"random_init": {0: 20.0, 1: 24.0}, "obow_full": {1: 29.0}, "moco_v2_our_aug": {0: 27.0, 1: 30.0}}
    )
    assert "| OBOW_FULL | +3.00 ± 0.00 (2) | +5.00 (1) |" in compare_budgets([short, partial])
    # a budget measured at one seed only: the other budget's second seed is left out of the trend, not mixed in
    one_seed = _budget_record(20, {"random_init": {0: 20.0}, "obow_full": {0: 26.0}, "moco_v2_our_aug": {0: 27.0}})
    text = compare_budgets([short, one_seed])
    assert "measured at every budget count (0)" in text and "| OBOW_FULL | +3.00 (1) | +6.00 (1) |" in text
    with pytest.raises(ValueError, match="no seed has a random init row at every budget"):
        compare_budgets([short, _budget_record(20, {"random_init": {5: 1.0}, "obow_full": {5: 2.0}})])
    with pytest.raises(ValueError, match="differ in overrides"):
        compare_budgets([short, {**long, "overrides": ["model.teacher_momentum=0.9"]}])
    with pytest.raises(ValueError, match="same budget"):
        compare_budgets([short, short])
    with pytest.raises(ValueError, match="planned in epochs"):
        compare_budgets([short, {**long, "budget": {"epochs": 3}}])
    with pytest.raises(ValueError, match="choose one of: knn"):
        compare_budgets([short, long], score="linear")
    # the command reads each budget's table.json (or its folder)
    for name, record in (("a", short), ("b", long)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "table.json").write_text(json.dumps(record))
    out = obow_cli("tables", "budgets", tmp_path / "a", tmp_path / "b" / "table.json").out
    assert "near 40 minutes" in out
    missing = obow_cli("tables", "budgets", tmp_path / "nowhere", check=False)
    assert missing.code == 2 and "no table.json" in missing.err


def test_compare_levers_pairs_each_row_with_the_base_of_the_same_seed(tmp_path, obow_cli):
    scores = {"random_init": {0: 20.0, 1: 24.0}, "obow_full": {0: 23.0, 1: 27.0}, "moco_v2_our_aug": {0: 25.0, 1: 30.0}}
    base = _budget_record(25, scores)
    lever = _budget_record(
        25,
        {"random_init": {0: 20.0}, "obow_full": {0: 26.0, 1: 28.0}, "moco_v2_our_aug": {0: 25.5}},
        overrides=["views.num_patches=0"],
    )
    text = compare_levers([base, lever])
    assert "knn with levers, 25 minutes per row and seed" in text
    assert "| row | base | `views.num_patches=0` |" in text
    assert "| RANDOM_INIT | 22.00 ± 2.83 (2) | 20.00 (1); +0.00 (1) vs base |" in text
    # OBoW: 26 - 23 and 28 - 27, paired by seed
    assert "| OBOW_FULL | 25.00 ± 2.83 (2) | 27.00 ± 1.41 (2); +2.00 ± 1.41 (2) vs base |" in text
    assert "| MOCO_V2_OUR_AUG | 27.50 ± 3.54 (2) | 25.50 (1); +0.50 (1) vs base |" in text
    # gap per seed: base -2, -3; lever seed 0: 26 - 25.5 = +0.5, i.e. +2.5 against the base's seed 0
    assert "| gap: OBOW_FULL - MOCO_V2_OUR_AUG | -2.50 ± 0.71 (2) | +0.50 (1); +2.50 (1) vs base |" in text
    # a lever the other method did not get shows as a missing cell, not as a comparison
    only_obow = _budget_record(
        25, {"random_init": {0: 20.0}, "obow_full": {0: 24.0}}, overrides=["model.teacher_momentum=0.9"]
    )
    text = compare_levers([base, lever, only_obow], versus=("obow_full", "moco_v2_our_aug"))
    assert "| MOCO_V2_OUR_AUG | 27.50 ± 3.54 (2) | 25.50 (1); +0.50 (1) vs base | - |" in text
    assert "| gap: OBOW_FULL - MOCO_V2_OUR_AUG | -2.50 ± 0.71 (2) | +0.50 (1); +2.50 (1) vs base | - |" in text
    # the OBoW-only lever against MoCo as the base ran it: seed 0, 24 - 25
    assert text.rstrip().endswith(
        "| gap, the row a lever lacks as in the base: OBOW_FULL - MOCO_V2_OUR_AUG | - | - | -1.00 (1) |"
    )
    assert "lacks as in the base" not in compare_levers([base, lever])  # both rows ran the lever
    with pytest.raises(ValueError, match="differ in budget"):
        compare_levers([base, {**lever, "budget": {"minutes": 12.5}}])
    # a lever planned in epochs whose rows have the base rows' steps (e.g. another precision: a cheaper step
    # compared at equal steps) is compared, and said to be at equal steps
    steps = {**lever, "budget": {"epochs": 3}, "overrides": ["train.precision=bf16"]}
    text = compare_levers([base, steps])
    assert "Levers at the base's steps, not its time" in text and "`train.precision=bf16`." in text
    assert "| OBOW_FULL | 25.00 ± 2.83 (2) | 27.00 ± 1.41 (2); +2.00 ± 1.41 (2) vs base |" in text
    other = {**steps, "rows": [{**row, "runs": [{**run, "steps": 2} for run in row["runs"]]} for row in lever["rows"]]}
    with pytest.raises(ValueError, match="differ in budget"):  # other steps: neither equal time nor equal steps
        compare_levers([base, other])
    with pytest.raises(ValueError, match="nothing changed"):
        compare_levers([base, base])
    with pytest.raises(ValueError, match="base table first and at least one lever"):
        compare_levers([base])
    with pytest.raises(ValueError, match="choose one of: knn"):
        compare_levers([base, lever], score="linear")
    for name, record in (("base", base), ("lever", lever)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "table.json").write_text(json.dumps(record))
    out = obow_cli("tables", "levers", tmp_path / "base", tmp_path / "lever" / "table.json").out
    assert "+2.50 (1) vs base" in out


@pytest.mark.slow
def test_status_reads_each_row_and_seed_from_the_folder_and_sums_the_minutes_left(
    tmp_path, write_images, obow_cli, make_checkpoint
):
    recipe, data, out = _tiny_table(tmp_path, write_images)
    source = out / "timed" / "table3"
    source.mkdir(parents=True)
    timed = {
        key: {"epochs": 1, "seconds_per_step": 3.0, "steps": 2}
        for key in ("soft_dynamic/pretrain", "hard_fixed/pretrain")
    }
    (source / "plan.json").write_text(json.dumps({"budget": {"minutes": 25.0}, "steps_per_epoch": 2, "stages": timed}))
    args = ["tables", "run", "table3", "--data", data, "--recipe", recipe, "--out", out, "--minutes", "0.1"]
    # 0.1 minutes at the lent 3.0 s a step: 2 steps (one epoch) a row, no timing on this machine
    obow_cli(*args, "--rows", "1", "4", "--plan-only", "--timing-from", source)
    obow_cli(*args, "--rows", "4", "--seeds", "0", "--k", "5", "--episodes", "5")  # row 4, seed 0: trained
    folder = out / "table3"
    make_checkpoint(folder / "soft_dynamic" / "seed0" / "checkpoint.pt", iteration=1)  # stopped after 1 step
    running = folder / "soft_dynamic" / "seed1"  # a live process (this one) holds seed 1 of row 1
    running.mkdir(parents=True)
    (running / ".obow.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))

    text = obow_cli("tables", "status", folder).out
    assert "| random init | 0 | done | - | - |" in text and "| random init | 1 | not evaluated | - | - |" in text
    assert "| soft, dynamic | 0 | stopped at iteration 1 of 2 | 1 / 2 | 0.1 |" in text  # 1 step x 3 s = 0.05 min
    assert "| hard, fixed | 0 | done | 2 / 2 | 0.0 |" in text
    assert "| soft, dynamic | 1 | running, iteration 0 of 2 | 0 / 2 | 0.1 |" in text
    assert "| hard, fixed | 1 | not started | 0 / 2 | 0.1 |" in text
    # (1 + 2 + 2) steps x 3 s = 0.25 min; three runs and one random init still to do
    assert "Left: 4 runs to finish or evaluate, about 0.2 minutes of training" in text
    assert "Being run now" not in text  # the table folder's own lock was released at the end of the run
    only = obow_cli("tables", "status", folder, "--seeds", "0").out
    assert "| 1 |" not in only and "Left: 1 run to finish" in only

    (running / ".obow.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": 2**22 + 7}))
    assert "| soft, dynamic | 1 | not started | 0 / 2 | 0.1 |" in obow_cli("tables", "status", folder).out  # dead
    for wrong, message in ((out, "no plan.json in"), (source.parent, "no plan.json in")):
        result = obow_cli("tables", "status", wrong, check=False)
        assert result.code == 2 and message in result.err
    renamed = tmp_path / "not_a_table"
    renamed.mkdir()
    (renamed / "plan.json").write_text((folder / "plan.json").read_text())
    result = obow_cli("tables", "status", renamed, check=False)
    assert result.code == 2 and "not named after a table" in result.err


def test_curves_are_the_monitor_points_of_the_runs_logs_at_equal_steps_and_planned_minutes(
    tmp_path, write_images, obow_cli
):
    recipe, data, out = _tiny_table(tmp_path, write_images)
    args = ["tables", "run", "table3", "--data", data, "--recipe", recipe, "--out", out, "--budget", "2"]
    obow_cli(*args, "--rows", "4", "--curve-every", "1", "--k", "5", "--episodes", "5")
    folder = out / "table3"
    logged = [json.loads(line) for line in (folder / "hard_fixed" / "seed0" / "log.jsonl").read_text().splitlines()]
    expected = {r["iteration"]: r["knn_top1"] for r in logged if r.get("type") == "epoch"}
    assert sorted(expected) == [2, 4] and monitor_curves(folder) == {"hard, fixed": {0: expected}}
    assert "| hard, fixed | 2 | - | " in obow_cli("tables", "curves", folder).out  # epochs budget: no timed step

    # hand-worked: two rows, two seeds, seed 1 of row 1 stopped early; 3.0 s a step for row 1, 6.0 for row 4
    hand = tmp_path / "hand" / "table3"
    plan = {"budget": {"minutes": 1}, "steps_per_epoch": 2}
    plan["stages"] = {
        "soft_dynamic/pretrain": {"seconds_per_step": 3.0},
        "hard_fixed/pretrain": {"seconds_per_step": 6.0},
    }
    points = {("soft_dynamic", 0): {10: 30.0, 20: 32.0}, ("soft_dynamic", 1): {10: 31.0}, ("hard_fixed", 0): {20: 40.0}}
    for (slug, seed), knn in points.items():
        run = hand / slug / f"seed{seed}"
        run.mkdir(parents=True)
        records = [{"iteration": 5, "loss": 1.0}]  # a step record: not a monitor point
        records += [{"type": "epoch", "iteration": it, "knn_top1": v} for it, v in knn.items()]
        records.append({"type": "epoch", "iteration": 25, "loss": 1.0})  # an epoch without the monitor
        (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (hand / "plan.json").write_text(json.dumps(plan))
    text = curves_text(hand)
    assert "| row | step 20 |" in text  # 10 is not monitored by row 4
    assert "| soft, dynamic | 32.00 (1) |" in text and "| hard, fixed | 40.00 (1) |" in text  # of 2 seeds
    assert "| soft, dynamic | 10 | 0.5 | 30.50 |" in text  # mean of 30 and 31; 10 steps x 3 s
    assert "| soft, dynamic | 20 | 1.0 | 32.00 (1) |" in text and "| hard, fixed | 20 | 2.0 | 40.00 (1) |" in text
    assert monitor_curves(hand, seeds=[1]) == {"soft, dynamic": {1: {10: 31.0}}}
    with pytest.raises(ValueError, match="no kNN monitor points"):
        curves_text(hand, seeds=[7])
    with pytest.raises(ValueError, match="no plan.json in"):
        monitor_curves(tmp_path / "hand")


def test_jobs_must_be_a_whole_number_of_processes(tmp_path, write_images, obow_cli):
    recipe, data, out = _tiny_table(tmp_path, write_images)
    args = ["tables", "run", "table3", "--data", data, "--budget", "1", "--recipe", recipe, "--out", out]
    wrong = obow_cli(*args, "--jobs", "0", check=False)
    assert wrong.code == 2 and "--jobs must be a whole number >= 1, got 0" in wrong.err
    assert not (out / "table3").exists()  # refused before anything is written


def test_a_batch_larger_than_the_images_is_refused_before_anything_is_written_and_the_corrected_call_runs(
    tmp_path, write_images, obow_cli
):
    recipe, data, out = _tiny_table(tmp_path, write_images)
    args = ["tables", "run", "table3", "--data", data, "--budget", "1", "--recipe", recipe, "--out", out]
    args += ["--per-class", "2", "--rows", "1", "--k", "5", "--episodes", "5"]  # 4 training images, batch 8
    wrong = obow_cli(*args, check=False)
    assert wrong.code == 2 and "Traceback" not in wrong.err
    (line,) = [x for x in wrong.err.splitlines() if x.startswith("obow: error: ")]
    assert "row 'soft, dynamic' trains with data.batch_size=8, more than the 4 training images" in line
    assert "data.batch_size=2" in line and "nothing was written" in line
    assert not out.exists()  # no plan.json, no random-init result: nothing for the corrected call to meet
    obow_cli(*args, "data.batch_size=2")  # the corrected call is not refused
    assert json.loads((out / "table3" / "plan.json").read_text())["steps_per_epoch"] == 2


@pytest.mark.slow
def test_jobs_train_the_row_seeds_in_parallel_processes_with_the_same_results(tmp_path, write_images, obow_cli):
    """``--jobs 2``: the random inits and rows of two seeds run two at a time in their own processes, one
    thread each, and give the same scores and steps as the same table run one task after another."""
    import torch

    recipe, data, out = _tiny_table(tmp_path, write_images)
    args = ["tables", "run", "table3", "--data", data, "--budget", "1", "--recipe", recipe, "--rows", "4"]
    args += ["--seeds", "0", "1", "--k", "5", "--episodes", "5", "train.threads=1"]
    printed = obow_cli(*args, "--out", out / "parallel", "--jobs", "2")
    assert "seeds 0, 1" in printed.out
    assert printed.err.count("started ") == 4 and "(process " in printed.err  # 2 seeds x (random init + row)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # the evaluation's threads, as in the jobs' processes
    try:
        obow_cli(*args, "--out", out / "serial")
    finally:
        torch.set_num_threads(previous)
    parallel, serial = (json.loads((out / f / "table3" / "table.json").read_text()) for f in ("parallel", "serial"))
    for key in ("random_init", "rows"):
        rows_p, rows_s = (r[key] if key == "rows" else [r[key]] for r in (parallel, serial))
        for a, b in zip(rows_p, rows_s, strict=True):
            assert [(r["seed"], r["steps"], r["scores"]) for r in a["runs"]] == [
                (r["seed"], r["steps"], r["scores"]) for r in b["runs"]
            ]
    pids = set()
    for seed in (0, 1):
        saved = load_config(out / "parallel" / "table3" / "hard_fixed" / f"seed{seed}" / "config.yaml")
        assert saved.train.threads == 1 and saved.train.seed == seed
    for line in printed.err.splitlines():
        if "(process " in line:
            pids.add(line.split("(process ")[1].split(",")[0])
    assert len(pids) == 4  # a fresh process for each task


def _wait_for_a_signal(seconds: float, threads: int) -> None:
    """A ``--jobs`` process's body for the test below: it does nothing until signalled (SIGTERM ends it)."""
    import time

    time.sleep(seconds)


def test_a_signal_that_comes_while_a_jobs_task_is_being_started_starts_nothing_more(caplog):
    """A SIGTERM that arrives while the next ``--jobs`` process is being prepared (seen on a real run: the
    process started two seconds after the signal and trained to its end, never sent it) starts no more: the
    running process is sent the signal and :class:`Interrupted` is raised at once."""
    import signal
    import time

    from obow.experiments.tables.run import Task, run_in_processes
    from obow.training.loop import Interrupted

    def arguments(task: Task) -> float:
        if task.seed == 1:  # the signal arrives while the second process's arguments are being built
            os.kill(os.getpid(), signal.SIGTERM)
        return 60.0

    done = []
    start = time.monotonic()
    with caplog.at_level("INFO", logger="obow"), pytest.raises(Interrupted):
        run_in_processes([Task(None, 0), Task(None, 1)], 2, 1, arguments, done.append, target=_wait_for_a_signal)
    assert caplog.text.count("started ") == 1 and "started random init, seed 0" in caplog.text
    assert done == []  # the first process ended by the signal, not by finishing
    assert time.monotonic() - start < 50  # not the 60 s sleep: the running process got the signal
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are put back


def test_a_signal_outside_training_stops_an_in_process_table_with_its_message_and_exit_code(caplog):
    """``--jobs 1``: a SIGTERM that comes outside training (here during the first task's evaluation stand-in)
    stops at once with :class:`Interrupted` (exit code 143, a message saying what is kept): the task under way
    is not reported finished and no later task starts. Before, it killed the command by the default handler
    ("Terminated", no message) when it came between two runs."""
    import signal

    from obow.experiments.tables.run import Task, run_in_order
    from obow.training.loop import Interrupted

    started, done = [], []

    def body(task: Task) -> None:
        started.append(task.seed)
        if task.seed == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            raise AssertionError("the signal did not stop the task")  # pragma: no cover

    tasks = [Task(None, 0), Task(None, 1), Task(None, 2)]
    with caplog.at_level("INFO", logger="obow"), pytest.raises(Interrupted) as err:
        run_in_order(tasks, body, done.append)
    assert err.value.exit_code == 128 + signal.SIGTERM
    assert started == [0, 1] and [t.seed for t in done] == [0]
    assert "SIGTERM outside training: stopping now, no new task starts" in caplog.text
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are put back


@pytest.mark.slow
def test_sigterm_to_a_jobs_table_stops_every_process_at_a_checkpoint_and_the_command_resumes(tmp_path, write_images):
    """A scheduler's SIGTERM to ``obow tables run --jobs 2`` reaches both training processes: each writes a
    checkpoint and stops (each with a loader worker, which ignores SIGTERM and must not keep its process
    alive), the command exits 143 with no result written, and the same command finishes."""
    import signal
    import subprocess
    import sys
    import time

    recipe, data, out = _tiny_table(tmp_path, write_images)
    args = [sys.executable, "-m", "obow.cli", "tables", "run", "table3", "--data", str(data), "--budget", "30"]
    args += ["--recipe", str(recipe), "--rows", "4", "--seeds", "0", "1", "--k", "5", "--episodes", "5"]
    args += ["--out", str(out), "--jobs", "2", "train.threads=1", "data.num_workers=1"]  # a real loader worker
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    runs = [out / "table3" / "hard_fixed" / f"seed{seed}" for seed in (0, 1)]
    # seed 0's random init and row start first; seed 1's random init follows the random init
    deadline = time.time() + 240
    while time.time() < deadline and not (runs[0] / "checkpoint.pt").exists():
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "SIGTERM: the running tasks finish their step and write a checkpoint" in stderr
    assert "Interrupted: checkpoint written" in stderr
    table = out / "table3" / "table.json"  # written after the random inits, if they finished
    assert not (runs[0] / "result.json").exists()
    assert not table.exists() or json.loads(table.read_text())["rows"] == []

    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=400)
    assert done.returncode == 0, done.stderr
    record = json.loads((out / "table3" / "table.json").read_text())
    assert [r["seed"] for r in record["rows"][0]["runs"]] == [0, 1]
    assert record["rows"][0]["steps"] == 60  # 30 epochs of 2 steps, whatever the interruption
    assert "Resum" in done.stderr
