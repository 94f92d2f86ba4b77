"""`obow tables`: every row of every table is a valid recipe, and a tiny real table run trains, evaluates,
writes its table and resumes without retraining."""

import json
import math

import pytest

from obow.config import load_config
from obow.experiments.budget import plan_epochs, seconds_per_step, short_run_warmup
from obow.experiments.tables import TABLES, _aggregate, _fill, _placeholders, list_tables, markdown, select_rows

TINY = """
description: tiny base for tables
model: {arch: "timm:resnet18", arch_options: {channels: [8, 16, 32, 64], stem_width: 8}, stem: cifar,
        levels: [conv4, conv5], num_words: 16, kappa: 5.0, delta_base: 1/10, border: 0}
views: {teacher_resize: 28, teacher_size: 24, num_crops: 2, crop_size: 16, num_patches: 2, patch_size: 8,
        patch_jitter: 2, patch_grid_size: 24, blur_sigma: [0.05, 0.3]}
data: {batch_size: 8, num_workers: 0}
optim: {epochs: 4, lr: 0.05, warmup_epochs: 1, end_lr: 0.0, weight_decay: 5.0e-4}
train: {log_every: 1, knn_every: 0, progress_bar: false, tensorboard: false}
"""


def test_every_row_of_every_table_is_a_valid_recipe():
    base = load_config("cifar10_fast")
    values = _placeholders(base, train_images=5000)
    assert values["moco_queue"] == 2432  # the largest multiple of 128 at most 2,500
    assert math.isclose(values["lr_x06"], 0.03) and values["teacher_size"] == 40
    for table in TABLES.values():
        for row in table.rows:
            for stage in row.plan():
                items = _fill(stage.overrides, values)
                if stage.teacher:
                    items.append("bownet.teacher=some/checkpoint.pt")
                cfg = load_config("cifar10_fast", items)
                # the row's change is really applied
                for item in items:
                    key, _, _ = item.partition("=")
                    section, name = key.split(".")
                    assert hasattr(getattr(cfg, section), name)
    one_224 = load_config("cifar10_fast", _fill(TABLES["table4"].rows[0].overrides, values))
    assert one_224.views.crop_size == one_224.views.teacher_size == 40 and one_224.views.num_patches == 0
    vanilla = load_config("cifar10_fast", _fill(TABLES["table3"].rows[1].overrides, values))
    assert vanilla.model.levels == ("conv5",) and vanilla.views.num_crops == 1 and vanilla.model.assignment == "hard"
    slow = load_config("cifar10_fast", _fill(TABLES["table2"].rows[-1].overrides, values))
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
    row = _aggregate("x", "x", {}, runs)
    assert row["mean"]["knn"] == pytest.approx(33.0)
    assert row["std"]["knn"] == pytest.approx(math.sqrt(((30 - 33) ** 2 + 1 + 4) / 2))  # n - 1 = 2
    assert row["minutes"] == pytest.approx(2.0) and row["steps"] == 4
    assert _aggregate("x", "x", {}, runs[:1])["std"]["knn"] is None  # one seed: no spread claimed


def test_seconds_per_step_times_every_config_in_alternating_rounds(tmp_path, write_images):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY)
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
    recipe.write_text(TINY)
    data = tmp_path / "data"
    write_images(data / "train", per_class=8, size=28)
    write_images(data / "test", per_class=6, size=28, seed=1)
    return recipe, data, tmp_path / "tables"


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
    assert (out / "table3" / "table.md").read_text() == markdown(record, TABLES["table3"].columns)

    # the folder's budget is fixed: another budget is refused, naming both
    with pytest.raises(ValueError, match="planned for \\{'minutes': 0.001\\}.*asks for \\{'epochs': 2\\}"):
        from obow.experiments.tables import run_table

        run_table("table3", data, 2, recipe=str(recipe), out=out, rows=["4"], k=5, episodes=5)


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
        "random_init": _aggregate("random init", "random_init", {}, []),
    }
    assert "Changes to the recipe" not in markdown({**record, "overrides": []}, ("linear",))
    text = markdown({**record, "overrides": ["model.teacher_momentum=0.9", "model.num_words=256"]}, ("linear",))
    assert "Changes to the recipe for every row: `model.teacher_momentum=0.9`, `model.num_words=256`." in text


def test_tiny_table3_run_writes_the_table_and_resumes_without_retraining(tmp_path, write_images, obow_cli):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY)
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
