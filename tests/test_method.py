import copy

import numpy as np
import pytest
import torch

from obow.bow.loss import bow_loss
from obow.config import ModelConfig
from obow.methods.obow import OBoW
from obow.schedules import learning_rate, teacher_momentum

from reference import kl_loss as ref_kl_loss
from reference import np64
from reference import weight_generator as ref_weight_generator

TINY = dict(
    arch="timm:resnet18",
    arch_options={"channels": [8, 8, 16, 16], "stem_width": 8},
    stem="cifar",
    num_words=16,
    kappa=5.0,
    delta_base=0.1,
)


def tiny_model(total_iterations=10, **overrides):
    return OBoW.from_config(ModelConfig(**{**TINY, **overrides}), total_iterations=total_iterations)


def tiny_batch(b=4, teacher=40, crops=((2, 24), (3, 16)), scale=1.0):
    return torch.randn(b, 3, teacher, teacher) * scale, [torch.randn(b, n, 3, s, s) for n, s in crops]


def test_bow_loss_matches_reference_kl():
    logits = torch.randn(3, 2, 10) * 4
    targets = torch.softmax(torch.randn(3, 10) * 2, dim=-1)
    expected = ref_kl_loss(np64(logits).reshape(6, 10), np.repeat(np64(targets), 2, axis=0))
    np.testing.assert_allclose(float(bow_loss(logits, targets)), expected, rtol=1e-5)


def test_bow_loss_treats_zero_targets_as_zero_contribution():
    logits = torch.randn(2, 1, 5, requires_grad=True)
    targets = torch.tensor([[1.0, 0, 0, 0, 0], [0.5, 0.5, 0, 0, 0]])
    loss = bow_loss(logits, targets)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logits.grad).all()
    expected = ref_kl_loss(np64(logits).reshape(2, 5), np64(targets))
    np.testing.assert_allclose(float(loss.detach()), expected, rtol=1e-5)
    # gradient of KL (= of the cross-entropy): softmax - target, over the number of predictions
    np.testing.assert_allclose(
        np64(logits.grad).reshape(2, 5), (np64(torch.softmax(logits, -1)).reshape(2, 5) - np64(targets)) / 2, atol=1e-6
    )


@pytest.mark.parametrize("weighting", ["group_sum", "view_mean"])
def test_loss_weighting_matches_reference(weighting):
    model = tiny_model(loss_weighting=weighting).train()
    teacher, views = tiny_batch()
    vocab_t = {lvl: np64(model.extractors[lvl].vocabulary.words).copy() for lvl in model.levels}
    out = model(teacher, views)
    total_views = sum(v.shape[1] for v in views)
    expected = 0.0
    for g, v in enumerate(views):
        b, n = v.shape[:2]
        feats = np64(model.student(v.flatten(0, 1)).pool5)
        level_losses = []
        for i, lvl in enumerate(model.levels):
            gen = model.predictor.generators[i]
            w = ref_weight_generator(
                vocab_t[lvl],
                np64(gen.fc1.weight),
                np64(gen.bn.weight),
                np64(gen.bn.bias),
                np64(gen.fc2.weight),
                np64(gen.fc2.bias),
            )
            logits = 5.0 * feats @ w.T
            targets = np.repeat(np64(out.targets[lvl]), n, axis=0)  # image-major, like the flattened views
            level_losses.append(ref_kl_loss(logits, targets))
            np.testing.assert_allclose(float(out.metrics[f"loss/group{g}/{lvl}"]), level_losses[-1], rtol=1e-4)
            if g == 0:  # how far the first group's predictions spread around their mean
                p = np.exp(logits - logits.max(axis=1, keepdims=True))
                p /= p.sum(axis=1, keepdims=True)
                spread = np.mean(np.sum(p * (np.log(p) - np.log(p.mean(axis=0))), axis=1))
                np.testing.assert_allclose(float(out.metrics[f"{lvl}/predicted_kl_to_mean"]), spread, rtol=1e-3)
        group = np.mean(level_losses)
        expected += group if weighting == "group_sum" else group * n / total_views
    np.testing.assert_allclose(float(out.loss.detach()), expected, rtol=1e-4)


