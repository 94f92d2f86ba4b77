"""BoWNet: k-means, the static teacher and vocabulary, hard targets, and a real RotNet -> BoWNet -> BoWNet chain."""

import numpy as np
import pytest
import torch
from PIL import Image

from obow.backbones import build_backbone
from obow.bow.kmeans import kmeans, kmeans_init, lloyd_step
from obow.bow.predictor import build_predictor
from obow.bow.targets import BoWExtractor
from obow.config import ModelConfig, load_config
from obow.methods.bownet import BoWNet, StaticVocabulary, sample_locations
from obow.training.loop import pretrain
from obow.weights.checkpoint import load_checkpoint, save_atomic
from obow.weights.load import network_state

from reference import bow_targets as ref_bow_targets
from reference import np64


def ref_lloyd(x, centroids, iterations):
    """Plain NumPy float64 Lloyd iterations from given centroids (no empty cluster may occur)."""
    for _ in range(iterations):
        d = ((x[:, None, :] - centroids[None, :, :]) ** 2).sum(-1)
        nearest = d.argmin(1)
        assert len(np.unique(nearest)) == len(centroids), "the reference does not handle empty clusters"
        centroids = np.stack([x[nearest == k].mean(0) for k in range(len(centroids))])
    return centroids


def test_kmeans_matches_a_numpy_lloyd_from_the_same_start():
    x = torch.rand(300, 5, dtype=torch.float64)
    start = kmeans_init(x, 6, torch.Generator().manual_seed(4))
    assert len({tuple(r) for r in start.tolist()}) == 6 and all(any(torch.equal(r, p) for p in x) for r in start)
    centroids = kmeans(x, 6, iterations=8, generator=torch.Generator().manual_seed(4))
    np.testing.assert_allclose(np64(centroids), ref_lloyd(np64(x), np64(start), 8), rtol=1e-10)
    # float32 points, as on the training device
    c32 = kmeans(x.float(), 6, iterations=8, generator=torch.Generator().manual_seed(4))
    np.testing.assert_allclose(np64(c32), ref_lloyd(np64(x), np64(start), 8), atol=1e-5)


def test_empty_clusters_are_reseeded_with_data_points():
    x = torch.randn(20, 2)
    centroids = torch.cat([x[:3], torch.full((1, 2), 1e6)])
    new, objective = lloyd_step(x, centroids, torch.Generator().manual_seed(0))
    assert any(torch.equal(new[3], p) for p in x)
    d = ((x[:, None] - centroids[None, :3]) ** 2).sum(-1).min(1).values
    assert float(objective) == pytest.approx(float(d.mean()), rel=1e-5)
    with pytest.raises(ValueError, match="at least 5 points"):
        kmeans(torch.randn(4, 2), 5, 1)


def test_sample_locations_takes_distinct_locations_per_image():
    features = torch.arange(2 * 6 * 3, dtype=torch.float32).view(2, 6, 3)
    picked = sample_locations(features, 4, torch.Generator().manual_seed(0))
    assert picked.shape == (8, 3)
    for i in range(2):
        rows = {tuple(r) for r in picked[4 * i : 4 * i + 4].tolist()}
        assert len(rows) == 4 and rows <= {tuple(r) for r in features[i].tolist()}
    assert sample_locations(features, 10).shape == (12, 3)  # fewer locations than asked: all of them


LEVEL = "conv4"


def tiny_bownet(pooling="max", cutmix=False, num_words=8):
    cfg = ModelConfig(
        arch="resnet18", stem="cifar", levels=(LEVEL,), num_words=num_words, kappa=5.0, assignment="hard",
        pooling=pooling, head="fixed", cutmix=cutmix,
    )  # fmt: skip
    student = build_backbone(cfg.arch, cfg.stem)
    teacher = build_backbone(cfg.arch, cfg.stem)
    extractor = BoWExtractor(
        StaticVocabulary(num_words, student.level_channels[LEVEL]), assignment="hard", pooling=pooling
    )
    return BoWNet(
        student, teacher, {LEVEL: extractor}, build_predictor(cfg, student), total_iterations=5, cutmix=cutmix
    )


