"""The benchmark scripts' own logic: ``benchmarks/step_time.py`` (interleaved timing, speed-ups, any arch)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from PIL import Image

from obow.config import load_config

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flat(net: torch.nn.Module) -> torch.Tensor:
    """A copy of every parameter in one vector (``reshape``: channels_last weights are not views of one)."""
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


@pytest.fixture(scope="module")
def step_time():
    return load_script("step_time")


def test_round_order_puts_every_setting_in_every_position_equally_often(step_time):
    names = ["fp32", "bf16", "fp32 + channels_last", "bf16 + channels_last"]
    orders = [step_time.round_order(names, r) for r in range(8)]
    assert all(sorted(order) == sorted(names) for order in orders)
    for position in range(len(names)):
        assert sorted(order[position] for order in orders) == sorted(names * 2)


def test_speedups_are_the_ratio_of_medians_and_the_median_of_paired_ratios(step_time):
    times = {"fp32": [2.0, 4.0, 3.0], "bf16": [1.0, 1.0, 6.0]}  # medians 3 and 1; round ratios 2, 4, 0.5
    ratios = step_time.speedups(times, "fp32")
    assert ratios["fp32"] == (1.0, 1.0)
    assert ratios["bf16"] == pytest.approx((3.0, 2.0))


def test_synthetic_batch_has_the_recipe_view_shapes(step_time, tiny_recipe):
    cfg = load_config(str(tiny_recipe))
    batch = step_time.synthetic_batch(cfg)
    v, b = cfg.views, cfg.data.batch_size
    assert batch["teacher"].shape == (b, 3, v.teacher_size, v.teacher_size)
    assert batch["crops"].shape == (b, v.num_crops, 3, v.crop_size, v.crop_size)
    assert batch["patches"].shape == (b, v.num_patches, 3, v.patch_size, v.patch_size)


@pytest.mark.slow
def test_compare_times_the_loop_step_on_a_timm_arch_and_prints_the_bf16_ratio(step_time, tiny_recipe, capsys):
    threads = torch.get_num_threads()
    step_time.main(
        ["--config", str(tiny_recipe), "--precision", "bf16", "--warmup", "0", "--repeats", "2", "--threads", "1"]
        + ["--device", "cpu"]  # the CPU path even where a GPU is visible
    )
    torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "timm:resnet18" in out and "CPU, 1 threads" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "setting" not in line]
    assert [row.split("|")[1].strip() for row in rows] == [
        "fp32",
        "bf16",
        "fp32 + channels_last",
        "bf16 + channels_last",
    ]
    assert float(rows[0].split("|")[4]) == 1.0  # fp32 against itself
    ratio = re.search(r"^fp32 / bf16: (\d+\.\d+) \(ratio of medians; (\d+\.\d+) median", out, re.MULTILINE)
    assert ratio and float(ratio.group(1)) > 0 and float(ratio.group(2)) > 0


def test_the_timed_step_is_a_training_step_at_the_setting_asked_for(step_time, tiny_recipe):
    """Every setting starts from the same weights and batch: one step in fp32 + channels_last moves the student
    where fp32 does (up to summation order), one in bf16 elsewhere (bf16 really is used)."""
    args = step_time.parse_args(["--config", str(tiny_recipe)])
    batch = step_time.synthetic_batch(step_time.recipe(args, "fp32", False))
    students = {}
    for setting in (("fp32", False), ("fp32", True), ("bf16", False)):
        run = step_time.training_run(step_time.recipe(args, *setting), torch.device("cpu"))
        before = flat(run.model.student)
        torch.manual_seed(1)
        step_time.timed_step(run, batch)()
        students[setting] = flat(run.model.student)
        assert (students[setting] - before).abs().max() > 1e-4  # a real step
    fp32 = students["fp32", False]
    torch.testing.assert_close(students["fp32", True], fp32, rtol=1e-4, atol=1e-5)
    assert (students["bf16", False] - fp32).abs().max() > 1e-4


@pytest.mark.parametrize("mode", ["floor", "supervised"])
def test_breakdown_steps_build_any_arch(step_time, tiny_recipe, mode):
    """The floor and the supervised step on a timm backbone (the supervised step once took torchvision names only)."""
    args = step_time.parse_args(
        ["--config", str(tiny_recipe), "--warmup", "0", "--repeats", "1", "--supervised-size", "0"]
    )
    result = step_time.measure(args, mode)
    assert result["median_s"] > 0 and result["memory_mib"] > 0


@pytest.mark.slow
def test_quality_minutes_budget_plans_whole_epochs_and_the_tables_warmup(
    tiny_recipe, write_images, tmp_path, monkeypatch
):
    """``benchmarks/quality.py --minutes``: the run is timed, given the whole epochs that fit (at least one)
    and the recipe's warm-up up to half the run, then compared with its random init in ``quality.json``."""
    quality = load_script("quality")
    write_images(tmp_path / "data" / "train", per_class=8, size=32)
    write_images(tmp_path / "data" / "test", per_class=4, size=32, seed=1)
    argv = ["quality.py", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "q"), "--minutes", "0.001"]
    monkeypatch.setattr("sys.argv", [*argv, "--k", "3", "--run", f"tiny {tiny_recipe} data.num_workers=0"])
    assert quality.main() == 0
    (row,) = json.loads((tmp_path / "q" / "quality.json").read_text())
    saved = load_config(tmp_path / "q" / "tiny" / "config.yaml")
    assert saved.optim.epochs == 1 and saved.optim.warmup_epochs == 0.5
    assert (
        row["steps"] == 16 // saved.data.batch_size
        and row["knn_gain"] == row["pretrained"]["knn"] - row["random_init"]["knn"]
    )


