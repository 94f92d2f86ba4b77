import argparse
import datetime
import json
import shutil

import pytest

from obow.cli.evaluate import add_eval_parser
from obow.cli.weights import add_export_parser
from obow.data.eval_sets import eval_dataset, views_from_dict
from obow.evaluate.features import extract_features
from obow.evaluate.fewshot import prototype_accuracy, sample_episodes
from obow.evaluate.knn import knn_accuracy
from obow.weights.load import load_backbone

COLOURS = {"blue": (40, 60, 200), "green": (40, 190, 60), "red": (200, 50, 40)}


def run(*argv):
    parser = argparse.ArgumentParser(prog="obow")
    sub = parser.add_subparsers()
    add_eval_parser(sub)
    add_export_parser(sub)
    args = parser.parse_args([str(a) for a in argv])
    return args.func(args)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, colour_folders, make_checkpoint):
    root = tmp_path_factory.mktemp("cli")
    colour_folders(root / "data", COLOURS, {"train": 8, "val": 6})
    ckpt = make_checkpoint(root / "run" / "checkpoint.pt", size=16)  # its own seed (conftest.write_checkpoint)
    return root / "data", ckpt


FAST = ("--workers", 0, "--device", "cpu")


def reference_features(ckpt, folder, network="student"):
    backbone, info = load_backbone(ckpt, network=network)
    return extract_features(backbone, eval_dataset(folder, views_from_dict(info["views"])))


def test_knn_end_to_end(setup, capsys):
    data, ckpt = setup
    assert run("eval", "knn", "--checkpoint", ckpt, "--data", data, *FAST) == 0
    report = json.loads((ckpt.parent / "eval" / "knn.json").read_text())
    assert report["protocol"] == "knn"
    rows = report["results"]["knn"]
    assert [(r["k"], r["k_used"], r["temperature"]) for r in rows] == [(200, 24, 0.1), (20, 20, 0.1)]
    train_x, train_y = reference_features(ckpt, data / "train")
    test_x, test_y = reference_features(ckpt, data / "val")
    for row in rows:
        assert row["top1"] == pytest.approx(knn_accuracy(train_x, train_y, test_x, test_y, k=row["k"]))
        assert "top5" not in row  # 3 classes
    assert report["source"] == {
        "kind": "checkpoint",
        "path": str(ckpt),
        "network": "student",
        "epoch": 3,
        "iteration": 30,
        "arch": "resnet18",
        "stem": "cifar",
        "arch_options": {},
    }
    assert report["settings"]["k"] == [200, 20] and report["settings"]["view"]["teacher_size"] == 16
    assert report["data"]["root"] == str(data) and report["data"]["classes"] == sorted(COLOURS)
    assert (report["data"]["num_train"], report["data"]["num_test"]) == (24, 18)
    datetime.datetime.fromisoformat(report["date"])
    assert "top-1" in capsys.readouterr().out


def test_knn_of_the_teacher_goes_to_its_own_report(setup):
    data, ckpt = setup
    assert run("eval", "knn", "--checkpoint", ckpt, "--network", "teacher", "--k", 5, "--data", data, *FAST) == 0
    report = json.loads((ckpt.parent / "eval" / "knn_teacher.json").read_text())
    assert report["source"]["network"] == "teacher" and report["results"]["knn"][0]["k"] == 5


def test_fewshot_end_to_end(setup, tmp_path):
    data, ckpt = setup
    out = tmp_path / "fewshot.json"
    argv = ("eval", "fewshot", "--checkpoint", ckpt, "--data", data, "--shots", 1, 2, "--episodes", 20, "--out", out)
    assert run(*argv, *FAST) == 0
    report = json.loads(out.read_text())
    rows = report["results"]["fewshot"]
    assert [(r["ways"], r["shots"], r["queries"]) for r in rows] == [(3, 1, 1), (3, 2, 1)]  # min(50, 3) ways
    features, labels = reference_features(ckpt, data / "val")
    for row in rows:
        episodes = sample_episodes(labels, n_way=3, n_shot=row["shots"], n_query=1, n_episodes=20, seed=0)
        mean, ci = prototype_accuracy(features, labels, episodes)
        assert (row["accuracy"], row["ci95"]) == pytest.approx((mean, ci))
    assert report["settings"]["split"] == "val" and report["settings"]["episodes"] == 20
    assert report["data"]["num_images"] == 18