def build_vocabulary(model, images):
    """Words: teacher features of the images (so that the hard assignments spread over several words)."""
    fmap = model.teacher(images, levels=(LEVEL,)).maps[LEVEL][:, :, 1:-1, 1:-1]
    points = fmap.flatten(2).transpose(1, 2).reshape(-1, fmap.shape[1])
    words = points[torch.randperm(points.shape[0], generator=torch.Generator().manual_seed(1))[:8]]
    model.set_vocabularies({LEVEL: words})
    return words


@pytest.mark.parametrize("pooling", ["max", "avg"])
def test_hard_targets_match_numpy(pooling):
    model = tiny_bownet(pooling).train()
    assert not model.teacher.training and model.student.training
    images = torch.randn(3, 3, 24, 24)
    with torch.no_grad():
        words = build_vocabulary(model, images)
        out = model(images, [torch.randn(3, 1, 3, 16, 16)])
        fmap = np64(model.teacher(images, levels=(LEVEL,)).maps[LEVEL])
    expected, _ = ref_bow_targets(fmap, np64(words), 0.5, 0.1, border=1, pooling=pooling, assignment="hard")
    np.testing.assert_allclose(np64(out.targets[LEVEL]), expected, atol=1e-6)
    np.testing.assert_allclose(np64(out.targets[LEVEL]).sum(1), 1.0, rtol=1e-6)
    assert "teacher_momentum" not in out.metrics


def test_teacher_and_vocabulary_stay_fixed_and_get_no_gradient():
    model = tiny_bownet(cutmix=True).train()
    images = torch.randn(4, 3, 24, 24)
    with torch.no_grad():
        build_vocabulary(model, images)
    teacher_before = {k: v.clone() for k, v in model.teacher.state_dict().items()}
    words_before = model.extractors[LEVEL].vocabulary.words.clone()
    student_before = model.student.conv1.weight.detach().clone()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5, momentum=0.9)
    for _ in range(2):
        optimizer.zero_grad()
        out = model(images, [torch.randn(4, 1, 3, 16, 16)])
        out.loss.backward()
        optimizer.step()
    assert all(p.grad is None and not p.requires_grad for p in model.teacher.parameters())
    for k, v in model.teacher.state_dict().items():
        assert torch.equal(v, teacher_before[k]), k  # weights and running statistics alike
    assert torch.equal(model.extractors[LEVEL].vocabulary.words, words_before)
    assert not torch.equal(model.student.conv1.weight, student_before)
    assert model.predictor.slot_weights[0].grad is not None
    assert int(model.iteration) == 2


def test_a_step_before_the_vocabulary_is_built_is_refused():
    model = tiny_bownet().train()
    with pytest.raises(RuntimeError, match="vocabulary was never built"):
        model(torch.randn(2, 3, 24, 24), [torch.randn(2, 1, 3, 16, 16)])
    with pytest.raises(ValueError, match="needs words of shape"):
        model.set_vocabularies({LEVEL: torch.zeros(3, 3)})


