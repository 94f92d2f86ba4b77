"""MoCo v2 (the paper's appendix baseline): the InfoNCE loss against float64 references, the queue, the momentum
key encoder, the views, two real gloo processes, and real tiny pretraining runs (new, resumed, evaluated)."""

import dataclasses
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from PIL import Image
from torch import nn

from obow.backbones import build_backbone
from obow.config import Config, ConfigError, from_dict, load_config, to_dict
from obow.data.transforms import MoCoV2Views, OBoWViews
from obow.distributed import ddp_without_buffer_sync
from obow.methods import build_views
from obow.methods.mocov2 import MoCoV2, auto_bn_splits, check_bn_splits, info_nce_loss
from obow.methods.split_batchnorm import SplitBatchNorm2d
from obow.training import build as build_module
from obow.training.build import synchronises_batchnorm
from obow.training.run.settings_check import check_same_run
from obow.training.run.settle import settle_bn_splits
from obow.training.run.state import RunError
from obow.weights.checkpoint import load_checkpoint
from obow.weights.load import load_backbone

TINY_ARCH = ("timm:resnet18", "cifar", {"channels": [8, 16, 32, 64], "stem_width": 8})


def numpy_info_nce(q, k, queue, temperature):
    """Float64 reference: cross-entropy of ``[q.k, q.queue] / T`` with the positive at index 0."""
    q, k, queue = (np.asarray(a, dtype=np.float64) for a in (q, k, queue))
    logits = np.concatenate([(q * k).sum(1, keepdims=True), q @ queue.T], axis=1) / temperature
    top = logits.max(1, keepdims=True)
    log_z = top[:, 0] + np.log(np.exp(logits - top).sum(1))
    return float(np.mean(log_z - logits[:, 0])), float(np.mean(logits.argmax(1) == 0) * 100)


def unit(*shape, seed):
    return F.normalize(torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64), dim=-1)


def without_batchnorm(module: nn.Module) -> nn.Module:
    for name, child in module.named_children():
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            setattr(module, name, nn.Identity())
        else:
            without_batchnorm(child)
    return module


def tiny_model(queue_size=8, batchnorm=True, **kwargs) -> MoCoV2:
    torch.manual_seed(0)
    backbone = build_backbone(*TINY_ARCH)
    if not batchnorm:
        without_batchnorm(backbone)
    return MoCoV2(backbone, dim=8, hidden_dim=16, queue_size=queue_size, total_iterations=10, **kwargs).train()


def random_batch(batch=4, seed=0, groups=((1, 8),)):
    g = torch.Generator().manual_seed(seed)
    views = [torch.randn(batch, n, 3, size, size, generator=g) for n, size in groups]
    return torch.randn(batch, 3, 8, 8, generator=g), views


# ---------------------------------------------------------------------------------------------------- the loss


def test_info_nce_matches_a_float64_numpy_reference():
    q, k, queue = unit(6, 5, seed=1), unit(6, 5, seed=2), unit(11, 5, seed=3)
    k[:3] = F.normalize(q[:3] + 0.1 * k[:3], dim=1)  # some positives close to their query: accuracy neither 0 nor 100
    loss, accuracy = info_nce_loss(q, k, queue, temperature=0.2)
    ref_loss, ref_accuracy = numpy_info_nce(q, k, queue, 0.2)
    assert loss.dtype == torch.float64
    assert math.isclose(float(loss), ref_loss, rel_tol=1e-12)
    assert float(accuracy) == ref_accuracy and 0 < ref_accuracy < 100
    # float32 inputs give the same value to float32 precision
    loss32, _ = info_nce_loss(q.float(), k.float(), queue.float(), temperature=0.2)
    assert math.isclose(float(loss32), ref_loss, rel_tol=1e-5)