# the script's parts after "env", in its order (read from the script: one list to keep)
GPU_CHECK_PARTS = re.findall(r"^part (\w+)", (BENCHMARKS / "gpu_check.sh").read_text(), flags=re.M)[1:]


def gpu_check(tmp_path: Path, write_images, skip: list[str], deadline: int, recipe: Path | None = None) -> list[str]:
    """``benchmarks/gpu_check.sh`` on the CPU (``DEVICE=cpu``, no install; ``recipe`` for its pretraining parts):
    its summary's lines."""
    write_images(tmp_path / "data" / "train", per_class=40, size=32)  # 80 images: one step of the script's 64
    write_images(tmp_path / "data" / "test", per_class=4, size=32, seed=1)
    env = dict(os.environ, OUT=str(tmp_path / "out"), DATA=str(tmp_path / "data"), DEVICE="cpu")
    env.update(RUNS=str(tmp_path / "runs"), **({"RECIPE": str(recipe)} if recipe else {}))
    env.update(DEADLINE=str(deadline), SKIP=" ".join(["install", *skip]), OMP_NUM_THREADS="1")
    subprocess.run(["bash", str(BENCHMARKS / "gpu_check.sh")], env=env, check=True, capture_output=True)
    return (tmp_path / "out" / "summary.txt").read_text().splitlines()


@pytest.mark.slow
def test_gpu_check_runs_its_parts_in_order_skips_what_it_is_told_and_keeps_its_deadline(tmp_path, write_images):
    assert {"step_time_r50", "pretrain", "torchrun_nccl", "pytest", "demo"} <= set(GPU_CHECK_PARTS)  # parsed
    lines = gpu_check(tmp_path, write_images, skip=GPU_CHECK_PARTS, deadline=60)
    assert re.fullmatch(r"env rc=\d+ \d+s", lines[0]) and lines[1] == "install skipped (SKIP)"
    assert lines[2:-1] == [f"{name} skipped (SKIP)" for name in GPU_CHECK_PARTS]
    assert re.fullmatch(r"total \d+s", lines[-1])

    lines = gpu_check(tmp_path / "late", write_images, skip=[], deadline=0)  # no time left: nothing runs
    assert lines[0] == "env skipped (deadline)"
    assert lines[2:-1] == [f"{name} skipped (deadline)" for name in GPU_CHECK_PARTS]


@pytest.mark.slow  # real pretraining and a torchrun launch on the CPU
def test_gpu_check_dry_run_on_the_cpu_pretrains_evaluates_and_launches_torchrun(tmp_path, write_images, tiny_recipe):
    parts = ["pretrain", "torchrun_nccl"]  # on the tiny recipe (cifar10_fast's network took most of 95 s here)
    recipe = tmp_path / "tiny64.yaml"  # the script trains at batch 64: a queue of 64 words
    recipe.write_text(tiny_recipe.read_text().replace("num_words: 16", "num_words: 64", 1))
    skip = [p for p in GPU_CHECK_PARTS if p not in parts]
    lines = gpu_check(tmp_path, write_images, skip=skip, deadline=300, recipe=recipe)
    ran = {line.split()[0]: line.split()[1] for line in lines if " rc=" in line}
    assert ran["pretrain"] == "rc=0" and ran["torchrun_nccl"] == "rc=0", (tmp_path / "out" / "all.log").read_text()
    log = (tmp_path / "out" / "all.log").read_text()
    assert "top-1" in log and log.count("done: 2 epochs") == 2  # the kNN table, and both runs finished


# ------------------------------------------------------------------ the data pipelines' benchmarks (issue 37)


@pytest.fixture(scope="module")
def throughput():
    import importlib
    import sys

    sys.path.insert(0, str(BENCHMARKS))  # as a module of its name: its dataclass and gpu_profile's import need it
    return importlib.import_module("throughput")


@pytest.mark.slow
def test_throughput_times_both_pipelines_and_both_diagnostics_rhythms(throughput, tmp_path, tiny_recipe, write_images):
    data = write_images(tmp_path / "data", per_class=8, size=20)
    common = ["--config", str(tiny_recipe), "--data", str(data), "--device", "cpu", "--steps", "2", "--rounds", "2"]
    common += ["--warmup", "1", "--min-images", "32", "--workers", "1", "--cache-dir", str(tmp_path / "cache")]
    result = throughput.main([*common, "--json", str(tmp_path / "t.json"), "train.tensorboard=false"])
    assert set(result["images_per_s"]) == {"workers", "device"}
    for rates in result["images_per_s"].values():
        assert set(rates) == {"end_to_end", "loader", "step"} and all(r > 0 for r in rates.values())
    for times in result["seconds"].values():
        assert all(len(t) == 2 for t in times.values())  # one timing per round
    both = throughput.main(
        [*common, "--pipelines", "device", "--diagnose", "every", "logged", "--json", str(tmp_path / "t.json")]
    )
    assert set(both["images_per_s"]) == {"device, diagnostics every", "device, diagnostics logged"}
    assert len(json.loads((tmp_path / "t.json").read_text())) == 2  # --json appends


