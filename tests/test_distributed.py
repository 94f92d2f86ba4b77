"""Two real processes on the CPU (gloo): the distributed path must equal one process on the combined batch.

Batch-norm statistics depend on how the batch is split, so the full-model comparison uses backbones whose
batch norms are replaced by identities; the BoW machinery is compared on its own as well, with the real
vocabulary rules. Randomised choices (a random location per image, rare-word replacement) cannot match a
single process draw for draw; for those the processes must agree with each other.

The full-model runs are in float64: the k-means vocabulary's nearest-word bookkeeping is discrete, and in
float32 the rounding differences between split and whole-batch reductions flip near-ties (we saw a word's
``last_assigned`` differ), which says nothing about the distributed code. In float64 they do not.
"""

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from obow.bow.targets import BoWExtractor
from obow.bow.vocabulary import KMeansVocabulary, QueueVocabulary
from obow.config import ModelConfig
from obow.distributed import ddp_without_buffer_sync
from obow.methods.obow import OBoW
from obow.training.step.shared import forward_backward

WORLD = 2
BATCH = 8  # global
STEPS = 3
DTYPE = torch.float64


def without_batchnorm(module: nn.Module) -> nn.Module:
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d):
            setattr(module, name, nn.Identity())
        else:
            without_batchnorm(child)
    return module


def model_config(**extra) -> ModelConfig:
    """The tiny recipe's narrow timm ResNet-18 (8 to 16 channels a stage): what is compared is how two processes
    split a step, which the width does not change (the full-width ResNet-18 in float64 took most of this module's
    time)."""
    options = {"channels": [8, 8, 16, 16], "stem_width": 8}
    return ModelConfig(
        arch="timm:resnet18", arch_options=options, stem="cifar", levels=("conv4",), num_words=16, kappa=5.0, **extra
    )


def build_model(cfg: ModelConfig) -> OBoW:
    torch.manual_seed(0)
    model = OBoW.from_config(cfg, total_iterations=10)
    without_batchnorm(model.student)
    without_batchnorm(model.teacher)
    return model.to(DTYPE)


def batches():
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(BATCH, 3, 24, 24, generator=g, dtype=DTYPE),
            [
                torch.randn(BATCH, 2, 3, 16, 16, generator=g, dtype=DTYPE),
                torch.randn(BATCH, 3, 3, 12, 12, generator=g, dtype=DTYPE),
            ],
        )
        for _ in range(STEPS)
    ]


def train(model: nn.Module, inner: OBoW, rank: int, world: int, per_group: bool = False) -> None:
    opt = torch.optim.SGD([p for p in inner.parameters() if p.requires_grad], lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    per = BATCH // world
    for teacher, views in batches():
        sl = slice(rank * per, (rank + 1) * per)
        opt.zero_grad()
        forward_backward(model, teacher[sl], [v[sl] for v in views], scaler, contextlib.nullcontext(), per_group)
        opt.step()


MODEL_CFGS = {
    "queue": dict(queue_sampling="global_average"),
    "kmeans_sinkhorn": dict(vocabulary="kmeans", assignment="sinkhorn", rare_word_steps=None),
    "queue_per_group_backward": dict(queue_sampling="global_average"),
    # each process runs the weight generator over K / 2 words; weights, gradients and BN statistics must not change
    "split_generator": dict(queue_sampling="global_average", split_generator=True),
    "split_generator_per_group_backward": dict(queue_sampling="global_average", split_generator=True),
}


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        for name, extra in MODEL_CFGS.items():
            cfg = model_config(**extra)
            inner = build_model(cfg)
            ddp = ddp_without_buffer_sync(inner)
            train(ddp, inner, rank, WORLD, per_group="per_group" in name)
            torch.save(inner.state_dict(), Path(out_dir) / f"{name}_rank{rank}.pt")

        # Random choices: queue with a random 3x3-averaged location, k-means with rare-word replacement.
        torch.manual_seed(100 + rank)  # different random streams per process, as in a real run
        fmaps = torch.randn(STEPS, BATCH, 8, 5, 5, generator=torch.Generator().manual_seed(2)).relu()
        queue = BoWExtractor(QueueVocabulary(16, 8, "local_average"), delta_base=0.1).train()
        kmeans = BoWExtractor(KMeansVocabulary(16, 8, rare_word_steps=1), delta_base=0.1).train()
        for ext in (queue, kmeans):
            dist.broadcast(ext.vocabulary.words, 0)
        per = BATCH // WORLD
        for fmap in fmaps:
            queue(fmap[rank * per : (rank + 1) * per])
            kmeans(fmap[rank * per : (rank + 1) * per] * 3)
        torch.save(
            {"queue": queue.state_dict(), "kmeans": kmeans.state_dict()}, Path(out_dir) / f"random_rank{rank}.pt"
        )
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_process_states(tmp_path_factory, free_port):
    out = tmp_path_factory.mktemp("dist")
    mp.start_processes(_worker, args=(free_port(), str(out)), nprocs=WORLD, start_method="spawn")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODEL_CFGS))
