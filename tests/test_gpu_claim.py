"""``benchmarks/gpu_claim.py``, the central claim's device call (issue 55): its arithmetic (the probe's rates, the
epoch choice: :mod:`obow.experiments.budget`), its live copies, the merge of a returned call into a table folder,
and (slow) a dry run of the whole command on the CPU, cut at its deadline."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from obow.experiments import budget
from obow.experiments.tables import TABLES, aggregate, select_rows, table_tasks

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_claim.py"

sys.path.insert(0, str(Path(__file__).parent))
from conftest import TWO_LEVEL_RECIPE  # noqa: E402 - a network small enough for a dry run of the whole call


@pytest.fixture(scope="module")
def claim():
    spec = importlib.util.spec_from_file_location("benchmark_gpu_claim", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def step(iteration, epoch, rate=None):
    record = {"epoch": epoch, "iteration": iteration, "loss": 1.0}
    return record if rate is None else {**record, "images_per_s": rate}


def test_intervals_take_their_seconds_from_the_logged_rate_and_count_epoch_ends(claim):
    records = [
        step(20, 1),  # the first logged step: no rate
        step(40, 1, rate=80.0),  # 20 steps of 8 images at 80 images/s: 2 s
        {"type": "epoch", "epoch": 1, "iteration": 50, "epoch_time_s": 5.0},
        step(60, 2, rate=40.0),  # 20 steps, an epoch's end among them: 4 s
        step(80, 2, rate=80.0),
    ]
    found = budget.intervals(records, batch=8)
    assert found == [
        budget.Interval(20, 40, 2.0, 0),
        budget.Interval(40, 60, 4.0, 1),
        budget.Interval(60, 80, 2.0, 0),
    ]
    fit = budget.fit_intervals(found, warmup_steps=20)
    # steps: 4 s over 40 plain steps; the epoch's end: 4 s less 20 steps x 0.1 s
    assert fit == budget.Fit(seconds_per_step=0.1, epoch_end_s=pytest.approx(2.0), measured_s=8.0, steps=60)
    later = budget.fit_intervals(found, warmup_steps=40)  # the first interval is warm-up
    assert later.seconds_per_step == pytest.approx(0.1) and later.steps == 40 and later.measured_s == 6.0
    assert budget.fit_intervals(found, warmup_steps=61) is None  # nothing timed after the warm-up
    plain = budget.fit_intervals([budget.Interval(20, 40, 2.0, 0)], warmup_steps=0)
    assert plain.epoch_end_s is None  # no epoch end seen: the estimate's stated value is used


def test_epochs_shorter_than_the_logging_interval_keep_their_ends_in_the_rate(claim):
    # 5 steps an epoch, every step logged at its epoch's end: each interval holds one epoch end
    found = [budget.Interval(5 * i, 5 * i + 5, 3.0, 1) for i in range(1, 4)]
    fit = budget.fit_intervals(found, warmup_steps=5)
    assert fit.seconds_per_step == pytest.approx(0.6) and fit.epoch_end_s == 0.0


#: 97 steps an epoch at 10 steps a second plus 0.3 s an epoch's end: 10 s an epoch; 20 s the monitor's first pass,
#: 1 s each later one; 40 s an evaluation, 10 s the start, 20 s margin. total(E) = 89 + 10 E + passes(E).
ESTIMATE = dict(start_s=10, epoch_end_s=0.3, monitor_first_s=20, monitor_pass_s=1, eval_s=40, margin_s=20)


def test_the_estimate_counts_steps_epoch_ends_monitor_passes_and_the_evaluation(claim):
    estimate = budget.Estimate(**ESTIMATE)
    assert budget.curve_every(40) == 4 and budget.curve_every(9) == 1 and budget.curve_every(60) == 6
    assert estimate.total(40, 97, 0.1) == pytest.approx(10 + 400 + 20 + 9 + 40 + 20)  # 10 passes
    assert estimate.total(50, 97, 0.1) == pytest.approx(599)
    assert estimate.total(1, 97, 0.1) == pytest.approx(100)  # one pass, the first


def test_choose_epochs_takes_the_most_that_fit_and_says_when_the_minimum_does_not(claim):
    estimate = budget.Estimate(**ESTIMATE)
    fits = budget.choose_epochs(700, estimate, 97, 0.1, minimum=50)
    assert (fits.epochs, fits.fits) == (60, True)  # 60: 699 s; 61: 709 s
    assert fits.total_s == pytest.approx(699) and fits.text.startswith("60 epochs fit (at least 50 asked)")
    short = budget.choose_epochs(500, estimate, 97, 0.1, minimum=50)
    assert (short.epochs, short.fits) == (40, False)  # 40: 499 s; 41: 509 s
    assert "50 epochs do NOT fit: they would take about 599 s, 500 s are left" in short.text
    assert short.text.endswith("running the 40 that fit (about 499 s)")
    exact = budget.choose_epochs(100, estimate, 97, 0.1, minimum=50)
    assert exact.epochs == 1
    none = budget.choose_epochs(99, estimate, 97, 0.1, minimum=50)
    assert none.epochs == 0 and not none.fits and "not one epoch fits: nothing is trained" in none.text


class FakeCall:
    """What :func:`choose` reads of a call: its options, the seconds left, where it says things."""

    def __init__(self, left: float, **options):
        from argparse import Namespace

        self.args = Namespace(**{"recipe": "auto", "step": "auto", "batch": 512, "min_epochs": 50, **options})
        self.seconds_left, self.said, self.stopping = left, [], None

    def left(self) -> float:
        return self.seconds_left

    def say(self, text: str) -> None:
        self.said.append(text)


def fake_probes(claim, monkeypatch, paces: dict[tuple[str, str], float | None]) -> list[tuple[str, str]]:
    """Make :func:`probe` return ``paces[(recipe, step)]`` seconds a step (``None``: it failed); returns the list
    of probes asked for, in order."""
    asked = []

    def probe(call, data, recipe, step):
        asked.append((recipe, step))
        pace = paces[(recipe, step)]
        return claim.Probe(recipe, step, {}, pace, None, 5.0, None if pace else "failed")

    monkeypatch.setattr(claim, "probe", probe)
    monkeypatch.setattr(claim, "estimate_for", lambda call, data, recipe, found, decode: budget.Estimate(**ESTIMATE))
    return asked


def test_auto_takes_the_faster_step_and_the_full_width_only_when_the_minimum_fits(claim, monkeypatch):
    monkeypatch.setattr(claim, "cuda_available", lambda: True)  # graph is tried where CUDA graphs can run
    data = claim.Data(Path("c10"), Path("c10/train"), Path("c10/test"), 50000, 10000, 0.5)  # 97 steps an epoch
    paces = {("cifar10_resnet18", "graph"): 0.1, ("cifar10_resnet18", "off"): 0.2, ("cifar10_fast", "graph"): 0.05}
    asked = fake_probes(claim, monkeypatch, paces)
    recipe, step, choice, _, _ = claim.choose(FakeCall(700), data, 0.0)  # 60 epochs of the full width fit
    assert (recipe, step, choice.epochs) == ("cifar10_resnet18", "graph", 60) and asked == list(paces)[:2]

    asked.clear()
    recipe, step, choice, _, _ = claim.choose(FakeCall(500), data, 0.0)  # 40 would: the half width, with graph
    assert asked == list(paces) and (recipe, step, choice.fits) == ("cifar10_fast", "graph", True)

    paces = {("cifar10_resnet18", "graph"): None, ("cifar10_resnet18", "off"): 0.2, ("cifar10_fast", "off"): 0.05}
    asked = fake_probes(claim, monkeypatch, paces)  # the graphed step fails: eager; the half width eager first
    recipe, step, choice, _, _ = claim.choose(FakeCall(500), data, 0.0)
    assert asked == list(paces) and (recipe, step) == ("cifar10_fast", "off")

    asked = fake_probes(claim, monkeypatch, {("cifar10_fast", "off"): 0.5})
    recipe, step, choice, _, _ = claim.choose(FakeCall(500, recipe="cifar10_fast", step="off"), data, 0.0)
    assert not choice.fits and choice.epochs > 0  # said plainly, and run


def test_auto_on_a_machine_without_cuda_probes_the_eager_step_only_and_says_why(claim, monkeypatch):
    monkeypatch.setattr(claim, "cuda_available", lambda: False)  # graph would run the eager step there
    data = claim.Data(Path("c10"), Path("c10/train"), Path("c10/test"), 50000, 10000, 0.5)
    asked = fake_probes(claim, monkeypatch, {("cifar10_resnet18", "off"): 0.1})
    call = FakeCall(700)
    recipe, step, choice, _, _ = claim.choose(call, data, 0.0)
    assert asked == [("cifar10_resnet18", "off")] and (recipe, step) == ("cifar10_resnet18", "off")
    assert any("step graph: not tried, CUDA graphs need a CUDA device" in line for line in call.said)


def test_every_row_gets_the_batch_and_the_linearly_scaled_learning_rate(claim):
    assert budget.scaled_lr(0.05, 128, 512) == pytest.approx(0.2)
    items = claim.table_overrides("cifar10_fast", "off", 512, ["train.knn_k=100"])
    assert items[:2] == ["data.batch_size=512", "optim.lr=0.2"]
    assert "train.compile=off" in items and "data.pipeline=device" in items and items[-1] == "train.knn_k=100"
    assert claim.table_overrides("cifar10_resnet18", "off", None, [])[:2] == ["data.batch_size=128", "optim.lr=0.05"]
    assert claim.step_accepted("cifar10_fast", "off") is None
    assert "train.compile" in claim.step_accepted("cifar10_fast", "no-such-mode")


def test_the_random_init_can_come_after_every_row():
    rows = select_rows(TABLES["mocov2"], ["2", "4"])
    first = [(t.row.slug if t.row else None, t.seed) for t in table_tasks(rows, (0, 1))]
    assert first == [(None, 0), ("obow_full", 0), ("moco_v2_our_aug", 0), (None, 1), ("obow_full", 1),
                     ("moco_v2_our_aug", 1)]  # fmt: skip
    last = [(t.row.slug if t.row else None, t.seed) for t in table_tasks(rows, (0,), "last")]
    assert last == [("obow_full", 0), ("moco_v2_our_aug", 0), (None, 0)]


def test_live_copy_follows_a_growing_file_and_copies_it_once_more_at_the_end(claim, tmp_path):
    source, out = tmp_path / "run" / "log.jsonl", tmp_path / "out"
    out.mkdir()
    copier = claim.LiveCopy(out, lambda: {"row-seed0.log.jsonl": source, "table.json": tmp_path / "none"}, every=0.05)
    copier.start()
    time.sleep(0.2)
    assert not (out / "row-seed0.log.jsonl").exists()  # not there yet: nothing copied, no error
    source.parent.mkdir()
    source.write_text("1\n")
    for _ in range(100):
        if (out / "row-seed0.log.jsonl").exists():
            break
        time.sleep(0.05)
    assert (out / "row-seed0.log.jsonl").read_text() == "1\n"
    with open(source, "a") as f:
        f.write("2\n")
    copier.stop()  # the last copy, whatever the interval
    assert (out / "row-seed0.log.jsonl").read_text() == "1\n2\n"
    assert sorted(p.name for p in out.iterdir()) == ["row-seed0.log.jsonl"]  # no partial file left


def fake_table(seed: int, knn: dict[str, float], overrides=("data.batch_size=512",)) -> dict:
    """A call's ``table.json`` for the claim's two rows and the random init at one seed."""
    table = TABLES["mocov2"]
    stage = {"epochs": 60, "warmup_epochs": 1, "seconds_per_step": None, "steps": 5820}  # a --budget plan's
    plan = {"budget": {"epochs": 60}, "steps_per_epoch": 97, "precision": "bf16", "pipeline": "device",
            "stages": {"obow_full/pretrain": stage, "moco_v2_our_aug/pretrain": stage}}  # fmt: skip

    def run(value):
        scores = {"knn": value, "linear": value + 1, "fewshot_1": 20.0, "fewshot_5": 30.0, "notes": []}
        return {"seed": seed, "scores": scores, "steps": 5820, "minutes": 3.0}

    rows = [r for r in table.rows if r.slug in knn and r.slug != "random_init"]
    return {
        "table": "mocov2", "title": table.title, "note": table.note, "recipe": "cifar10_fast",
        "budget": {"epochs": 60}, "plan": plan, "train_images": 50000, "test_images": 10000,
        "protocol": {"k": 200, "temperature": 0.1, "episodes": 200}, "overrides": list(overrides),
        "machine": "a GPU", "seeds": [seed], "continued_from": [],
        "random_init": aggregate("random init", "random_init", {}, [run(knn["random_init"])]),
        "rows": [aggregate(r.label, r.slug, r.paper, [run(knn[r.slug])]) for r in rows],
    }  # fmt: skip


def test_merge_joins_a_later_seed_and_refuses_another_table_or_the_same_seed(claim):
    first = fake_table(0, {"random_init": 26.0, "obow_full": 40.0, "moco_v2_our_aug": 42.0})
    second = fake_table(1, {"random_init": 27.0, "obow_full": 44.0, "moco_v2_our_aug": 43.0})
    merged = claim.merge_records(first, second)
    assert merged["seeds"] == [0, 1] and [r["slug"] for r in merged["rows"]] == ["obow_full", "moco_v2_our_aug"]
    obow = merged["rows"][0]
    assert [run["seed"] for run in obow["runs"]] == [0, 1] and obow["mean"]["knn"] == pytest.approx(42.0)
    assert merged["random_init"]["mean"]["knn"] == pytest.approx(26.5)
    with pytest.raises(ValueError, match="seed"):
        claim.merge_records(merged, second)
    with pytest.raises(ValueError, match="overrides"):
        claim.merge_records(first, fake_table(1, {"random_init": 1.0}, overrides=("data.batch_size=256",)))
    verdict = claim.verdict_text(merged)
    assert "| OBoW (full) | -0.50 ± 2.12 (2) level |" in verdict  # kNN seed by seed: 40 - 42, 44 - 43


def test_merge_command_writes_the_table_the_curves_and_the_verdict(claim, tmp_path, capsys):
    out, folder = tmp_path / "out", tmp_path / "docs" / "cifar10-mocov2-gpu"
    out.mkdir()
    record = fake_table(0, {"random_init": 26.0, "obow_full": 40.0, "moco_v2_our_aug": 42.0})
    (out / "table.json").write_text(json.dumps(record))
    (out / "claim.json").write_text(json.dumps({"choice": {"epochs": 60}}))
    (out / "summary.txt").write_text("a call\n")
    curve = [{"type": "epoch", "epoch": 6, "iteration": 582, "knn_top1": 30.5}, {"epoch": 7, "iteration": 600}]
    (out / "obow_full-seed0.log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in curve))
    assert claim.main(["merge", str(out), str(folder)]) == 0
    assert json.loads((folder / "table.json").read_text())["seeds"] == [0]
    assert (folder / "curves" / "obow_full-seed0.log.jsonl").exists()
    assert (folder / "calls" / "seed0-claim.json").exists() and (folder / "calls" / "seed0-summary.txt").exists()
    assert "| 6 | 30.50 |" in (folder / "curves.md").read_text()
    assert "one seed" in (folder / "paired.md").read_text() and "| OBoW (full) |" in (folder / "table.md").read_text()
    assert "merged seed(s) [0] (60 epochs)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="not merged into .*: random init: seed\\(s\\) \\[0\\] are there already"):
        claim.main(["merge", str(out), str(folder)])  # the same call twice
    empty = tmp_path / "cut"
    empty.mkdir()
    with pytest.raises(SystemExit, match="holds no table.json"):
        claim.main(["merge", str(empty), str(folder)])


@pytest.mark.slow
def test_a_dry_run_of_the_call_probes_chooses_copies_as_it_grows_and_returns_curves_when_cut(tmp_path, write_images):
    """The whole command on the CPU, on synthetic class folders and a tiny recipe, forced to far more epochs than
    its deadline allows (a kNN point every 2): the probe times both rows, the choice says that the minimum does not
    fit, the rows' logs grow in OUT while the table trains, and the cut at the deadline still leaves the kNN curve
    there."""
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TWO_LEVEL_RECIPE)
    data = tmp_path / "c10"
    write_images(data / "train", per_class=8, size=32)
    write_images(data / "test", per_class=6, size=32, seed=1)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    command = [
        sys.executable, str(SCRIPT), "run", "--data", str(data), "--out", str(out),
        "--runs", str(tmp_path / "runs"), "--deadline", "60", "--recipe", str(recipe), "--step", "auto",
        "--batch", "0", "--min-epochs", "100000", "--epochs", "100000", "--curve-every", "2", "--probe-s", "30",
        "--probe-measure", "2", "--warmup-steps", "2", "--decode-sample", "5", "--copy-every", "1", "--stop-s", "15",
        "--extra", "train.log_every=1",
    ]  # fmt: skip
    process = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    copied = out / "obow_full-seed0.log.jsonl"
    sizes = []
    while process.poll() is None:
        if copied.exists():
            sizes.append(len(copied.read_text().splitlines()))
        time.sleep(1)
    printed = process.stdout.read().decode()
    assert process.returncode == 1, printed  # cut: the table did not finish
    assert len(set(sizes)) >= 2 and sizes == sorted(sizes), (sizes, printed)  # it grew while the table trained

    summary = (out / "summary.txt").read_text()
    assert "step graph: not tried" in summary or "step graph (" in summary  # a tree with or without it
    assert "100000 epochs do NOT fit" in summary and "--epochs 100000 given" in summary
    assert "table: stopped (the deadline (60.0 s) less 15 s)" in summary
    claimed = json.loads((out / "claim.json").read_text())
    probe = next(p for p in claimed["probes"] if p["seconds_per_step"] is not None)
    assert probe["step"] == "off" and set(probe["rows"]) == {"obow_full", "moco_v2_our_aug"}
    assert claimed["choice"]["epochs"] == 100000 and claimed["run"]["cut"]
    assert {"obow_full", "moco_v2_our_aug"} == set(claimed["rows"])
    for slug in ("obow_full", "moco_v2_our_aug"):
        records = [json.loads(line) for line in (out / f"{slug}-seed0.log.jsonl").read_text().splitlines()]
        curve = [r for r in records if r.get("type") == "epoch" and "knn_top1" in r]
        assert curve, f"{slug}: no kNN point came back"  # a point every 2 epochs
        assert claimed["rows"][slug]["epochs_done"] >= curve[-1]["epoch"]
    assert not (out / "table.json").exists()  # nothing evaluated: the rows were cut while training
    assert len(list(out.iterdir())) <= 8  # what a device call returns


def claim_command(tmp_path: Path, out: Path, *more: str) -> list[str]:
    """The call on the tiny two-level recipe with its recipe, step and epochs given (no probe), 2 steps an epoch."""
    recipe = tmp_path / "tiny.yaml"
    if not recipe.exists():
        recipe.write_text(TWO_LEVEL_RECIPE)
    return [
        sys.executable, str(SCRIPT), "run", "--data", str(tmp_path / "c10"), "--out", str(out),
        "--runs", str(tmp_path / "runs"), "--deadline", "300", "--recipe", str(recipe), "--step", "off",
        "--epochs", "12", "--batch", "0", "--curve-every", "4", "--decode-sample", "5", "--copy-every", "1",
        *more, "--extra", "train.log_every=1",
    ]  # fmt: skip


def epochs_logged(log: Path) -> list[int]:
    if not log.exists():
        return []
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [r["epoch"] for r in records if r.get("type") == "epoch"]


@pytest.mark.slow
def test_a_planned_call_runs_no_probe_and_the_next_call_resumes_its_stopped_rows(claim, tmp_path, write_images):
    """Recipe, step and epochs given: no probe. The call stopped (SIGTERM, as its deadline does) after the rows'
    first epochs leaves checkpoints; the same command again is refused unless told ``--resume``, and with it the
    rows continue from their checkpoints to the 12 epochs, each epoch logged once, and the table is evaluated."""
    write_images(tmp_path / "c10" / "train", per_class=8, size=32)
    write_images(tmp_path / "c10" / "test", per_class=6, size=32, seed=1)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    first_out = tmp_path / "out1"
    first = subprocess.Popen(
        claim_command(tmp_path, first_out), env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    logs = [first_out / f"{slug}-seed0.log.jsonl" for slug in ("obow_full", "moco_v2_our_aug")]
    started = time.monotonic()
    while first.poll() is None and not all(epochs_logged(log) for log in logs):
        assert time.monotonic() - started < 240, "no epoch logged by both rows"
        time.sleep(0.5)
    first.send_signal(signal.SIGTERM)
    printed = first.communicate(timeout=120)[0].decode()
    summary = (first_out / "summary.txt").read_text()
    assert "no probe" in summary and "probe " not in summary.replace("no probe", ""), printed
    assert json.loads((first_out / "claim.json").read_text())["choice"]["resumed"] is False
    assert not (first_out / "table.json").exists(), printed  # stopped while training
    done_first = {log.name: epochs_logged(log) for log in logs}
    assert all(0 < len(epochs) < 12 for epochs in done_first.values()), done_first

    again = claim.build_parser().parse_args(claim_command(tmp_path, tmp_path / "out2")[2:])
    with pytest.raises(SystemExit, match="--resume to continue them"):
        claim.cmd_run(again)  # the same command without --resume: refused before anything runs
    alone = claim.build_parser().parse_args(
        [*claim_command(tmp_path, tmp_path / "out2", "--resume")[2:], "--step", "auto"]
    )
    with pytest.raises(SystemExit, match="give their --recipe, --step and --epochs"):
        claim.cmd_run(alone)  # --resume with a probe to run: nothing to resume with

    second_out = tmp_path / "out3"
    second = subprocess.run(
        claim_command(tmp_path, second_out, "--resume"), env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resume from their checkpoints" in (second_out / "summary.txt").read_text()
    assert json.loads((second_out / "claim.json").read_text())["choice"]["resumed"] is True
    table = json.loads((second_out / "table.json").read_text())
    assert {"obow_full", "moco_v2_our_aug"} <= {row["slug"] for row in table["rows"]}, table["rows"]
    for log in logs:
        epochs = epochs_logged(second_out / log.name)
        assert epochs == list(range(1, 13)), (log.name, epochs)  # each epoch once, the first call's kept
        assert epochs[: len(done_first[log.name])] == done_first[log.name]