#: The compiled-step benchmarks' tests on the tiny recipe's network with one block a stage: the plumbing is the same,
#: and Dynamo's time grows with the number of operators it traces.
ONE_BLOCK = "model.arch_options.layers=[1,1,1,1]"


@pytest.mark.slow
def test_throughput_times_the_compile_settings_in_the_same_rounds(
    throughput, tmp_path, tiny_recipe, write_images, monkeypatch
):
    """``--compile off step``: both settings timed in each round, the warm-up (the compilation) apart; the step
    traced by Dynamo and run by aot_eager (Inductor's C++ takes minutes on a CPU), no CUDA graphs on a CPU."""
    from obow.training.step import compiled

    monkeypatch.setattr(compiled, "BACKEND", compiled.BACKEND)  # restored after: main sets them
    monkeypatch.setattr(compiled, "OPTIONS", compiled.OPTIONS)
    data = write_images(tmp_path / "data", per_class=8, size=20)
    result = throughput.main(
        ["--config", str(tiny_recipe), "--data", str(data), "--device", "cpu", "--steps", "1", "--rounds", "2",
         "--warmup", "1", "--min-images", "16", "--pipelines", "device", "--cache-dir", str(tmp_path / "cache"),
         "--compile", "off", "step", "--measures", "end_to_end", "step", "--compile-backend", "aot_eager",
         "--compile-mode", "reduce-overhead", ONE_BLOCK]
    )  # fmt: skip
    names = {"device, compile off", "device, compile step"}
    assert set(result["images_per_s"]) == names == set(result["warmup_s"])
    assert all(set(t) == {"end_to_end", "step"} for t in result["seconds"].values())
    assert all(len(t) == 2 for times in result["seconds"].values() for t in times.values())
    assert result["compile"] == ["off", "step"] and result["cudagraphs"] is False and result["warmup_steps"] == 2
    assert all(r > 0 for rates in result["images_per_s"].values() for r in rates.values())


@pytest.mark.slow
def test_throughput_times_off_against_graph_and_writes_each_measurement_at_once(
    throughput, tmp_path, tiny_recipe, write_images, monkeypatch
):
    """``--compile off graph --stand-in --jsonl``: both settings in each round, the graphed one captured during its
    warm-up (the tape standing in for the CUDA graph) and replayed in the timings; one JSON line per warm-up and per
    round of each measure, written as they are made, then the summary."""
    from obow.training.step import graphed

    monkeypatch.setattr(graphed, "STAND_IN", graphed.STAND_IN)  # restored after: main sets it
    data = write_images(tmp_path / "data", per_class=8, size=20)
    lines = tmp_path / "t.jsonl"
    result = throughput.main(
        ["--config", str(tiny_recipe), "--data", str(data), "--device", "cpu", "--steps", "2", "--rounds", "2",
         "--warmup", "5", "--min-images", "16", "--pipelines", "device", "--cache-dir", str(tmp_path / "cache"),
         "--compile", "off", "graph", "--stand-in", "--measures", "end_to_end", "step", "--jsonl", str(lines),
         "train.log_every=10"]
    )  # fmt: skip
    graph = result["graph"]["device, compile graph"]
    assert graph["captured"] and graph["capture_s"] > 0 and graph["replays"] == 2 * 2 * 2 and not graph["eager_why"]
    records = [json.loads(line) for line in lines.read_text().splitlines()]
    settings = ["device, compile off", "device, compile graph"]
    assert [(r["setting"], r["measure"]) for r in records[:2]] == [(s, "warmup") for s in settings]
    timed = [(r["setting"], r["measure"], r["round"]) for r in records[2:-1]]
    assert sorted(timed) == sorted((s, m, r) for s in settings for m in ("end_to_end", "step") for r in (0, 1))
    assert records[-1]["measure"] == "summary" and records[-1]["images_per_s"] == result["images_per_s"]
    assert all(r["images_per_s"] > 0 and r["t_s"] >= 0 for r in records[2:-1])


@pytest.mark.slow
def test_gpu_graph_smoke_runs_on_the_cpu_with_the_tape(tmp_path, tiny_recipe, write_images, monkeypatch):
    """benchmarks/gpu_graph.py's plumbing on a CPU: the capture, the graphed run against the eager one from one state
    (the tape replays the eager step bit for bit), the synchronisation check skipped (no CUDA), every part a JSON
    line."""
    from obow.training.step import graphed

    monkeypatch.setattr(graphed, "STAND_IN", graphed.STAND_IN)
    gpu_graph = load_script("gpu_graph")
    data = write_images(tmp_path / "data", per_class=8, size=20)
    out = tmp_path / "graph.jsonl"
    lines = gpu_graph.main(
        ["--config", str(tiny_recipe), "--data", str(data), "--device", "cpu", "--stand-in", "--steps", "9",
         "--replays", "2", "--min-images", "16", "--cache-dir", str(tmp_path / "cache"), "--jsonl", str(out),
         "train.log_every=4"]
    )  # fmt: skip
    parts = [line["part"] for line in lines]
    assert parts == ["capture", "graph_run", "eager_run", "compare", "sync_check"]
    capture, graph_run, _, compare, sync = lines
    assert capture["captured"] and capture["capture_s"] > 0 and capture["first_replay_after_s"] > 0
    assert graph_run["logged"] == [3, 7] and graph_run["replays"] == 9 - 2 - graphed.WARMUP_STEPS - 1
    assert compare["bit_equal"] is True and compare["loss_rel_diff_max"] == 0.0
    assert sync == {"part": "sync_check", "replays": 2, "error": None, "checked": False}
    assert [json.loads(line)["part"] for line in out.read_text().splitlines()] == parts