@pytest.mark.slow
def test_linear_and_finetune_run_and_record_their_settings(setup, tmp_path):
    data, ckpt = setup
    out = tmp_path / "linear.json"
    assert run("eval", "linear", "--checkpoint", ckpt, "--data", data, "--epochs", 3, "--out", out, *FAST) == 0
    settings = json.loads(out.read_text())["settings"]
    assert (settings["preset"], settings["epochs"], settings["preset_lr"], settings["num_views"]) == (
        "resnet18",
        3,
        10.0,
        2,
    )
    lr = settings["lr"]  # the preset's 10, or less where these features take less (test_issue66_cli)
    assert 0 < lr <= 10.0 and (settings["batch_size"], settings["weight_decay"]) == (256, 2e-6)
    assert settings["lr_per_epoch"] == [lr] * 3
    assert settings["batch_norm"] is False
    # lr 0.1 ended one run of ~10 above 1.5 ln(3) (its second epoch's loss 1.73 on these 24 images, batches of 16 and
    # 8 through the batch norm): flagged as diverged; 0.01 stays far from it (8 checkpoints' seeds: 0.14-0.32)
    argv = ("eval", "linear", "--checkpoint", ckpt, "--data", data, "--preset", "resnet50", "--batch", 16, "--lr", 0.01)
    assert run(*argv, "--epochs", 2, "--batch-norm", "--out", out, *FAST) == 0
    report = json.loads(out.read_text())
    settings = report["settings"]
    assert (settings["schedule"], settings["batch_size"], settings["extract_batch_size"]) == ("cosine", 16, 256)
    assert settings["batch_norm"] is True
    assert settings["lr_per_epoch"] == [0.01, 0.005]  # cosine over 2 epochs
    assert 0 <= report["results"]["top1"] <= 100

    out = tmp_path / "finetune.json"
    argv = ("eval", "finetune", "--checkpoint", ckpt, "--data", data, "--fraction", 0.1, "--epochs", 1, "--out", out)
    assert run(*argv, *FAST) == 0
    report = json.loads(out.read_text())
    settings = report["settings"]
    assert settings["preset"] == "10%" and (settings["head_lr"], settings["trunk_lr"]) == (0.5, 0.0002)
    assert settings["milestones"] == [12, 16] and settings["epochs"] == 1
    subset = json.loads((tmp_path / "finetune_subset.json").read_text())
    assert settings["subset_file"] == str(tmp_path / "finetune_subset.json")
    assert sorted(item["class"] for item in subset) == sorted(COLOURS)  # round(0.1 * 8) = 1 per class
    for item in subset:
        assert (data / "train" / item["path"]).is_file() and item["path"].startswith(item["class"] + "/")


def test_random_init_baseline_needs_an_architecture_and_records_the_seed(setup, tmp_path):
    data, _ = setup
    out = tmp_path / "random.json"
    argv = ("eval", "knn", "--random-init", "--arch", "resnet18", "--stem", "cifar", "--size", 16, "--seed", 4)
    assert run(*argv, "--k", 5, "--data", data, "--out", out, *FAST) == 0
    source = json.loads(out.read_text())["source"]
    assert (source["kind"], source["seed"], source["arch"], source["stem"]) == ("random_init", 4, "resnet18", "cifar")
    with pytest.raises(ValueError, match="needs an architecture"):
        run("eval", "knn", "--random-init", "--data", data, "--out", out, *FAST)


