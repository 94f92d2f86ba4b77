"""`obow tables`: every row of every table is a valid recipe, and a tiny real table run trains, evaluates,
writes its table and resumes without retraining."""

import json
import math

import pytest

from obow.config import load_config
from obow.experiments.tables import TABLES, _fill, _placeholders, list_tables, markdown, select_rows

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


@pytest.mark.slow
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
        s = r["scores"]
        for key in ("knn", "linear", "fewshot_1", "fewshot_5", "effective_rank", "mean_cosine"):
            assert math.isfinite(s[key]), (r["label"], key)
        assert 0 <= s["knn"] <= 100 and 0 <= s["fewshot_1"] <= 100
    assert record["rows"][0]["steps"] == 2 and record["random_init"]["steps"] == 0  # 16 images / batch 8
    # each row trained with its own change
    saved = load_config(out / "table3" / "hard_fixed" / "config.yaml")
    assert (saved.model.assignment, saved.model.head, saved.model.levels) == ("hard", "fixed", ("conv5",))

    # resumable: finished rows are not retrained, a new row is added, the table keeps every finished row
    checkpoint = out / "table3" / "soft_dynamic" / "checkpoint.pt"
    stamp = checkpoint.stat().st_mtime_ns
    obow_cli(*args, "--rows", "soft_dynamic", "2", "--k", "5", "--episodes", "10")
    assert checkpoint.stat().st_mtime_ns == stamp
    record = json.loads((out / "table3" / "table.json").read_text())
    assert [r["label"] for r in record["rows"]] == ["soft, dynamic", "hard, dynamic", "hard, fixed"]
    text = (out / "table3" / "table.md").read_text()
    assert text == markdown(record, TABLES["table3"].columns) and text.count("\n| ") == 5