@pytest.mark.slow
def test_gpu_compile_checks_run_on_the_cpu(throughput, tmp_path, tiny_recipe, write_images, monkeypatch):
    """benchmarks/gpu_compile.py's plumbing: a compiled step warmed up (the first step logged) and counted; on a CPU
    no CUDA graph and no synchronisation check."""
    from obow.training.step import compiled

    monkeypatch.setattr(compiled, "BACKEND", compiled.BACKEND)
    gpu_compile = load_script("gpu_compile")
    data = write_images(tmp_path / "data", per_class=8, size=20)
    result = gpu_compile.main(
        ["--config", str(tiny_recipe), "--data", str(data), "--device", "cpu", "--warmup", "2", "--min-images", "16",
         "--cache-dir", str(tmp_path / "cache"), "--compile-backend", "aot_eager", "--json", str(tmp_path / "c.json"),
         ONE_BLOCK]
    )  # fmt: skip
    assert result["cudagraph_skips"] == 0 and result["sync_error"] is None
    assert result["unique_graphs"] == 3  # the unlogged and the logged forward-backward, the optimiser (no probe's)
    assert result["cudagraphs"] is False and result["sync_checked_steps"] == 0
    assert json.loads((tmp_path / "c.json").read_text()) == result


def test_the_benchmark_step_diagnoses_as_the_loop_does(throughput, tmp_path, tiny_recipe, write_images):
    """``--diagnose logged`` computes the collapse diagnostics every ``train.log_every``-th step, as ``obow
    pretrain``; ``every`` on each step."""
    data = write_images(tmp_path / "data", per_class=4, size=20)
    cfg = load_config(
        tiny_recipe, [f"data.path={data}", "data.pipeline=device", f"data.cache_dir={tmp_path}", "train.log_every=3"]
    )
    for diagnose, expected in (("logged", [False, False, True, False, False, True]), ("every", [True] * 6)):
        setup = throughput.build("device", cfg, torch.device("cpu"), min_images=8, diagnose=diagnose)
        seen = []
        for _ in range(6):
            throughput.step(setup, next(setup.batches))
            seen.append(setup.run.model.diagnose)
        assert seen == expected, diagnose


def test_views_libraries_compares_obow_with_the_installed_libraries(tmp_path):
    views_libraries = load_script("views_libraries")
    rates = views_libraries.main(["--config", "cifar10_fast", "--device", "cpu", "--batch", "8", "--repeats", "2"])
    assert rates["obow"] > 0 and all(r > 0 for r in rates.values())


@pytest.mark.slow
def test_render_times_the_eager_dense_compiled_and_graphed_renders_in_the_same_rounds(tmp_path, capsys):
    render = load_script("render")
    out = tmp_path / "render.json"
    result = render.main(["--config", "cifar10_fast", "--device", "cpu", "--warmup", "1", "--steps", "1", "--rounds",
                          "2", "--compile-backend", "aot_eager", "--json", str(out), "data.batch_size=4",
                          "--modes", "eager", "dense", "slots", "compiled", "graphed"])  # fmt: skip
    assert json.loads(out.read_text()) == result
    assert set(result["images_per_s"]) == {"eager", "dense", "slots", "compiled", "graphed"} and result["compile_s"] > 0
    assert result["capture_s"] > 0  # the tape stands in for the CUDA graph on a CPU
    assert all(len(r) == 2 and min(r) > 0 for r in result["rounds"].values())
    assert result["batch"] == 4 and result["side"] == 46
    # aot_eager and the graph replay the same operators on the same draws
    assert result["max_abs_diff"] == {"eager": 0.0, "dense": 0.0, "slots": 0.0, "compiled": 0.0, "graphed": 0.0}
    assert result["ahead_equal"] is None  # no streams on a CPU
    printed = capsys.readouterr().out
    assert "compilation (first compiled call)" in printed and "capture (first graphed call)" in printed
    assert "render: compiled in" in printed and "render: captured in" in printed  # as they exist
    assert printed.count("render: round ") == 2 and "render: round 1: eager " in printed


def test_render_times_the_render_of_a_git_commit_beside_todays(capsys):
    """``--baseline REF``: the render as it was at a commit (here HEAD), loaded from git, timed in the same rounds;
    the mode without ``--baseline`` is refused in one line."""
    render = load_script("render")
    result = render.main(["--config", "cifar10_fast", "--device", "cpu", "--warmup", "0", "--steps", "1", "--rounds",
                          "2", "--modes", "eager", "baseline", "--baseline", "HEAD", "data.batch_size=4"])  # fmt: skip
    assert set(result["images_per_s"]) == {"eager", "baseline"} and result["baseline"] == "HEAD"
    assert all(len(r) == 2 and min(r) > 0 for r in result["rounds"].values())
    assert math.isfinite(result["max_abs_diff"]["baseline"]) and result["max_abs_diff"]["eager"] == 0.0
    assert "the render at HEAD" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="needs --baseline"):
        render.main(["--config", "cifar10_fast", "--device", "cpu", "data.batch_size=4", "--modes", "baseline"])