@pytest.mark.slow
def test_with_random_init_evaluates_the_checkpoint_then_its_network_untrained(setup, tmp_path, capsys):
    """``--with-random-init``: the checkpoint's table, then the same network at its random initialisation (same
    seed, view and data), each in its own report; the baseline equals ``--random-init`` of the checkpoint."""
    data, ckpt = setup
    run_dir = tmp_path / "run"
    shutil.copytree(ckpt.parent, run_dir, ignore=shutil.ignore_patterns("eval"))
    checkpoint = run_dir / "checkpoint.pt"
    argv = ("eval", "knn", "--checkpoint", checkpoint, "--k", 5, "--seed", 3, "--data", data, *FAST)
    assert run(*argv, "--with-random-init") == 0
    out = capsys.readouterr().out
    trained = json.loads((run_dir / "eval" / "knn.json").read_text())
    baseline = json.loads((run_dir / "eval" / "knn_random_init.json").read_text())
    assert (trained["source"]["kind"], baseline["source"]["kind"], baseline["source"]["seed"]) == (
        "checkpoint", "random_init", 3
    )  # fmt: skip
    assert baseline["settings"]["view"] == trained["settings"]["view"]
    assert baseline["settings"]["view_source"] == "the checkpoint's recipe (its network, untrained)"
    assert out.index("epoch 3") < out.index("random init (seed 3)")
    assert out.count("wrote ") == 2
    reference = tmp_path / "reference.json"
    assert run("eval", "knn", "--checkpoint", checkpoint, "--random-init", "--k", 5, "--seed", 3, "--data", data,
               "--out", reference, *FAST) == 0  # fmt: skip
    assert baseline["results"] == json.loads(reference.read_text())["results"]
    assert run(*argv, "--with-random-init", "--out", tmp_path / "mine.json") == 0
    assert json.loads((tmp_path / "mine_random_init.json").read_text())["results"] == baseline["results"]
    assert json.loads((tmp_path / "mine.json").read_text())["results"] == trained["results"]
    with pytest.raises(ValueError, match="--random-init leaves no trained weights: drop one of the two"):
        run("eval", "knn", "--random-init", "--arch", "resnet18", "--with-random-init", "--data", data, *FAST)
    with pytest.raises(ValueError, match="give the weights, --checkpoint or --backbone"):
        run("eval", "knn", "--arch", "resnet18", "--with-random-init", "--data", data, *FAST)


def test_architecture_mismatches_are_named(setup, tmp_path, capsys):
    data, ckpt = setup
    with pytest.raises(ValueError, match="holds a resnet18 backbone.*resnet50 was requested"):
        run("eval", "knn", "--checkpoint", ckpt, "--random-init", "--arch", "resnet50", "--data", data, *FAST)
    with pytest.raises(ValueError, match="holds a resnet18 backbone.*resnet50 was requested"):
        run("eval", "knn", "--checkpoint", ckpt, "--arch", "resnet50", "--data", data, *FAST)
    exported = tmp_path / "backbone.pth"
    assert run("export", "--checkpoint", ckpt, "--out", exported) == 0
    assert "3x3 stride-1" in capsys.readouterr().err  # the CIFAR-stem warning
    with pytest.raises(ValueError, match="holds a resnet18 backbone.*resnet50 was requested"):
        run("eval", "knn", "--backbone", exported, "--arch", "resnet50", "--data", data, *FAST)


def test_exported_backbone_evaluates_like_its_checkpoint(setup, tmp_path):
    data, ckpt = setup
    exported = tmp_path / "backbone.pth"
    run("export", "--checkpoint", ckpt, "--out", exported, "--network", "teacher")
    assert run("eval", "knn", "--backbone", exported, "--k", 5, "--data", data, *FAST) == 0
    from_file = json.loads((tmp_path / "eval" / "knn_backbone-backbone.json").read_text())
    out = tmp_path / "from_ckpt.json"
    run("eval", "knn", "--checkpoint", ckpt, "--network", "teacher", "--k", 5, "--data", data, "--out", out, *FAST)
    assert from_file["results"] == json.loads(out.read_text())["results"]
    assert from_file["source"]["kind"] == "exported" and from_file["source"]["network"] == "teacher"


def test_an_export_beside_its_checkpoint_gets_its_own_report(setup, tmp_path):
    """``obow export --out runs/x/backbone.pth`` puts the export in the checkpoint's folder: its default report
    is ``eval/knn_backbone-backbone.json`` and leaves the checkpoint's ``eval/knn.json`` as it was."""
    data, ckpt = setup
    run_dir = tmp_path / "run"
    shutil.copytree(ckpt.parent, run_dir, ignore=shutil.ignore_patterns("eval"))
    assert run("eval", "knn", "--checkpoint", run_dir / "checkpoint.pt", "--k", 5, "--data", data, *FAST) == 0
    checkpoint_report = (run_dir / "eval" / "knn.json").read_text()
    run("export", "--checkpoint", run_dir / "checkpoint.pt", "--out", run_dir / "backbone.pth")
    assert run("eval", "knn", "--backbone", run_dir / "backbone.pth", "--k", 7, "--data", data, *FAST) == 0
    assert (run_dir / "eval" / "knn.json").read_text() == checkpoint_report  # not overwritten
    report = json.loads((run_dir / "eval" / "knn_backbone-backbone.json").read_text())
    assert report["source"]["kind"] == "exported" and report["settings"]["k"] == [7]