def test_teacher_gets_no_gradient_and_student_and_generator_do():
    model = tiny_model().train()
    out = model(*tiny_batch())
    out.loss.backward()
    assert all(p.grad is None and not p.requires_grad for p in model.teacher.parameters())
    assert all(p.grad is not None for p in model.student.parameters())
    assert all(p.grad is not None for p in model.predictor.parameters())


def test_learned_kappa_is_trained_with_the_head_and_logged():
    model = tiny_model(learn_kappa=True, kappa=5.0).train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    out = model(*tiny_batch())
    assert [float(out.metrics[f"{level}/kappa"]) for level in model.levels] == [5.0, 5.0]
    out.loss.backward()
    assert model.predictor.learned_kappa.grad is not None and bool(model.predictor.learned_kappa.grad.ne(0).all())
    optimizer.step()
    assert model.predictor.learned_kappa.ne(5.0).all()
    for b in model.extractors.values():
        assert not b.vocabulary.words.requires_grad


def test_teacher_ema_update_matches_reference_and_leaves_buffers_alone():
    model = tiny_model()
    with torch.no_grad():
        for p in model.student.parameters():
            p.add_(torch.randn_like(p))
    teacher_before = [np64(p).copy() for p in model.teacher.parameters()]
    buffers_before = [b.clone() for b in model.teacher.buffers()]
    first_bn = next(m for m in model.student.modules() if isinstance(m, torch.nn.BatchNorm2d))
    first_bn.running_mean.add_(5.0)  # student statistics must not leak into the teacher
    model.update_teacher(0.9)
    for t0, s, t in zip(teacher_before, model.student.parameters(), model.teacher.parameters(), strict=True):
        np.testing.assert_allclose(np64(t), 0.9 * t0 + 0.1 * np64(s), rtol=1e-5, atol=1e-6)
    for b0, b in zip(buffers_before, model.teacher.buffers(), strict=True):
        torch.testing.assert_close(b, b0, rtol=0, atol=0)
    snapshot = [p.clone() for p in model.teacher.parameters()]
    model.update_teacher(1.0)  # alpha = 1: the teacher is frozen
    for a, b in zip(snapshot, model.teacher.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_momentum_schedule_end_points_and_iteration_counter():
    assert teacher_momentum(0, 100) == pytest.approx(0.99)
    assert teacher_momentum(50, 100) == pytest.approx(0.995)
    assert teacher_momentum(100, 100) == pytest.approx(1.0)
    assert teacher_momentum(37, 100, schedule="constant") == 0.99
    model = tiny_model(total_iterations=4).train()
    seen = []
    for _ in range(4):
        out = model(*tiny_batch())
        seen.append(float(out.metrics["teacher_momentum"]))
    expected = [1 - 0.01 * 0.5 * (1 + np.cos(np.pi * t / 4)) for t in range(4)]
    np.testing.assert_allclose(seen, expected, rtol=1e-6)
    assert int(model.iteration) == 4 and model.current_momentum() == pytest.approx(1.0)


def test_the_momentum_follows_the_loops_iteration_and_a_wrong_one_is_caught_on_a_diagnosed_step():
    """The iteration the training loop gives (``begin_step``) spares every step a read of the device; the steps that
    compute diagnostics compare it with the model's ``iteration`` buffer, which ``realign_iteration`` sets."""
    model = tiny_model(total_iterations=4).train()
    model.begin_step(True, 0)
    assert model.current_momentum() == teacher_momentum(0, 4)
    model.realign_iteration(2)
    assert int(model.iteration) == 2
    model.begin_step(True, 2)
    assert model.current_momentum() == teacher_momentum(2, 4)
    model.begin_step(False, 3)  # unchecked: the schedule at the loop's count
    assert model.current_momentum() == teacher_momentum(3, 4)
    model.begin_step(True, 3)
    with pytest.raises(RuntimeError, match="host_iteration 3 is not the model's iteration 2"):
        model(*tiny_batch())


def test_learning_rate_schedule():
    kw = dict(base_lr=0.03, epochs=10, warmup_epochs=2, end_lr=3e-5)
    assert learning_rate(0, 100, **kw) == 0.0
    assert learning_rate(100, 100, **kw) == pytest.approx(0.015)  # linear warm-up, per iteration
    assert learning_rate(200, 100, **kw) == pytest.approx(0.03)  # cosine starts at base after warm-up
    assert learning_rate(250, 100, **kw) == pytest.approx(0.03)  # stepped per epoch (official)
    smooth = learning_rate(250, 100, **kw, cosine_per_epoch=False)
    assert smooth == pytest.approx(3e-5 + (0.03 - 3e-5) * 0.5 * (1 + np.cos(np.pi * 50 / 800)))
    assert learning_rate(1000, 100, **kw, cosine_per_epoch=False) == pytest.approx(3e-5)


@pytest.mark.parametrize(("nesterov", "decay_all"), [(False, True), (True, False)])
def test_the_runs_optimiser_is_sgd_against_a_float64_reference(nesterov, decay_all):
    """``build_optimizer`` (fused SGD): momentum 0.9, weight decay on every parameter or on the weights only,
    Nesterov or not, three steps at two learning rates, against the update rule written out in NumPy float64."""
    from obow.config import load_config
    from obow.training.build import build_optimizer

    cfg = load_config("cifar10_fast", [f"optim.nesterov={str(nesterov).lower()}",
                                       f"optim.decay_norm_and_bias={str(decay_all).lower()}"])  # fmt: skip
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 3))
    optimizer = build_optimizer(model, cfg)
    params = list(model.parameters())
    ref = [np64(p.detach()) for p in params]
    buf = [None] * len(params)
    m, wd = cfg.optim.momentum, cfg.optim.weight_decay
    for step, lr in enumerate((0.1, 0.05, 0.05)):
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            d = np64(g) + (wd if decay_all or p.ndim > 1 else 0.0) * ref[i]
            buf[i] = d if step == 0 else m * buf[i] + d
            ref[i] = ref[i] - lr * (d + m * buf[i] if nesterov else buf[i])
    for p, r in zip(params, ref, strict=True):
        np.testing.assert_allclose(p.detach().numpy(), r, rtol=1e-5, atol=1e-6)