def test_render_change_compares_the_views_with_a_commits_and_pillows(tmp_path, write_images, capsys):
    """``render_change.py`` on a few images against the render at HEAD: nothing moved; today's crops and colour
    jitter against Pillow's within its rounding; a folder of several sizes is refused in one line."""
    render_change = load_script("render_change")
    folder = write_images(tmp_path / "images", per_class=3, size=32)
    out = tmp_path / "change.json"
    result = render_change.main(["--config", "cifar10_fast", "--folder", str(folder), "--baseline", "HEAD",
                                 "--images", "5", "--json", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == result and result["images"] == 5 and result["size"] == [32, 32]
    for kind in ("teacher", "crops", "patch grid"):
        assert result["resampling"][kind]["today_vs_baseline"]["max"] == 0.0, kind
        assert result["resampling"][kind]["today_vs_pillow"]["max"] <= 2.0, kind
    assert result["resampling"]["crops"]["inside_share"] > 0.5
    assert all(v["max"] == 0.0 for v in result["views"].values())
    assert result["jitter"]["today"] == result["jitter"]["baseline"]
    assert result["jitter"]["today"]["pillows_level_for_level"] == "10/10"
    assert "today against HEAD and Pillow" in capsys.readouterr().out
    Image.new("RGB", (40, 32)).save(folder / "wide.png")
    with pytest.raises(SystemExit, match="several sizes"):
        render_change.main(["--config", "cifar10_fast", "--folder", str(folder), "--baseline", "HEAD"])


def test_monitor_times_reading_and_keeping_monitors_on_the_same_backbone(tmp_path, tiny_recipe, write_images):
    monitor = load_script("monitor")
    train, val = write_images(tmp_path / "train", per_class=5, size=28), write_images(tmp_path / "val", per_class=3)
    out = tmp_path / "monitor.json"
    result = monitor.main(["--config", str(tiny_recipe), "--train", str(train), "--val", str(val), "--device", "cpu",
                           "--rounds", "2", "--json", str(out), "train.knn_k=3"])  # fmt: skip
    assert json.loads(out.read_text()) == result
    assert result["images"] == 16 and result["same_numbers"] is True
    assert all(len(r) == 2 and min(r) > 0 for r in result["rounds"].values())
    assert result["keeping_first_s"] > 0 and result["speedup"] == round(
        result["reading_s"] / result["keeping_later_s"], 2
    )


@pytest.mark.slow
def test_gpu_profile_runs_on_the_cpu(throughput, tmp_path, tiny_recipe, write_images, capsys):
    gpu_profile = load_script("gpu_profile")
    data = write_images(tmp_path / "data", per_class=8, size=20)
    gpu_profile.main(["--config", str(tiny_recipe), "--data", str(data), "--device", "cpu", "--steps", "1",
                      "--warmup", "1", "--cache-dir", str(tmp_path / "cache"), "--top", "5"])  # fmt: skip
    out = capsys.readouterr().out
    assert "wall per step:" in out and "views: host" in out and "step: host" in out


def test_gpu_profile_counts_the_device_busy_once_where_streams_overlap(throughput):
    device_work = load_script("gpu_profile").device_work
    # two steps; stream 7 (the step): 0-10, 20-30 ms; stream 9 (the views): 5-15 (overlaps), 40-42 (alone), and a
    # kernel inside another (22-24)
    ms = 1_000_000
    spans = [(7, 0, 10 * ms), (9, 5 * ms, 15 * ms), (7, 20 * ms, 30 * ms), (9, 22 * ms, 24 * ms), (9, 40 * ms, 42 * ms)]
    work = device_work(reversed(spans), steps=2)
    assert work["busy_ms"] == pytest.approx((15 + 10 + 2) / 2)  # 0-15, 20-30, 40-42
    assert work["summed_ms"] == pytest.approx((10 + 10 + 10 + 2 + 2) / 2)
    assert work["launches"] == 2.5
    assert work["streams"][7] == {"ms": pytest.approx(10.0), "launches": 1.0}
    assert work["streams"][9] == {"ms": pytest.approx(7.0), "launches": 1.5}
    assert device_work([], steps=3)["busy_ms"] == 0.0
    top_kernels = load_script("gpu_profile").top_kernels
    kernels = [(7, "conv", 4 * ms), (7, "bn", 1 * ms), (7, "conv", 2 * ms), (9, "blur", 3 * ms), (7, "relu", 2 * ms)]
    expected = {7: [("conv", 3.0, 1.0), ("relu", 1.0, 0.5)], 9: [("blur", 1.5, 0.5)]}
    assert top_kernels(kernels, steps=2, top=2) == expected


@pytest.mark.parametrize(
    "script, expected",
    [
        ("gpu_throughput.sh", {"c10r18", "c10r18_big", "quality", "profile", "libraries"}),
        ("gpu_compile.sh", {"checks", "checks_moco", "render", "c10r18", "c10fast", "in20", "r50", "monitor"}),
        (
            "gpu_graph.sh",
            {
                "smoke",
                "c10r18_512",
                "c10fast_512",
                "c10r18_rec",
                "c10fast_rec",
                "in20",
                "r50",
                "views_render",
                "views_noblur",
                "views_workers",
                "render_in20",
                "profile_in20",
                "render_in20_compiled",
            },
        ),  # fmt: skip
    ],
)
def test_gpu_pass_skips_what_it_is_told_and_keeps_its_deadline(tmp_path, script, expected):
    parts = re.findall(r"^part (\w+)", (BENCHMARKS / script).read_text(), flags=re.M)
    assert expected <= set(parts)
    env = dict(os.environ, OUT=str(tmp_path / "out"), C10=str(tmp_path), INETTE=str(tmp_path), DEVICE="cpu")
    env.update(DEADLINE="60", SKIP=" ".join(parts))
    subprocess.run(["bash", str(BENCHMARKS / script)], env=env, check=True, capture_output=True)
    lines = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert lines[:-1] == [f"{name} skipped (SKIP)" for name in parts] and re.fullmatch(r"total \d+s", lines[-1])
    env.update(DEADLINE="0", SKIP="", OUT=str(tmp_path / "late"))
    subprocess.run(["bash", str(BENCHMARKS / script)], env=env, check=True, capture_output=True)
    lines = (tmp_path / "late" / "summary.txt").read_text().splitlines()
    assert lines[:-1] == [f"{name} skipped (deadline)" for name in parts]


def test_step_ops_counts_each_steps_operations_by_call_site(throughput, tmp_path, tiny_recipe, write_images):
    """benchmarks/step_ops.py on the CPU: an unlogged step issues the targets' diagnostics no longer (they appear
    on the logged step only), the fused optimiser is a handful of operations, and the views' device side (rendered
    from images on the ``meta`` device) is told apart from their host side."""
    step_ops = load_script("step_ops")
    data = write_images(tmp_path / "data", per_class=8, size=20)
    result = step_ops.main(["--config", str(tiny_recipe), "--data", str(data), "--batch", "4",
                            "--cache-dir", str(tmp_path / "cache"), "--json", str(tmp_path / "ops.json")])  # fmt: skip
    unlogged, logged, views = result["step (unlogged)"], result["step (logged)"], result["views (device side)"]
    assert 0 < unlogged["total"] < logged["total"]
    assert "bow.targets:kl_to_mean_bow" in logged["sites"] and "bow.targets:kl_to_mean_bow" not in unlogged["sites"]
    assert "diagnostics:effective_rank" in logged["sites"] and "diagnostics:effective_rank" not in unlogged["sites"]
    assert 0 < unlogged["sites"]["optimizer"] <= 10  # one fused update, not a few per parameter
    assert "_local_scalar_dense" not in unlogged["operators"]  # no wait for the device (the momentum's iteration)
    assert logged["operators"]["_local_scalar_dense"] >= 1  # the logged step checks it against the model's
    assert unlogged["sites"]["backward"] > 0 and any(s.startswith("backbones") for s in unlogged["sites"])
    assert views["total"] > 0 and views["host"] > 0
    assert all(site.startswith("data.batched_views") for site in views["sites"])
    assert json.loads((tmp_path / "ops.json").read_text())["step (unlogged)"]["total"] == unlogged["total"]


def test_step_ops_charges_operations_to_obows_files_when_torch_lives_under_a_folder_named_obow(throughput, tmp_path):
    """A clone in a folder named ``obow`` with its venv inside puts torch's files under ``obow/.venv/``: an
    operation that torch issues there, called from obow's ``bow/targets.py``, is charged to obow's function, not
    to the torch file whose path holds ``/obow/``."""
    import obow

    step_ops = load_script("step_ops")
    torch_file = tmp_path / "obow" / ".venv" / "lib" / "python3.11" / "site-packages" / "torch" / "nn" / "functional.py"
    obow_file = Path(obow.__file__).resolve().parent / "bow" / "targets.py"
    scope = {"torch": torch}
    exec(compile("def linear(x):\n    return torch.add(x, 1)\n", str(torch_file), "exec"), scope)
    exec(compile("def kl_to_mean_bow(x):\n    return linear(x) * 2\n", str(obow_file), "exec"), scope)
    x = torch.zeros(3)
    counter = step_ops.count(lambda: scope["kl_to_mean_bow"](x))
    assert counter.sites == {"bow.targets:kl_to_mean_bow": 2}
    assert counter.operators == {"add": 1, "mul": 1}


def test_the_throughput_commands_the_docs_give_parse(throughput):
    """Issue 45: docs/gpu.md gave `--steps 3-4` and no --config or --data."""
    import re
    import shlex

    found = 0
    for page in sorted((BENCHMARKS.parent / "docs").glob("*.md")):
        text = page.read_text()
        inline = re.findall(r"`python benchmarks/throughput\.py([^`]*)`", text)
        for command in inline + re.findall(r"^python benchmarks/throughput\.py([^#\n]*)", text, re.M):
            throughput.build_parser().parse_args(shlex.split(command))  # argparse exits on a wrong command
            found += 1
    assert found >= 3


# ------------------------------------------------------------------ the demo's time on this machine (issue 54)


def test_demo_time_reads_the_cpu_kind_and_the_pretrainings_parts(tmp_path):
    demo_time = load_script("demo_time")
    kind = demo_time.cpu_kind()
    assert isinstance(kind["native_bf16"], bool) and kind["cores"] >= 1 and kind["kind"]
    if Path("/proc/cpuinfo").is_file():
        assert set(kind["flags"]) == set(demo_time.CPU_FLAGS)
    log = tmp_path / "log.jsonl"
    records = [
        {"epoch": 1, "iteration": 7, "loss": 1.0},
        {"type": "epoch", "epoch": 1, "iteration": 56, "epoch_time_s": 20.0},
        {"type": "epoch", "epoch": 2, "iteration": 112, "epoch_time_s": 19.5, "monitor_time_s": 2.5},
    ]
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert demo_time.pretraining_parts(log) == {
        "steps": 112,
        "epochs": 2,
        "epochs_s": 39.5,
        "monitor_passes": 1,
        "monitor_s": 2.5,
    }


@pytest.mark.slow  # a real (tiny) demo in a child process
def test_demo_time_times_a_tiny_demo_and_writes_its_gain(tmp_path, capsys):
    from obow.experiments.demo import DATASETS

    demo_time = load_script("demo_time")
    out = tmp_path / "demo_time.json"
    tiny = ["optim.epochs=2", "data.images_per_class=32", "model.num_words=128", "data.num_workers=0"]
    result = demo_time.main(["--out", str(tmp_path / "runs"), "--seeds", "0", "--json", str(out), *tiny])
    assert json.loads(out.read_text()) == result
    (row,) = result["runs"]
    assert row["recipe"] in DATASETS["digits"].recipes and row["precision"] in ("bf16", "fp32")
    assert row["choice"].startswith(f"Demo: recipe '{row['recipe']}' in {row['precision']}")  # the probe's line
    assert row["gain"] == round(row["knn_pretrained"] - row["knn_random_init"], 2)
    assert row["wall_s"] > 0 and row["cpu_s"] > 0 and row["steps"] > 0 and row["epochs"] == 2
    assert "seed 0: recipe" in capsys.readouterr().out


def test_the_readme_lists_every_script_and_only_those_there():
    """benchmarks/README.md: one row per script in the folder, and its section of scripts that left names none
    still there."""
    text = (BENCHMARKS / "README.md").read_text()
    listed, left = text.split("## Left")
    scripts = {p.name for p in BENCHMARKS.iterdir() if p.suffix in (".py", ".sh")}
    rows = set(re.findall(r"^\| `([\w.]+\.(?:py|sh))` \|", listed, flags=re.M))
    assert rows == scripts
    gone = set(re.findall(r"^\| `([\w.]+\.py)` \|", left, flags=re.M))
    assert gone and not gone & scripts


# ------------------------------------------------------------------ obow's step against the authors' (issue 65)

#: a copy of valeoai/obow's modules (their code is run, never copied into this repository): the side-by-side
#: benchmark's real run is tested only where one is there
OFFICIAL = Path(os.environ.get("OBOW_OFFICIAL", "/work/official-obow"))


@pytest.mark.parametrize("builder", [None, "class OBoW(object):\n    pass\n"])
def test_official_step_refuses_a_folder_without_the_authors_code_in_one_line(tmp_path, tiny_recipe, builder):
    official_step = load_script("official_step")
    if builder is not None:  # a builder_obow.py that is not theirs (no OBoWSolver)
        (tmp_path / "obow").mkdir()
        (tmp_path / "obow" / "builder_obow.py").write_text(builder)
    with pytest.raises(SystemExit) as refused:
        official_step.main(["--official", str(tmp_path), "--config", str(tiny_recipe), "--device", "cpu"])
    message = refused.value.code
    assert isinstance(message, str) and "\n" not in message  # one line, printed by Python without a traceback
    assert message.startswith(f"--official {tmp_path}: not a copy of the authors' code (valeoai/obow)")
    assert "obow/builder_obow.py" in message


@pytest.mark.skipif(not (OFFICIAL / "obow" / "builder_obow.py").is_file(), reason=f"no valeoai/obow copy at {OFFICIAL}")
def test_official_step_runs_both_steps_from_the_same_weights_and_catches_another_computation(tmp_path, tiny_recipe):
    """One round on the tiny recipe: obow's step is the authors' computation (the first step's loss and the
    student after it), a setting at another learning rate is caught (status 1), and the authors' modules are
    gone from ``sys.modules`` afterwards (their package is also named ``obow``)."""
    import sys

    import obow

    official_step = load_script("official_step")
    threads = torch.get_num_threads()
    out = tmp_path / "steps.json"
    argv = ["--official", str(OFFICIAL), "--config", str(tiny_recipe), "--rounds", "1", "--warmup", "0"]
    argv += ["--threads", "1", "--device", "cpu", "--json", str(out)]
    status = official_step.main([*argv, "--obow-settings", "--obow-settings", "optim.lr=0.01"])
    torch.set_num_threads(threads)
    assert status == 1  # the second setting is not the authors' step
    result = json.loads(out.read_text())
    steps = result["steps"]
    assert list(steps) == ["authors", "obow", "obow optim.lr=0.01"]
    assert all(len(s["seconds"]) == 1 and s["median_s"] > 0 for s in steps.values())
    same, other = steps["obow"], steps["obow optim.lr=0.01"]
    assert same["same_computation"] and same["first_loss"] == pytest.approx(steps["authors"]["first_loss"], rel=1e-5)
    assert same["student_max_abs_difference"] < 1e-3 * steps["authors"]["student_max_abs_change"]
    assert (
        not other["same_computation"]
        and other["student_max_abs_difference"] > 0.1 * steps["authors"]["student_max_abs_change"]
    )
    assert set(result["cpu"]) >= {"model", "flags"} and result["torch"] == torch.__version__
    assert "--obow-settings optim.lr=0.01" in result["command"]
    assert not {f"obow.{name}" for name in official_step.OFFICIAL_MODULES} & set(sys.modules)  # theirs: obow.fewshot
    assert not any(hasattr(obow, name) for name in official_step.OFFICIAL_MODULES)


def test_step_profile_groups_a_real_steps_operators_and_writes_its_machine(tiny_recipe, tmp_path, capsys):
    step_profile = load_script("step_profile")
    out = tmp_path / "profile.json"
    result = step_profile.main(["--config", str(tiny_recipe), "--warmup", "1", "--steps", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == result
    shares = [g["share"] for g in result["groups"].values()]
    assert math.isclose(sum(shares), 1.0, rel_tol=1e-6) and result["groups"]["convolution"]["seconds"] > 0
    assert result["step_seconds_unprofiled"] > 0 and result["top_convolutions"]
    assert set(result["machine"]) >= {"cpu", "capability", "torch"} and "--steps 1" in result["command"]
    assert step_profile.group_of("aten::convolution_backward") == "convolution"
    assert step_profile.group_of("aten::native_batch_norm") == "batch norm"
    assert step_profile.group_of("aten::_fused_sgd_") == "optimiser (SGD)"
    assert "a step unprofiled" in capsys.readouterr().out


def test_recipe_steps_times_variants_and_counts_their_steps(tiny_recipe, capsys):
    """Two variants of one recipe, the second at half the batch: twice the steps an epoch over the same images,
    its pretraining time over the first's is each round's ratio times the steps' ratio (the first's is 1)."""
    recipe_steps = load_script("recipe_steps")
    cfg = load_config(str(tiny_recipe))
    images = 10 * cfg.data.batch_size + 3  # the loop drops the last, partial batch
    half = f"data.batch_size={cfg.data.batch_size // 2}"
    argv = ["--images", str(images), "--warmup", "1", "--repeats", "2", "--threads", "1"]
    variants = ["--variant", "base", str(tiny_recipe), "--variant", "half", str(tiny_recipe), half]
    rows = recipe_steps.main([*argv, *variants])
    assert rows["base"]["steps"] == cfg.optim.epochs * 10 and rows["half"]["steps"] == cfg.optim.epochs * 20
    assert rows["base"]["ratio"] == 1.0 and rows["half"]["ratio"] > 0
    assert rows["half"]["seconds"] == pytest.approx(rows["half"]["median"] * rows["half"]["steps"])
    assert "| half |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        recipe_steps.main([*argv, "--variant", "base", str(tiny_recipe)])  # one variant: nothing to compare


def test_the_avx2_pass_lists_its_parts_skips_what_it_is_told_and_refuses_an_avx512_cpu(tmp_path):
    """``benchmarks/avx2_pass.sh``: a dry run names each part's command in order (the official step only with a copy
    of the authors' code) and writes nothing; on a CPU with AVX-512 a real run refuses in one line (exit 2)."""
    script = BENCHMARKS / "avx2_pass.sh"
    env = {**os.environ, "DRY": "1", "OUT": str(tmp_path / "out"), "SKIP": "busy", "OFFICIAL": "/x/obow"}
    dry = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    assert [line.split(":")[0].split()[0] for line in lines] == ["suite", "demo", "official", "profile", "busy"]
    assert "demo_time.py" in lines[1] and "--seeds 0 1 2" in lines[1] and "--official '/x/obow'" in lines[2]
    assert lines[4] == "busy skipped" and not (tmp_path / "out").exists()
    for name in re.findall(r"benchmarks/(\w+\.py)", dry.stdout):
        assert (BENCHMARKS / name).is_file(), name
    del env["OFFICIAL"]
    assert "official skipped" in subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True).stdout
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file() and "avx512f" in cpuinfo.read_text():
        env.pop("DRY")
        refused = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "AVX2-only" in refused.stderr
        assert not (tmp_path / "out").exists()


def test_busy_machine_reads_its_settings_and_a_runs_last_epoch(tmp_path):
    busy_machine = load_script("busy_machine")
    assert busy_machine.parse_setting("obow=") == ("obow", {})
    assert busy_machine.parse_setting("p=OMP_NUM_THREADS=2,OMP_WAIT_POLICY=PASSIVE") == (
        "p",
        {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"},
    )
    assert [busy_machine.parse_setting(s)[0] for s in busy_machine.DEFAULT_SETTINGS] == ["obow", "fixed-2", "passive"]


@pytest.mark.slow
def test_photo_decoding_times_whole_and_reduced_jpegs_in_the_same_rounds(tmp_path, capsys):
    """Two 480x360 sample photos, the tiny-sized rounds: both ways timed each round, by a worker and into the image
    cache, the reduced images' views of the recipe's shapes and their cached size, the JSON as printed."""
    result = load_script("photo_decoding").main(
        ["--config", "imagenette_fast", "--size", "480", "360", "--photos", "2", "--images", "2", "--rounds", "2",
         "--json", str(tmp_path / "p.json")]
    )  # fmt: skip
    assert json.loads((tmp_path / "p.json").read_text()) == result
    assert result["sharp_side"] == 233 and set(result["rounds"]) == {"whole", "reduced"}
    assert all(len(r) == 2 and min(r) > 0 for r in result["rounds"].values())
    assert result["views_shapes"]["teacher"] == [3, 80, 80]
    assert set(result["cache_rounds"]) == {"whole", "reduced"}
    assert all(len(r) == 2 and min(r) > 0 for r in result["cache_rounds"].values())
    assert result["cache_stored_shape"] == [3, 233, 311]  # 480x360 kept at the sharp side, reduced or not
    lines = capsys.readouterr().out.splitlines()
    assert "images/s a worker" in lines[-2] and "images/s a process" in lines[-1]