def test_info_nce_hand_worked_two_samples():
    # q1 = k1 = (1, 0); q2 = (0, 1), k2 = (1, 0); one negative (0, 1); T = 0.5.
    # logits: row 1 [2, 0] -> log(1 + e^-2); row 2 [0, 2] -> 2 + log(1 + e^-2); the second query picks the negative.
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    k = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    loss, accuracy = info_nce_loss(q, k, torch.tensor([[0.0, 1.0]]), temperature=0.5)
    assert math.isclose(float(loss), 1.0 + math.log1p(math.exp(-2.0)), rel_tol=1e-6)
    assert float(accuracy) == 50.0


def test_info_nce_rejects_mismatched_shapes():
    q = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="queries and keys"):
        info_nce_loss(q, torch.zeros(2, 4), torch.zeros(5, 4), 0.2)
    with pytest.raises(ValueError, match=r"queue must be \[Q, D\] with D=4"):
        info_nce_loss(q, q, torch.zeros(4, 5), 0.2)
    with pytest.raises(ValueError, match="temperature"):
        info_nce_loss(q, q, torch.zeros(5, 4), 0.0)


# ---------------------------------------------------------------------------------------------------- the module


def test_queue_is_fifo_and_the_negatives_are_the_queue_before_the_step():
    model = tiny_model(queue_size=8)
    start = model.queue.clone()
    torch.testing.assert_close(start.norm(dim=1), torch.ones(8))
    keys = []
    for step in range(3):
        teacher, views = random_batch(seed=step)
        before = model.queue.clone()
        out = model(teacher, views)
        keys.append(out.targets["keys"])
        assert int(model.queue_ptr) == (4 * (step + 1)) % 8
        # the loss used the queue as it was before this step's keys went in
        queries = F.normalize(model.projector(model.student(views[0][:, 0]).pool5), dim=1)
        expected, _ = info_nce_loss(queries, out.targets["keys"], before, model.temperature)
        torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-6)
        if step == 0:
            torch.testing.assert_close(model.queue[:4], keys[0], rtol=0, atol=0)
            torch.testing.assert_close(model.queue[4:], start[4:], rtol=0, atol=0)
    torch.testing.assert_close(keys[0].norm(dim=1), torch.ones(4))
    # after 3 steps of 4 keys in a queue of 8: the third batch overwrote the first, the second is kept
    torch.testing.assert_close(model.queue, torch.cat([keys[2], keys[1]]), rtol=0, atol=0)
    assert int(model.iteration) == 3
    # evaluation mode changes neither the queue nor the key encoder
    model.eval()
    queue, teacher_state = model.queue.clone(), {k: v.clone() for k, v in model.teacher.state_dict().items()}
    model(*random_batch(seed=9))
    assert torch.equal(model.queue, queue) and int(model.queue_ptr) == 4 and int(model.iteration) == 3
    assert all(torch.equal(v, model.teacher.state_dict()[k]) for k, v in teacher_state.items())


def test_key_encoder_gets_no_gradient_and_is_the_momentum_average():
    m = 0.9
    model = tiny_model(queue_size=8, key_momentum=m).double()
    with torch.no_grad():  # make the query encoder differ from the key encoder, so the average is visible
        for p in (*model.student.parameters(), *model.projector.parameters()):
            p.add_(0.05 * torch.randn_like(p))
    key_params = [*model.teacher.parameters(), *model.key_projector.parameters()]
    query_params = [*model.student.parameters(), *model.projector.parameters()]
    old_keys = [p.detach().clone() for p in key_params]
    old_queries = [p.detach().clone() for p in query_params]
    teacher, views = random_batch(seed=1)
    out = model(teacher.double(), [v.double() for v in views])
    out.loss.backward()
    assert torch.isfinite(out.loss) and float(out.metrics["teacher_momentum"]) == pytest.approx(m)
    assert all(p.grad is None and not p.requires_grad for p in key_params)
    assert all(p.grad is not None for p in query_params)
    for new, k, q in zip(key_params, old_keys, old_queries, strict=True):
        torch.testing.assert_close(new.detach(), m * k + (1 - m) * q, rtol=1e-12, atol=1e-15)
    # the key encoder's batch-norm statistics are its own: they moved with its own forward pass
    stats = [(n, b) for n, b in model.teacher.named_buffers() if n.endswith("running_mean")]
    assert stats and any(b.abs().sum() > 0 for _, b in stats)