TINY_RECIPE = """
description: test-sized BoWNet chain
model: {method: rotnet, arch: resnet18, stem: cifar, levels: [conv4], num_words: 16, kappa: 5.0,
        assignment: hard, head: fixed, cutmix: true}
views: {teacher_resize: 28, teacher_size: 24, num_crops: 1, crop_size: 16, num_patches: 0,
        blur_sigma: [0.05, 0.3]}
data: {batch_size: 8, num_workers: 0}
optim: {epochs: 1, lr: 0.05, warmup_epochs: 0, end_lr: 0.0}
bownet: {kmeans_images: 12, kmeans_samples_per_image: 4, kmeans_iterations: 3}
train: {device: cpu, log_every: 1, knn_every: 0, progress_bar: false, tensorboard: false}
"""


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """A RotNet run, a BoWNet round with its checkpoint as teacher, and a second round (2 epochs) on the first."""
    root = tmp_path_factory.mktemp("chain")
    rng = np.random.default_rng(0)
    for i in range(16):
        pixels = rng.integers(0, 256, size=(28, 28, 3), dtype=np.uint8)
        pixels[: 4 + i % 10] //= 3  # an asymmetric band, so that rotations are tellable
        (root / "data").mkdir(exist_ok=True)
        Image.fromarray(pixels).save(root / "data" / f"{i:02d}.png")
    recipe = root / "tiny.yaml"
    recipe.write_text(TINY_RECIPE)

    def run(name, *overrides):
        cfg = load_config(recipe, [f"data.path={root / 'data'}", *overrides])
        pretrain(cfg, root / name)
        return cfg, root / name / "checkpoint.pt"

    _, rotnet = run("rotnet")
    _, round1 = run("round1", "model.method=bownet", f"bownet.teacher={rotnet}")
    cfg2, round2 = run(
        "round2", "model.method=bownet", f"bownet.teacher={round1}", "optim.epochs=2", "train.keep_every=1"
    )
    return {"root": root, "rotnet": rotnet, "round1": round1, "round2": round2, "cfg2": cfg2}


@pytest.mark.slow
def test_rotnet_then_two_bownet_rounds(chain):
    rotnet, round1, round2 = (load_checkpoint(chain[k]) for k in ("rotnet", "round1", "round2"))
    assert rotnet["iteration"] == 2 and "classifier.weight" in rotnet["model"]
    assert np.isfinite(rotnet["history"][-1]["loss"])
    for teacher_ckpt, ckpt in ((rotnet, round1), (round1, round2)):
        student_of_teacher = network_state(teacher_ckpt["model"], "student")
        teacher = network_state(ckpt["model"], "teacher")
        assert teacher.keys() == student_of_teacher.keys()
        for k, v in teacher.items():
            assert torch.equal(v, student_of_teacher[k]), k  # the earlier student, unchanged by training
        assert bool(ckpt["model"]["vocabulary_ready"]) and np.isfinite(ckpt["history"][-1]["loss"])
    words1 = round1["model"][f"extractors.{LEVEL}.vocabulary.words"]
    words2 = round2["model"][f"extractors.{LEVEL}.vocabulary.words"]
    assert words1.shape == (16, 256) and torch.isfinite(words1).all() and not torch.equal(words1, words2)
    assert round2["iteration"] == 4


@pytest.mark.slow
def test_prepare_is_not_run_again_on_resume(chain):
    out = chain["root"] / "resumed"
    saved = load_checkpoint(chain["round2"].parent / "checkpoints" / "epoch_0001.pt")
    assert (saved["epoch"], saved["iteration"]) == (1, 2)
    key = f"extractors.{LEVEL}.vocabulary.words"
    marked = saved["model"][key] + 1.0  # words that k-means would not produce
    saved["model"][key] = marked.clone()
    save_atomic(saved, out / "checkpoint.pt")
    pretrain(chain["cfg2"], out)
    done = load_checkpoint(out / "checkpoint.pt")
    assert done["iteration"] == 4 and torch.equal(done["model"][key], marked)


@pytest.mark.slow
def test_teacher_of_another_architecture_is_refused(chain, tmp_path):
    cfg = load_config(
        chain["root"] / "tiny.yaml",
        ["model.method=bownet", "model.arch=resnet34", f"bownet.teacher={chain['rotnet']}"],
    )
    with pytest.raises(ValueError, match="bownet.teacher=.*resnet34"):
        BoWNet.from_config(cfg, total_iterations=1)
    missing = load_config(
        chain["root"] / "tiny.yaml", ["model.method=bownet", f"bownet.teacher={tmp_path / 'none.pt'}"]
    )
    with pytest.raises(ValueError, match="does not exist"):
        BoWNet.from_config(missing, total_iterations=1)