def test_two_processes_equal_one_process_on_the_combined_batch(two_process_states, name):
    states = [torch.load(two_process_states / f"{name}_rank{r}.pt") for r in range(WORLD)]
    cfg = model_config(**MODEL_CFGS[name])
    single = build_model(cfg)
    train(single, single, 0, 1, per_group="per_group" in name)
    reference = single.state_dict()
    assert reference["extractors.conv4.vocabulary.words"].abs().sum() > 0
    for key, value in reference.items():
        # every process holds identical state (vocabulary, statistics, teacher, student) ...
        torch.testing.assert_close(states[0][key], states[1][key], rtol=0, atol=0, msg=key)
        # ... equal to one process on the whole batch, up to float64 rounding of the split reductions
        scale = max(1.0, float(value.float().abs().max()))
        torch.testing.assert_close(states[0][key], value, rtol=1e-9, atol=1e-10 * scale, msg=key)
    for key in ("extractors.conv4.min_distance_mean", "iteration"):
        assert key in reference


@pytest.mark.slow
def test_random_vocabulary_choices_agree_across_processes(two_process_states):
    a, b = (torch.load(two_process_states / f"random_rank{r}.pt") for r in range(WORLD))
    for part in ("queue", "kmeans"):
        for key, value in a[part].items():
            torch.testing.assert_close(value, b[part][key], rtol=0, atol=0, msg=f"{part}.{key}")
    assert int(a["queue"]["vocabulary.ptr"]) == (STEPS * BATCH) % 16
    assert int(a["kmeans"]["vocabulary.step"]) == STEPS


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", ["workers", "device"])
def test_torchrun_pretraining_on_two_cpu_processes(tmp_path, tiny_recipe, write_images, free_port, pipeline):
    """The real launcher: `torchrun --nproc_per_node 2 -m obow.cli pretrain ...` with gloo on the CPU; on the device
    pipeline each process renders its share of every global batch from the one cache."""
    recipe = tiny_recipe
    data = write_images(tmp_path / "data", per_class=8)
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
        "-m", "obow.cli", "pretrain", "--config", str(recipe), "--data", str(data), "--out", str(out),
        "optim.epochs=1", "train.knn_every=0", f"data.pipeline={pipeline}", f"data.cache_dir={tmp_path / 'cache'}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from obow.weights.checkpoint import load_checkpoint

    ckpt = load_checkpoint(out / "checkpoint.pt")
    assert ckpt["iteration"] == 2  # 16 images, global batch 8
    assert len((out / "log.jsonl").read_text().splitlines()) == 3  # only rank 0 writes: 2 steps + 1 epoch
    assert proc.stderr.count("New run") == 1
    made = "Data: views made on the cpu from" if pipeline == "device" else "Data: views made by"
    assert proc.stderr.count(made) == 1  # the main process's header
    assert proc.stderr.count("Data: decoding 16 images") == (pipeline == "device")  # by one process, not each
    assert load_checkpoint(out / "checkpoint.pt")["config"]["data"]["pipeline"] == pipeline


@pytest.mark.slow
def test_torchrun_on_a_folder_the_cache_cannot_read_stops_both_processes(tmp_path, tiny_recipe, free_port):
    """The first process builds the device pipeline's cache; when it cannot, the other stops too (it does not
    wait for a cache that will not come), each with one line. A batch of junk files: fewer are refused as too
    few for a batch before any process builds anything."""
    for i in range(8):
        (tmp_path / "bad" / "a").mkdir(parents=True, exist_ok=True)
        (tmp_path / "bad" / "a" / f"{i}.png").write_bytes(b"junk")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
        "-m", "obow.cli", "pretrain", "--config", str(tiny_recipe), "--data", str(tmp_path / "bad"),
        "--out", str(tmp_path / "run"), "data.pipeline=device", f"data.cache_dir={tmp_path / 'cache'}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode != 0
    assert f"obow: error: no readable image under {tmp_path / 'bad'}" in proc.stderr
    assert "obow: error: the image cache could not be built: see the first process's message" in proc.stderr
    assert not (tmp_path / "run" / "checkpoint.pt").exists()