@pytest.mark.slow
def test_exports_named_like_the_checkpoints_reports_leave_them_as_they_were(setup, tmp_path):
    """Exports named ``teacher.pth`` and ``random_init.pth`` beside their checkpoint write reports of their own:
    the teacher's report and the random-init baseline (``knn_teacher.json``, ``knn_random_init.json``) stay."""
    data, ckpt = setup
    run_dir = tmp_path / "run"
    shutil.copytree(ckpt.parent, run_dir, ignore=shutil.ignore_patterns("eval"))
    checkpoint = run_dir / "checkpoint.pt"
    assert run("eval", "knn", "--checkpoint", checkpoint, "--network", "teacher", "--k", 5, "--data", data, *FAST) == 0
    assert run("eval", "knn", "--checkpoint", checkpoint, "--random-init", "--k", 5, "--data", data, *FAST) == 0
    before = {name: (run_dir / "eval" / name).read_text() for name in ("knn_teacher.json", "knn_random_init.json")}
    for stem in ("teacher", "random_init"):
        run("export", "--checkpoint", checkpoint, "--out", run_dir / f"{stem}.pth")
        assert run("eval", "knn", "--backbone", run_dir / f"{stem}.pth", "--k", 7, "--data", data, *FAST) == 0
        assert {name: (run_dir / "eval" / name).read_text() for name in before} == before
        report = json.loads((run_dir / "eval" / f"knn_backbone-{stem}.json").read_text())
        assert report["source"]["kind"] == "exported" and report["settings"]["k"] == [7]


def test_folder_without_class_folders_is_refused(setup, tmp_path, noise_images):
    _, ckpt = setup
    for seed, split in enumerate(("train", "val")):
        noise_images(tmp_path / "flat" / split, 3, seed=seed)
    for protocol in ("knn", "fewshot"):
        with pytest.raises(ValueError, match=r"flat/(train|val) holds no labelled images: .*needs class folders"):
            run("eval", protocol, "--checkpoint", ckpt, "--data", tmp_path / "flat", *FAST)


def test_missing_splits_are_named(setup, tmp_path):
    data, ckpt = setup
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no train/ folder") as raised:
        run("eval", "knn", "--checkpoint", ckpt, "--data", tmp_path / "empty", *FAST)
    assert "looks like one of them" not in str(raised.value)


def test_a_split_given_as_data_names_the_folder_to_give(setup):
    """``--data my_images/train``, the folder the README's pretrain command takes: the error names its parent."""
    data, ckpt = setup
    for split in ("train", "val"):
        with pytest.raises(ValueError) as raised:
            run("eval", "knn", "--checkpoint", ckpt, "--data", data / split, *FAST)
        assert str(raised.value).endswith(
            f"({data / split} looks like one of them: give the folder that holds both, --data {data})"
        )


def test_more_ways_or_shots_than_the_data_hold(setup):
    data, ckpt = setup
    with pytest.raises(ValueError, match="5-way episodes need 5 classes, but the data hold only 3"):
        run("eval", "fewshot", "--checkpoint", ckpt, "--data", data, "--ways", 5, *FAST)
    with pytest.raises(ValueError, match=r"need 7 images per class, but 3 of 3 classes have fewer.*'blue' \(6\)"):
        run("eval", "fewshot", "--checkpoint", ckpt, "--data", data, "--shots", 1, 6, *FAST)


def test_unreadable_images_are_skipped_reported_and_recorded(setup, tmp_path):
    data, ckpt = setup
    shutil.copytree(data, tmp_path / "data")
    bad = tmp_path / "data" / "train" / "blue" / "zz_broken.png"
    bad.write_bytes(b"not a png")
    out = tmp_path / "knn.json"
    with pytest.warns(UserWarning, match="1 unreadable image under .* left out"):
        assert run("eval", "knn", "--checkpoint", ckpt, "--k", 5, "--data", tmp_path / "data", "--out", out, *FAST) == 0
    assert json.loads(out.read_text())["skipped_images"] == [str(bad)]