def test_state_dict_round_trip_is_exact(tmp_path):
    torch.manual_seed(1)
    model = tiny_model(levels=("conv4", "conv5")).train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    for _ in range(3):
        out = model(*tiny_batch())
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    path = tmp_path / "model.pt"
    torch.save(model.state_dict(), path)
    torch.manual_seed(123)
    restored = tiny_model(levels=("conv4", "conv5")).train()
    restored.load_state_dict(torch.load(path), strict=True)
    state, state2 = model.state_dict(), restored.state_dict()
    names = set(state)
    for level in ("conv4", "conv5"):  # the vocabulary and its statistics are part of the state
        for buf in ("vocabulary.words", "vocabulary.ptr", "min_distance_mean"):
            assert f"extractors.{level}.{buf}" in names
    assert "iteration" in names and any(n.startswith("teacher.") for n in names)
    for name in names:
        torch.testing.assert_close(state[name], state2[name], rtol=0, atol=0, msg=name)
    batch = tiny_batch()
    torch.manual_seed(7)
    a = model(*batch)
    torch.manual_seed(7)
    b = restored(*batch)
    torch.testing.assert_close(a.loss, b.loss, rtol=0, atol=0)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, restored.state_dict()[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("temperature_init", [0.5, None])
def test_cold_start_first_steps_are_finite(temperature_init):
    """A fresh vocabulary and the fixed initial temperature statistic give very sharp first codes; with
    large activations float32 softmax underflows to exact zeros. The loss and gradients must stay finite."""
    model = tiny_model(num_words=256, delta_base=1 / 15, temperature_init=temperature_init).train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    zero_shares = []
    for _ in range(3):
        out = model(*tiny_batch(b=8))
        for t in out.targets.values():
            torch.testing.assert_close(t.sum(-1), torch.ones(t.shape[0]))
            assert torch.isfinite(t).all()
        opt.zero_grad()
        out.loss.backward()
        assert torch.isfinite(out.loss)
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        opt.step()
        zero_shares.append(max(float(out.metrics[f"{lvl}/zero_target_share"]) for lvl in model.levels))
    if temperature_init == 0.5:
        assert zero_shares[0] > 0  # the underflow really happens, so the test covers it


def test_vanilla_and_full_are_configurations():
    vanilla = tiny_model(levels=("conv5",))
    full = tiny_model(levels=("conv4", "conv5"))
    assert vanilla.levels == ("conv5",) and full.levels == ("conv4", "conv5")
    out = vanilla.train()(torch.randn(4, 3, 40, 40), [torch.randn(4, 3, 24, 24)])  # one crop, one level
    assert set(out.targets) == {"conv5"} and "loss/group0/conv5" in out.metrics


def test_diagnostics_are_returned():
    out = tiny_model().train()(*tiny_batch())
    for level in ("conv4", "conv5"):
        for key in ("temperature_stat", "delta", "words_used", "perplexity_batch", "perplexity_image"):
            assert torch.isfinite(out.metrics[f"{level}/{key}"])
        assert 0 < float(out.metrics[f"{level}/words_used"]) <= 1
        assert 1 <= float(out.metrics[f"{level}/perplexity_image"]) <= 16
        assert -1 <= float(out.metrics[f"{level}/weights_mean_cosine"]) <= 1
    assert {"loss", "teacher_momentum", "loss/group1/conv4"} <= set(out.metrics)


@pytest.mark.parametrize("vocabulary", ["queue", "kmeans"])
def test_an_undiagnosed_step_leaves_out_the_diagnostics_and_changes_nothing_else(vocabulary):
    """``diagnose=False`` (the loop's unlogged steps) drops the targets', weights' and student's diagnostics
    and nothing else: the same loss, targets, gradients and state as a diagnosed step, bit for bit."""
    torch.manual_seed(0)
    teacher, crops = tiny_batch()
    a = tiny_model(vocabulary=vocabulary).train()
    b = copy.deepcopy(a)
    b.begin_step(logged=False)
    runs = []
    for model in (a, b):
        torch.manual_seed(1)  # the queue's random locations
        out = model(teacher, crops)
        out.loss.backward()
        runs.append(out)
    full, lean = runs
    dropped = set(full.metrics) - set(lean.metrics)
    assert not set(lean.metrics) - set(full.metrics)
    for level in ("conv4", "conv5"):
        for key in ("words_used", "perplexity_batch", "perplexity_image", "kl_to_mean_bow", "zero_target_share",
                    "weights_mean_cosine", "predicted_kl_to_mean"):  # fmt: skip
            assert f"{level}/{key}" in dropped
        for key in ("temperature_stat", "delta", "batch_msd"):
            assert torch.equal(full.metrics[f"{level}/{key}"], lean.metrics[f"{level}/{key}"])
        assert torch.equal(full.targets[level], lean.targets[level])
    assert "student/effective_rank" in dropped
    assert torch.equal(full.loss, lean.loss)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert pa.grad is None and pb.grad is None or torch.equal(pa.grad, pb.grad), name
    for (name, xa), xb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(xa, xb), name


def test_kmeans_and_sinkhorn_variants_run():
    for overrides in (
        dict(vocabulary="kmeans", rare_word_steps=2),
        dict(vocabulary="kmeans", assignment="sinkhorn", rare_word_steps=None),
        dict(assignment="hard"),
        dict(head="fixed"),
        dict(queue_sampling="global_average", pooling="avg"),
    ):
        model = tiny_model(**overrides).train()
        for _ in range(3):
            out = model(*tiny_batch())
            out.loss.backward()
            assert torch.isfinite(out.loss), overrides


def test_bad_arguments_name_the_parameter():
    with pytest.raises(ValueError, match="num_words=16 must be a multiple of the global batch size"):
        tiny_model().train()(*tiny_batch(b=3))
    with pytest.raises(ValueError, match="model.levels='conv7'"):
        ModelConfig(levels=("conv7",))
    with pytest.raises(ValueError, match="model.delta_base"):
        ModelConfig(delta_base=0.0)
    with pytest.raises(ValueError, match="model.kappa"):
        ModelConfig(kappa=-1.0)
    with pytest.raises(ValueError, match="model.temperature_init"):
        ModelConfig(temperature_init=0.0)
    with pytest.raises(ValueError, match="total_iterations"):
        tiny_model(total_iterations=0)
    with pytest.raises(ValueError, match=r"student_views\[0\]"):
        tiny_model().train()(torch.randn(4, 3, 40, 40), [torch.randn(2, 3, 24, 24)])
    model = copy.deepcopy(tiny_model())
    with pytest.raises(ValueError, match="no interior left"):
        model.train()(torch.randn(4, 3, 8, 8), [torch.randn(4, 3, 8, 8)])


@pytest.mark.parametrize("weighting", ["group_sum", "view_mean"])
def test_backward_group_by_group_gives_the_same_gradients(weighting):
    """The loss is a sum over view groups, so back-propagating one group at a time (to hold one group's
    activations) must give the gradients of the single backward pass, generator included."""
    torch.manual_seed(0)
    whole = tiny_model(loss_weighting=weighting).train()
    split = copy.deepcopy(whole)
    teacher, views = tiny_batch()
    torch.manual_seed(5)
    out = whole(teacher, views)
    out.loss.backward()
    torch.manual_seed(5)
    total = 0.0
    for g in range(len(views)):
        part = split(teacher, views, group=g, grad_scale=4.0)
        (part.loss * 4.0).backward()  # a scaled backward, as with an fp16 gradient scaler
        total += float(part.metrics["loss"])
    np.testing.assert_allclose(total, float(out.metrics["loss"]), rtol=1e-5)
    for (name, a), b in zip(whole.named_parameters(), split.parameters(), strict=True):
        if a.grad is None:
            assert b.grad is None, name
            continue
        torch.testing.assert_close(b.grad / 4.0, a.grad, rtol=1e-4, atol=1e-6, msg=name)
    for name, value in whole.state_dict().items():
        torch.testing.assert_close(split.state_dict()[name], value, rtol=0, atol=0, msg=name)


def test_group_by_group_loss_value_survives_an_overflowed_gradient():
    """With fp16, a group's backward can overflow to inf; the gradient scaler then skips the step. The reported
    loss must stay the loss (not inf - inf = NaN, which would stop the run) and the overflow must reach the
    generator's gradient, so that the scaler sees it."""
    torch.manual_seed(0)
    model = tiny_model().train()
    reference = copy.deepcopy(model)
    teacher, views = tiny_batch()
    torch.manual_seed(5)
    expected = [float(reference(teacher, views, group=g).metrics["loss"]) for g in range(len(views))]
    torch.manual_seed(5)
    first = model(teacher, views, group=0)
    first.loss.backward()
    for leaf in model._pending["leaf_weights"]:
        leaf.grad.fill_(float("inf"))
    last = model(teacher, views, group=len(views) - 1)
    last.loss.backward()
    np.testing.assert_allclose(
        [float(first.metrics["loss"]), float(last.metrics["loss"])], [expected[0], expected[-1]], rtol=1e-6
    )
    generator_grads = [p.grad for p in model.predictor.parameters() if p.grad is not None]
    assert generator_grads and not all(torch.isfinite(g).all() for g in generator_grads)