@pytest.mark.parametrize("weighting", ["group_sum", "view_mean"])
def test_group_wise_calls_equal_the_whole_step(weighting):
    groups = ((2, 8), (3, 6))
    teacher, views = random_batch(seed=3, groups=groups)
    whole, parts = tiny_model(loss_weighting=weighting), tiny_model(loss_weighting=weighting)
    out = whole(teacher, views)
    out.loss.backward()
    total = torch.zeros(())
    metrics = {}
    for g in range(len(groups)):
        part = parts(teacher, views, group=g)
        part.loss.backward()
        total += part.metrics["loss"]
        metrics.update(part.metrics)
    torch.testing.assert_close(total, out.metrics["loss"], rtol=1e-6, atol=1e-6)
    weights = [1.0, 1.0] if weighting == "group_sum" else [2 / 5, 3 / 5]
    expected = sum(w * out.metrics[f"loss/group{g}"] for g, w in enumerate(weights))
    torch.testing.assert_close(out.metrics["loss"], expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(metrics["moco/accuracy"], out.metrics["moco/accuracy"])
    for (name, a), b in zip(whole.named_parameters(), parts.parameters(), strict=True):
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(whole.queue, parts.queue, rtol=0, atol=0)
    assert {"loss/group0", "loss/group1", "student/effective_rank", "student/mean_cosine"} <= set(out.metrics)
    with pytest.raises(RuntimeError, match="group=0"):
        parts(teacher, views, group=1)


# ---------------------------------------------------------------------------------------------------- shuffled BN


def plain_copy(backbone: nn.Module) -> nn.Module:
    """A backbone of the tiny architecture with ``backbone``'s weights and plain ``nn.BatchNorm2d``, in training
    mode: the reference that normalises whatever batch it is given with that batch's statistics."""
    plain = build_backbone(*TINY_ARCH)
    plain.load_state_dict(backbone.state_dict())
    assert not any(isinstance(m, SplitBatchNorm2d) for m in plain.modules())
    return plain.train()


def test_auto_bn_splits_keeps_sub_batches_of_32_images_up_to_8():
    # one process: 32-image sub-batches (MoCo's per-GPU ImageNet batch), at most 8 (its single-GPU CIFAR code)
    assert [auto_bn_splits(b, 1) for b in (64, 96, 128, 256, 512, 1024)] == [2, 3, 4, 8, 8, 8]
    # below 64 on one process: the fewest sub-batches of >= 2 images (1 would be the leak), 1 when none divides
    assert [auto_bn_splits(b, 1) for b in (8, 16, 32, 6, 7, 2)] == [2, 2, 2, 2, 1, 1]
    # several processes: the shuffle across them already separates keys from queries (MoCo: 8 GPUs x 32)
    assert [auto_bn_splits(b, 8) for b in (32, 64, 128)] == [1, 2, 4]
    # the recipes the tables run (batch 128 on one process) and the tiny tests (8)
    for recipe in ("cifar10_fast", "imagenette_fast"):
        cfg = load_config(recipe, ["model.method=mocov2", "moco.queue_size=1024"])
        assert cfg.moco.bn_splits is None and auto_bn_splits(cfg.data.batch_size, 1) == 4


def test_bn_splits_is_validated_in_one_line():
    cfg = load_config("cifar10_fast", ["model.method=mocov2", "moco.queue_size=1024", "moco.bn_splits=8"])
    assert cfg.moco.bn_splits == 8
    with pytest.raises(ConfigError, match=r"moco.bn_splits \(3\) must divide data.batch_size \(128\)"):
        load_config("cifar10_fast", ["model.method=mocov2", "moco.queue_size=1024", "moco.bn_splits=3"])
    with pytest.raises(ConfigError, match="moco.bn_splits must be an integer >= 1, got 0"):
        load_config("cifar10_fast", ["model.method=mocov2", "moco.queue_size=1024", "moco.bn_splits=0"])
    with pytest.raises(ValueError, match="moco.bn_splits=4 does not divide the batch of 6 images per process"):
        check_bn_splits(4, 6)


def test_keys_and_queries_are_normalised_over_the_sub_batches_of_a_random_permutation():
    """bn_splits=2, batch 8, OBoW's views (2 crops and 3 patches per image): each key equals the plain encoder's
    key of its sub-batch of the permuted batch alone, each group's loss the loss of queries encoded block by block
    (images 0-3, then 4-7, all views of them), against the queue before the step."""
    b, splits, m = 8, 2, 4
    groups = ((2, 8), (3, 6))
    model = tiny_model(queue_size=16, bn_splits=splits)
    assert sum(isinstance(x, SplitBatchNorm2d) for x in model.teacher.modules()) > 10
    assert all(x.splits == splits for x in model.student.modules() if isinstance(x, SplitBatchNorm2d))
    teacher, views = random_batch(batch=b, seed=4, groups=groups)
    negatives = model.queue.clone()
    torch.manual_seed(11)
    out = model(teacher, views)
    torch.manual_seed(11)
    perm = torch.randperm(b)  # the step's first random draw
    assert not torch.equal(perm, torch.arange(b))

    key_encoder = plain_copy(model.teacher)
    expected = torch.empty(b, model.queue.shape[1])
    with torch.no_grad():
        for k in range(splits):
            images = perm[k * m : (k + 1) * m]
            expected[images] = F.normalize(model.key_projector(key_encoder(teacher[images]).pool5), dim=1)
        whole = F.normalize(model.key_projector(key_encoder(teacher).pool5), dim=1)
    torch.testing.assert_close(out.targets["keys"], expected, rtol=1e-5, atol=1e-6)
    assert (out.targets["keys"] - whole).abs().max() > 1e-3  # one batch statistic would give other keys

    query_encoder = plain_copy(model.student)
    for g, (n, _) in enumerate(groups):
        blocks = [views[g][j * m : (j + 1) * m].flatten(0, 1) for j in range(splits)]
        features = torch.cat([query_encoder(block).pool5 for block in blocks])
        queries = F.normalize(model.projector(features), dim=1)
        loss, _ = info_nce_loss(queries, expected.repeat_interleave(n, dim=0), negatives, model.temperature)
        torch.testing.assert_close(out.metrics[f"loss/group{g}"], loss.detach(), rtol=1e-5, atol=1e-6)


def test_shuffling_draws_from_the_runs_generator_only_when_it_splits_and_trains():
    teacher, views = random_batch(batch=8, seed=2)
    for splits, training, draws in ((1, True, False), (2, True, True), (2, False, False)):
        model = tiny_model(queue_size=16, bn_splits=splits).train(training)
        state = torch.get_rng_state()
        model(teacher, views)
        assert (not torch.equal(torch.get_rng_state(), state)) == draws, (splits, training)
    # the same generator state, the same step: what makes resuming exact
    a, b = tiny_model(queue_size=16, bn_splits=2), tiny_model(queue_size=16, bn_splits=2)
    torch.manual_seed(3)
    keys_a = a(teacher, views).targets["keys"]
    torch.manual_seed(3)
    torch.testing.assert_close(b(teacher, views).targets["keys"], keys_a, rtol=0, atol=0)


def test_settle_bn_splits_new_runs_resumed_runs_and_runs_from_before_the_setting():
    cfg = load_config("cifar10_fast", ["model.method=mocov2", "moco.queue_size=1024"])
    assert settle_bn_splits(cfg, None).moco.bn_splits == 4  # a new run: the automatic choice, recorded
    started = to_dict(dataclasses.replace(cfg, moco=dataclasses.replace(cfg.moco, bn_splits=8)))
    assert settle_bn_splits(cfg, started).moco.bn_splits == 8  # a resumed run keeps what it started with
    old = to_dict(cfg)
    del old["moco"]["bn_splits"]  # a MoCo run from before the setting: it trained with plain batch norm
    settled = settle_bn_splits(cfg, old)
    assert settled.moco.bn_splits == 1
    assert check_same_run(settled, old, Path("checkpoint.pt")) is None  # the same run
    split = dataclasses.replace(cfg, moco=dataclasses.replace(cfg.moco, bn_splits=4))
    with pytest.raises(RunError, match=r"moco.bn_splits: 1 -> 4"):
        check_same_run(split, old, Path("checkpoint.pt"))
    # other methods and a value given are left alone
    assert settle_bn_splits(load_config("cifar10_fast"), None).moco.bn_splits is None
    assert settle_bn_splits(split, old).moco.bn_splits == 4


def test_mocov2_batch_norm_is_never_synchronised_across_gpus(monkeypatch):
    monkeypatch.setattr(build_module.D, "is_distributed", lambda: True)
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    obow_cfg = load_config("cifar10_fast")
    moco_cfg = load_config("cifar10_fast", ["model.method=mocov2", "moco.queue_size=1024"])
    assert obow_cfg.train.sync_batchnorm and moco_cfg.train.sync_batchnorm
    assert synchronises_batchnorm(obow_cfg, gpu) and not synchronises_batchnorm(obow_cfg, cpu)
    assert not synchronises_batchnorm(moco_cfg, gpu)


# ---------------------------------------------------------------------------------------------------- views


VIEWS = {"teacher_resize": 20, "teacher_size": 16, "num_crops": 2, "crop_size": 12, "num_patches": 5, "patch_size": 6,
         "patch_jitter": 2, "patch_grid_size": 16, "blur_sigma": [0.05, 0.3]}  # fmt: skip


def _views_config(augmentation):
    return from_dict(
        Config,
        {
            "model": {"method": "mocov2"},
            "views": VIEWS,
            "moco": {"augmentation": augmentation, "queue_size": 16},
            "data": {"batch_size": 8},
        },
    )  # fmt: skip


def test_mocov2_views_two_independent_augmentations():
    cfg = _views_config("mocov2")
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (40, 30, 3), dtype=np.uint8))
    views = build_views(cfg)
    assert isinstance(views, MoCoV2Views)
    torch.manual_seed(0)
    out = views(img)
    assert set(out) == {"teacher", "crops"}
    assert out["teacher"].shape == (3, 16, 16) and out["crops"].shape == (1, 3, 16, 16)
    assert not torch.equal(out["teacher"], out["crops"][0])
    mean, std = torch.tensor(cfg.views.mean).view(3, 1, 1), torch.tensor(cfg.views.std).view(3, 1, 1)
    for x in (out["teacher"], out["crops"][0]):
        assert type(x) is torch.Tensor and x.dtype == torch.float32
        assert (x >= (0 - mean) / std - 1e-5).all() and (x <= (1 - mean) / std + 1e-5).all()
    torch.manual_seed(0)
    assert torch.equal(views(img)["crops"], out["crops"])  # seeded per sample: reproducible
    # "ours": OBoW's views (teacher's centre crop, 2 crops, 5 patches)
    ours = build_views(_views_config("ours"))
    assert isinstance(ours, OBoWViews)
    got = ours(img)
    assert (got["teacher"].shape, got["crops"].shape, got["patches"].shape) == (
        (3, 16, 16), (2, 3, 12, 12), (5, 3, 6, 6)
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------- two processes

WORLD = 2
GLOBAL_BATCH = 8


def _dist_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        teacher, views = random_batch(batch=GLOBAL_BATCH, seed=5)
        mine = slice(rank * GLOBAL_BATCH // WORLD, (rank + 1) * GLOBAL_BATCH // WORLD)
        for name in ("bn", "no_bn", "split"):
            model = tiny_model(queue_size=16, batchnorm=name != "no_bn", bn_splits=2 if name == "split" else 1)
            torch.manual_seed(100 + rank)  # runtime randomness differs per process, as in a real run
            ddp = ddp_without_buffer_sync(model)
            out = ddp(teacher[mine], [v[mine] for v in views])
            out.loss.backward()
            grad = next(p.grad for p in model.student.parameters())
            torch.save(
                {"queue": model.queue, "ptr": model.queue_ptr, "keys": out.targets["keys"], "grad": grad,
                 "loss": out.loss.detach()},
                Path(out_dir) / f"{name}_rank{rank}.pt",
            )  # fmt: skip
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_processes_share_one_queue_in_rank_order(tmp_path, free_port):
    mp.start_processes(_dist_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, start_method="spawn")
    for name in ("bn", "no_bn", "split"):
        a, b = (torch.load(tmp_path / f"{name}_rank{r}.pt") for r in range(WORLD))
        torch.testing.assert_close(a["queue"], b["queue"], rtol=0, atol=0)
        assert int(a["ptr"]) == int(b["ptr"]) == GLOBAL_BATCH
        # rank 0's keys, then rank 1's, each as that process computed (and un-shuffled) them
        torch.testing.assert_close(a["queue"][:GLOBAL_BATCH], torch.cat([a["keys"], b["keys"]]), rtol=0, atol=0)
        torch.testing.assert_close(a["grad"], b["grad"])  # DDP averaged the query encoder's gradients
    # Without batch norm a key does not depend on the images it is encoded with: after the shuffle across
    # processes and back, every image has the key one process computes for the whole batch.
    single = tiny_model(queue_size=16, batchnorm=False)
    teacher, views = random_batch(batch=GLOBAL_BATCH, seed=5)
    keys = single(teacher, views).targets["keys"]
    no_bn = [torch.load(tmp_path / f"no_bn_rank{r}.pt")["keys"] for r in range(WORLD)]
    torch.testing.assert_close(torch.cat(no_bn), keys, rtol=1e-5, atol=1e-6)
    _check_splits_within_processes(tmp_path)


def _check_splits_within_processes(tmp_path: Path) -> None:
    """bn_splits=2 on each of 2 processes of 4 images: the keys of the permutation rank 0 drew are encoded in
    sub-batches of 2 (positions 0-1, 2-3 of the permuted batch on rank 0, 4-5, 6-7 on rank 1); each process's
    queries in blocks of 2 of its own images; DDP averages the two processes' gradients."""
    saved = [torch.load(tmp_path / f"split_rank{r}.pt") for r in range(WORLD)]
    model = tiny_model(queue_size=16, bn_splits=2)
    negatives = model.queue.clone()
    teacher, views = random_batch(batch=GLOBAL_BATCH, seed=5)
    torch.manual_seed(100)
    perm = torch.randperm(GLOBAL_BATCH)  # rank 0's first draw of the step, broadcast to rank 1
    key_encoder, query_encoder = plain_copy(model.teacher), plain_copy(model.student)
    keys = torch.empty(GLOBAL_BATCH, model.queue.shape[1])
    with torch.no_grad():
        for k in range(GLOBAL_BATCH // 2):
            images = perm[2 * k : 2 * k + 2]
            keys[images] = F.normalize(model.key_projector(key_encoder(teacher[images]).pool5), dim=1)
    torch.testing.assert_close(torch.cat([s["keys"] for s in saved]), keys, rtol=1e-5, atol=1e-6)
    losses = []
    for rank in range(WORLD):
        blocks = [views[0][i : i + 2].flatten(0, 1) for i in range(4 * rank, 4 * rank + 4, 2)]
        queries = F.normalize(model.projector(torch.cat([query_encoder(x).pool5 for x in blocks])), dim=1)
        loss, _ = info_nce_loss(queries, keys[4 * rank : 4 * rank + 4], negatives, model.temperature)
        torch.testing.assert_close(saved[rank]["loss"], loss.detach(), rtol=1e-5, atol=1e-6)
        losses.append(loss)
    (sum(losses) / WORLD).backward()
    grad = next(p.grad for p in query_encoder.parameters())
    # The two processes sum in another order than the reference (DDP's all-reduce, the blocks of the split): an
    # element near zero keeps the sums' absolute rounding, so the check is relative to the gradient's norm (3
    # elements of 9,408 were 2.8e-6 apart on an AVX-512 Xeon without BF16, above an element-wise atol of 1e-6; the
    # whole gradient was 3.9e-7 of its norm away, where a wrong average would be of order 1).
    error = float((saved[0]["grad"].double() - grad.double()).norm() / grad.double().norm())
    assert error <= 1e-5, f"the gradient is {error:.3g} of its norm from the reference"


# ---------------------------------------------------------------------------------------------------- real runs


def _run_config(data: Path, augmentation: str, epochs: int) -> Config:
    return from_dict(
        Config,
        {
            "model": {"method": "mocov2", "arch": TINY_ARCH[0], "stem": TINY_ARCH[1], "arch_options": TINY_ARCH[2]},
            "views": VIEWS,
            "moco": {"augmentation": augmentation, "queue_size": 16, "dim": 16, "hidden_dim": 32},
            "data": {"path": str(data), "batch_size": 8, "num_workers": 0},
            "optim": {"epochs": epochs, "lr": 0.03, "warmup_epochs": 0, "end_lr": 0.0},
            "train": {"device": "cpu", "log_every": 1, "knn_every": 0, "keep_every": 1, "progress_bar": False,
                      "tensorboard": False},
        },
    )  # fmt: skip


@pytest.mark.parametrize("augmentation", ["mocov2", "ours"])
def test_pretrain_resume_and_load_the_student(tmp_path, write_images, read_log, augmentation):
    from obow.training.loop import pretrain

    data = write_images(tmp_path / "data", per_class=8, size=20)  # 16 images: 2 steps per epoch
    epochs = 2
    cfg = _run_config(data, augmentation, epochs)
    result = pretrain(cfg, tmp_path / "whole")
    assert result["iteration"] == 2 * epochs and math.isfinite(result["loss"])
    ckpt = load_checkpoint(tmp_path / "whole" / "checkpoint.pt")
    state = ckpt["model"]
    # moco.bn_splits: null became 2 (sub-batches of 4 of the batch of 8), recorded with the run
    assert cfg.moco.bn_splits is None and ckpt["config"]["moco"]["bn_splits"] == 2
    assert "bn_splits: 2" in (tmp_path / "whole" / "config.yaml").read_text()
    assert int(state["iteration"]) == 2 * epochs and int(state["queue_ptr"]) == (8 * 2 * epochs) % 16
    assert {"queue", "queue_ptr", "projector.0.weight", "key_projector.2.weight"} <= set(state)
    assert any(k.startswith("teacher.") for k in state)
    steps = [r for r in read_log(tmp_path / "whole") if "type" not in r]
    groups = 1 if augmentation == "mocov2" else 2
    for r in steps:
        assert math.isfinite(r["loss"]) and 0 <= r["moco/accuracy"] <= 100
        assert r["teacher_momentum"] == pytest.approx(0.999)
        assert {f"loss/group{g}" for g in range(groups)} <= set(r) and f"loss/group{groups}" not in r
        assert {"student/effective_rank", "student/mean_cosine"} <= set(r)

    backbone, info = load_backbone(tmp_path / "whole" / "checkpoint.pt")
    assert info["kind"] == "checkpoint" and info["iteration"] == 2 * epochs
    for name, value in backbone.state_dict().items():
        assert torch.equal(value, state[f"student.{name}"]), name
    with torch.no_grad():
        features = backbone.eval()(torch.randn(3, 3, 16, 16)).pool5
    assert features.shape == (3, 64) and torch.isfinite(features).all()

    # resume from the end of epoch 1: the second epoch (its key permutations drawn from the restored random
    # state) must give the same weights, queue and all
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copy(tmp_path / "whole" / "checkpoints" / "epoch_0001.pt", resumed / "checkpoint.pt")
    assert pretrain(cfg, resumed)["iteration"] == 4
    done = load_checkpoint(resumed / "checkpoint.pt")
    assert done["epoch"] == 2
    for name, value in state.items():
        assert torch.equal(value, done["model"][name]), name