@pytest.mark.slow
def test_two_exports_of_one_name_keep_two_reports(setup, tmp_path):
    """``backbone.pth`` and ``backbone.safetensors`` beside each other (both documented export names): each
    evaluation writes a report of its own (``knn_backbone-backbone.json``, ``knn_backbone-backbone.safetensors.json``)
    and the first stays as it was."""
    data, ckpt = setup
    for name in ("backbone.pth", "backbone.safetensors"):
        assert run("export", "--checkpoint", ckpt, "--out", tmp_path / name) == 0
    assert run("eval", "knn", "--backbone", tmp_path / "backbone.pth", "--k", 5, "--data", data, *FAST) == 0
    first = (tmp_path / "eval" / "knn_backbone-backbone.json").read_text()
    assert run("eval", "knn", "--backbone", tmp_path / "backbone.safetensors", "--k", 5, "--data", data, *FAST) == 0
    assert (tmp_path / "eval" / "knn_backbone-backbone.json").read_text() == first
    second = json.loads((tmp_path / "eval" / "knn_backbone-backbone.safetensors.json").read_text())
    assert json.loads(first)["source"]["path"] == str(tmp_path / "backbone.pth")
    assert second["source"]["path"] == str(tmp_path / "backbone.safetensors")
    assert second["results"] == json.loads(first)["results"]  # the same weights


def test_a_default_report_of_another_file_is_not_replaced(setup, tmp_path):
    """Two checkpoints in one folder (``checkpoints/epoch_*.pt``) share the default ``eval/knn.json``: the second
    evaluation stops before its work with one line naming both files and ``--out``; the first report stays."""
    data, ckpt = setup
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for name in ("epoch_0001.pt", "epoch_0002.pt"):
        shutil.copy(ckpt, folder / name)
    assert run("eval", "knn", "--checkpoint", folder / "epoch_0001.pt", "--k", 5, "--data", data, *FAST) == 0
    first = (folder / "eval" / "knn.json").read_text()
    with pytest.raises(ValueError, match=r"knn\.json is the report of .*epoch_0001\.pt.*epoch_0002\.pt.*--out"):
        run("eval", "knn", "--checkpoint", folder / "epoch_0002.pt", "--k", 5, "--data", data, *FAST)
    assert (folder / "eval" / "knn.json").read_text() == first
    assert run("eval", "knn", "--checkpoint", folder / "epoch_0001.pt", "--k", 7, "--data", data, *FAST) == 0
    assert json.loads((folder / "eval" / "knn.json").read_text())["settings"]["k"] == [7]  # its own: replaced


@pytest.mark.slow
def test_with_random_init_of_an_exported_backbone(setup, tmp_path, capsys):
    """``--backbone FILE --with-random-init``: the export, then its network (from its sidecar) at its random
    initialisation with the same seed, view and data: the numbers of ``--checkpoint --random-init`` of the
    checkpoint it came from, in a report of its own beside the export's."""
    data, ckpt = setup
    exported = tmp_path / "backbone.pth"
    assert run("export", "--checkpoint", ckpt, "--out", exported) == 0
    capsys.readouterr()
    argv = ("eval", "knn", "--k", 5, "--seed", 3, "--data", data, *FAST)
    assert run(*argv, "--backbone", exported, "--with-random-init") == 0
    out = capsys.readouterr().out
    assert out.count("wrote ") == 2 and "random init (seed 3)" in out
    trained = json.loads((tmp_path / "eval" / "knn_backbone-backbone.json").read_text())
    baseline = json.loads((tmp_path / "eval" / "knn_random_init_backbone-backbone.json").read_text())
    assert (trained["source"]["kind"], baseline["source"]["kind"]) == ("exported", "random_init")
    source = baseline["source"]
    assert (source["seed"], source["arch"], source["stem"], source["path"]) == (3, "resnet18", "cifar", str(exported))
    assert baseline["settings"]["view"] == trained["settings"]["view"]
    reference = tmp_path / "reference.json"
    assert run(*argv, "--checkpoint", ckpt, "--random-init", "--out", reference) == 0
    assert baseline["results"] == json.loads(reference.read_text())["results"]
    assert run(*argv, "--backbone", exported, "--random-init", "--out", tmp_path / "alone.json") == 0
    assert json.loads((tmp_path / "alone.json").read_text())["results"] == baseline["results"]
