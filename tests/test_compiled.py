"""``train.compile: step`` (obow.training.step.compiled): the setting, the refusals, the pieces of the step that must
not read the device or change shape with the data, and (slow: each compiled variant takes half a minute of Dynamo
on a busy 2-core CPU, even on the one-block network of :func:`compile_config`) the compiled step against the eager
one, step for step, and a whole run with no recompilation."""

from __future__ import annotations

import contextlib
import copy
import logging
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from torch.utils._python_dispatch import TorchDispatchMode

from obow.bow.targets import flatten_locations, squared_distances
from obow.bow.vocabulary import KMeansVocabulary
from obow.config import Config, ConfigError, from_dict
from obow.methods import base
from obow.methods.base import ema_update_
from obow.training.build import build_model, build_optimizer
from obow.training.step import check_step_mode
from obow.training.step import compiled as compiled_module
from obow.training.step.compiled import CompiledStep
from obow.training.step.shared import configure_optimizer, forward_backward

sys.path.insert(0, str(Path(__file__).parent))
from conftest import TINY_RECIPE  # noqa: E402


def tiny_config(**sections) -> Config:
    values = yaml.safe_load(TINY_RECIPE)
    for section, settings in sections.items():
        values.setdefault(section, {}).update(settings)
    return from_dict(Config, values)


#: The compiled tests' network: the tiny recipe's narrow timm ResNet with one block a stage instead of two. Dynamo's
#: and AOT autograd's time grows with the number of operators in the graph (a step traces the backbone three times,
#: teacher and two student view groups, forward and backward, and the optimiser once per parameter), and the
#: compiled step's code paths (stages, levels, BoW maps, every parameter's update) are the same with one block.
ONE_BLOCK = {"layers": [1, 1, 1, 1]}


def compile_config(**sections) -> Config:
    """:func:`tiny_config` on the one-block network (:data:`ONE_BLOCK`)."""
    model = {"arch_options": {**yaml.safe_load(TINY_RECIPE)["model"]["arch_options"], **ONE_BLOCK}}
    return tiny_config(**{**sections, "model": {**model, **sections.get("model", {})}})


# ------------------------------------------------------------------------------------------------ the setting


@pytest.mark.parametrize(
    ("value", "mode"), [(True, "networks"), (False, "off"), ("true", "networks"), ("step", "step")]
)
def test_compile_setting_keeps_its_old_values(value, mode):
    """``true`` / ``false`` (recipes and checkpoints written before ``step`` existed) mean networks / off."""
    assert tiny_config(train={"compile": value}).train.compile == mode


def test_compile_setting_refuses_other_values():
    with pytest.raises(ConfigError, match=r"train\.compile='graphs' is not allowed"):
        tiny_config(train={"compile": "graphs"})


@pytest.mark.parametrize("mode", ["step", "graph"])
@pytest.mark.parametrize(
    ("sections", "says"),
    [
        ({"model": {"method": "rotnet"}}, "model.method=rotnet"),
        ({"model": {"method": "bownet"}, "bownet": {"teacher": "teacher.pt"}}, "model.method=bownet"),
        ({"train": {"precision": "fp16"}}, "fp16"),
    ],
)
def test_step_refuses_what_it_cannot_do_yet(sections, says, mode):
    train = {**sections.get("train", {}), "compile": mode}
    why = check_step_mode(tiny_config(**{**sections, "train": train}))
    assert says in why and f"train.compile={mode}" in why and "\n" not in why
    assert check_step_mode(tiny_config(train={"compile": mode})) is None
    assert check_step_mode(tiny_config(**sections)) is None  # the eager step takes them all


@pytest.mark.parametrize("mode", ["step", "graph"])
@pytest.mark.parametrize("model", [{"method": "mocov2"}, {"cutmix": True}])
def test_step_takes_mocov2_and_cutmix(model, mode):
    assert check_step_mode(tiny_config(model=model, train={"compile": mode})) is None


def test_pretrain_refuses_rotnet_in_one_line(obow_cli, tiny_recipe, tmp_path):
    result = obow_cli(
        "pretrain", "--config", tiny_recipe, "--data", tmp_path, "--out", tmp_path / "run",
        "model.method=rotnet", "train.compile=step", check=False,
    )  # fmt: skip
    assert result.code == 2
    assert "obow: error: train.compile=step does not support model.method=rotnet" in result.err
    assert "Traceback" not in result.err + result.out
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("mode", "networks_compiled"), [("off", False), ("networks", True), ("step", False)])
@pytest.mark.slow
def test_only_networks_compiles_the_networks(mode, networks_compiled):
    """``off`` is a non-empty string: the networks are compiled for ``networks`` only (``step`` compiles the step)."""
    from obow.training.build import prepare_step_model

    cfg = tiny_config(train={"compile": mode})
    model = build_model(cfg, 10, torch.device("cpu"))
    prepare_step_model(model, cfg, torch.device("cpu"))
    assert (model.student._compiled_call_impl is not None) == networks_compiled
    assert (model.teacher._compiled_call_impl is not None) == networks_compiled


# ------------------------------------------------------------------------------------------------ the pieces


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach_lerp", "lerp_per_tensor"])
def test_tensor_momentum_updates_as_the_float_one_bit_for_bit(foreach, monkeypatch):
    """The compiled step's float64 0-d momentum gives the eager step's teacher exactly, whether it interpolates with
    ``torch._foreach_lerp_`` or (the fallback for torch 2.11's Dynamo) ``Tensor.lerp_`` pair by pair; 1 changes
    nothing."""
    monkeypatch.setattr(base, "FOREACH_TENSOR_LERP", foreach)
    torch.manual_seed(0)
    averages = [torch.randn(7, 5), torch.randn(3)]
    sources = [torch.randn(7, 5), torch.randn(3)]
    for momentum in (0.99, 0.9937, 1 - 1e-7, 1.0):
        by_float = [a.clone() for a in averages]
        by_tensor = [a.clone() for a in averages]
        ema_update_(by_float, sources, momentum)
        ema_update_(by_tensor, sources, torch.tensor(momentum, dtype=torch.float64))
        for f, t in zip(by_float, by_tensor, strict=True):
            assert torch.equal(f, t)
        # float64 reference of a * m + s * (1 - m), to float32 rounding
        expected = np.float64(averages[0].numpy()) * momentum + np.float64(sources[0].numpy()) * (1 - momentum)
        np.testing.assert_allclose(by_tensor[0].numpy(), expected, rtol=2e-7, atol=1e-7)
    unchanged = [a.clone() for a in averages]
    ema_update_(unchanged, sources, torch.tensor(1.0, dtype=torch.float64))
    assert all(torch.equal(u, a) for u, a in zip(unchanged, averages, strict=True))


# ------------------------------------------------------------------------------------------------ older torches

# The GPU machines run torch 2.11, whose Dynamo lacks two things the compiled step uses. Each test below makes this
# torch behave as 2.11's does, as a Dynamo hook 2.11 has, and checks that the step detects it and falls back.


def foreach_lerp_as_torch_2_11(self, end, weight):  # noqa: ANN001, ANN201
    """torch 2.11's Dynamo decomposition of ``torch._foreach_lerp_`` with a tensor weight (a multiply, then an add)."""
    return torch._foreach_add_(self, torch._foreach_mul(torch._foreach_sub(end, self), weight))


def refuse_requires_grad_as_torch_2_11(self, tx, requires_grad=True):  # noqa: ANN001, ANN201
    """torch 2.11's Dynamo on ``Tensor.requires_grad_`` that changes the flag (here: every call)."""
    raise torch._dynamo.exc.Unsupported("Unsupported Tensor.requires_grad_() call")


def add_alpha_as_torch_2_11(self, tx, other, *, alpha=None):  # noqa: ANN001, ANN201
    """torch 2.11's Dynamo on ``Tensor.add_(other, alpha=a)``: ``add_(other * a)``, two roundings."""
    from torch._dynamo.variables import TorchInGraphFunctionVariable

    if alpha is None:
        return None
    product = TorchInGraphFunctionVariable(torch.mul).call_function(tx, [other, alpha], {})
    return self.call_method(tx, "add_", [product], {})


def patch_tensor_method(monkeypatch, name: str, handler) -> None:  # noqa: ANN001
    """Dynamo's handler of ``Tensor.<name>`` replaced by ``handler`` (a table of methods in newer torches)."""
    from torch._dynamo.variables.tensor import TensorVariable

    if hasattr(TensorVariable, "tp_methods"):
        method = TensorVariable.tp_methods[name]
        monkeypatch.setitem(TensorVariable.tp_methods, name, type(method)(handler))
    else:
        monkeypatch.setattr(TensorVariable, f"method_{name}", handler)


@pytest.fixture
def fresh_probes():
    """The probes' answers forgotten before and after (they describe the torch, which a test changes), and Dynamo's
    cache (else a probe's graph compiled before the change is reused)."""
    compiled_module.lerps_as_eager.cache_clear()
    compiled_module.traces_leaf_tensors.cache_clear()
    torch._dynamo.reset()
    yield
    compiled_module.lerps_as_eager.cache_clear()
    compiled_module.traces_leaf_tensors.cache_clear()
    torch._dynamo.reset()


def test_teacher_update_falls_back_to_lerp_per_tensor_where_dynamo_rounds_foreach_lerp_otherwise(
    fresh_probes, monkeypatch, caplog
):
    """Where Dynamo computes ``torch._foreach_lerp_`` with a tensor weight as a multiply and an add (torch 2.11), a
    compiled step's EMA update uses ``Tensor.lerp_`` pair by pair, saying so in one line, and so equals the eager
    update bit for bit; ``torch._foreach_lerp_`` there would not (which this test checks too: it can fail)."""
    from torch._dynamo import polyfills

    monkeypatch.setattr(base, "FOREACH_TENSOR_LERP", True)
    monkeypatch.setattr(polyfills, "foreach_lerp_inplace", foreach_lerp_as_torch_2_11)
    assert not compiled_module.lerps_as_eager()

    cfg = tiny_config()
    model = build_model(cfg, 10, torch.device("cpu"))
    with caplog.at_level("WARNING", logger="obow"):
        CompiledStep(model, build_optimizer(model, cfg), lambda *_: {}, backend="eager")
    assert not base.FOREACH_TENSOR_LERP
    said = [r.getMessage() for r in caplog.records if r.name == "obow"]
    assert len(said) == 1 and "Tensor.lerp_ per parameter" in said[0]

    torch.manual_seed(0)
    averages, sources = [torch.randn(300, 40), torch.randn(64)], [torch.randn(300, 40), torch.randn(64)]
    momentum = torch.tensor(0.99, dtype=torch.float64)
    expected = [a.clone() for a in averages]
    ema_update_(expected, sources, 0.99)  # an eager run's update
    ema = torch.compile(ema_update_, backend="eager", fullgraph=True)
    for foreach, equal in ((False, True), (True, False)):
        monkeypatch.setattr(base, "FOREACH_TENSOR_LERP", foreach)
        torch._dynamo.reset()
        got = [a.clone() for a in averages]
        ema(got, sources, momentum)
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True)) == equal, foreach


def test_step_falls_back_to_the_whole_backward_where_dynamo_cannot_make_leaf_tensors(fresh_probes, monkeypatch, caplog):
    """Where Dynamo refuses ``Tensor.requires_grad_`` in a graph (torch 2.11), ``train.backward_per_group`` cannot
    compile (the per-group step makes the prediction weights leaves): the compiled step back-propagates the whole
    loss, saying so in one line. Eager steps keep their setting."""
    from obow.training.step import step_forward_backward

    patch_tensor_method(monkeypatch, "requires_grad_", refuse_requires_grad_as_torch_2_11)
    assert not compiled_module.traces_leaf_tensors()
    cfg = tiny_config(train={"compile": "step", "backward_per_group": True})
    model = build_model(cfg, 10, torch.device("cpu"))
    assert model.supports_groups
    calls = []
    monkeypatch.setattr("obow.training.step.forward_backward", lambda *args: calls.append(args[-1]) or {})
    with caplog.at_level("WARNING", logger="obow"):
        step_forward_backward(cfg, model)(*random_batch(0))
    assert calls == [False]
    said = [r.getMessage() for r in caplog.records if r.name == "obow"]
    assert len(said) == 1 and "back-propagates the whole loss at once" in said[0] and "\n" not in said[0]
    assert compiled_module.step_per_group(False) is False


def test_kmeans_statistics_compile_as_eager_where_dynamo_splits_add_with_alpha(monkeypatch):
    """Where Dynamo splits ``Tensor.add_(x, alpha=a)`` into a multiply and an add (torch 2.11), a compiled k-means
    update still gives the eager statistics and words bit for bit (the old ``mul_(g).add_(x, alpha=1 - g)`` was
    1 ulp off on most of them)."""
    patch_tensor_method(monkeypatch, "add_", add_alpha_as_torch_2_11)
    torch._dynamo.reset()
    k, c = 16, 8
    eager, compiled = (KMeansVocabulary(k, c, momentum=0.99, rare_word_steps=None) for _ in range(2))
    torch.manual_seed(0)
    compiled.load_state_dict(eager.state_dict())
    counts, sums = torch.rand(k) * 3, torch.randn(k, c)
    for vocab in (eager, compiled):  # a vocabulary some steps into a run: statistics that are not round numbers
        vocab.counts.copy_(counts)
        vocab.sums.copy_(sums)
    update = torch.compile(compiled.update, backend="eager", fullgraph=True)
    try:
        for _ in range(3):
            fmap = torch.randn(4, c, 5, 5)
            distances = squared_distances(flatten_locations(fmap), eager.words)
            eager.update(fmap, distances, None)
            update(fmap, distances, None)
            for name in ("counts", "sums", "words"):
                assert torch.equal(getattr(compiled, name), getattr(eager, name)), name
    finally:
        torch._dynamo.reset()


class DataDependentOps(TorchDispatchMode):
    """Records the operators whose result the host must read (``.item()``, ``int()``) or whose shape depends on
    the data (``nonzero``, ``bincount``, ``masked_select``): a device sync each, and no single graph."""

    NAMES = {"_local_scalar_dense", "nonzero", "bincount", "masked_select", "unique", "_unique2"}

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func.overloadpacket.__name__ in self.NAMES:
            self.seen.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_kmeans_update_has_no_data_dependent_shapes_or_host_reads():
    """Every step of online k-means with rare-word replacement, rare words or not: no nonzero, no bincount, no
    host read (the replacement used nonzero and a count of it, the statistics bincount)."""
    k, c = 8, 3
    vocab = KMeansVocabulary(k, c, rare_word_steps=1)
    vocab.words[1:] = 1000.0
    for _ in range(3):  # step 1: no rare word yet; steps 2, 3: rare words replaced
        fmap = torch.rand(4, c, 2, 2)
        with DataDependentOps() as ops:
            diagnostics = vocab.update(fmap, squared_distances(flatten_locations(fmap), vocab.words), None)
        assert ops.seen == []
    assert float(diagnostics["rare_words_replaced"]) > 0


def test_kmeans_statistics_count_as_bincount_did():
    """The batch counts (index_add of ones) are the assignments' histogram: N after one step with momentum g is
    (1 - g) * counts, against NumPy's bincount."""
    k, c, g = 5, 2, 0.9
    vocab = KMeansVocabulary(k, c, momentum=g, rare_word_steps=None)
    fmap = torch.rand(3, c, 3, 3)
    distances = squared_distances(flatten_locations(fmap), vocab.words)
    vocab.update(fmap, distances, None)
    counts = np.bincount(distances.reshape(-1, k).argmin(1).numpy(), minlength=k)
    np.testing.assert_allclose(vocab.counts.numpy(), (1 - g) * counts, rtol=1e-6)


@pytest.mark.parametrize(
    "sections",
    [
        {"model": {"vocabulary": "kmeans", "rare_word_steps": 1}},
        {"model": {"method": "mocov2"}, "moco": {"queue_size": 16, "bn_splits": 2}},
    ],
    ids=["obow_kmeans", "mocov2"],
)
def test_unlogged_eager_step_reads_nothing_from_the_device(sections):
    """The step_ops count as a test: an unlogged OBoW step (k-means vocabulary with rare-word replacement, whose
    words go rare on the second step) and an unlogged MoCo v2 step (shuffled batch norm, the queue pointer going
    round: it was read with int()) issue no host read and no data-dependent shape."""
    cfg = tiny_config(**sections)
    model = build_model(cfg, 10, torch.device("cpu")).train()
    optimizer = build_optimizer(model, cfg)
    for iteration in range(2):
        model.begin_step(False, iteration)
        views = [torch.rand(8, 1, 3, 16, 16), torch.rand(8, 2, 3, 8, 8)]
        with DataDependentOps() as ops:
            forward_backward(model, torch.rand(8, 3, 24, 24), views, None, contextlib.nullcontext(), True)
            optimizer.step()
        assert ops.seen == []


def test_optimizer_configuration_round_trips_between_off_and_step():
    """A state written by a compiled run (foreach, tensor lr) resumes as the eager step wants it (fused, float
    lr) and back, with the momentum buffers untouched."""
    cfg = tiny_config()
    model = build_model(cfg, 10, torch.device("cpu"))
    optimizer = build_optimizer(model, cfg)
    lr = configure_optimizer(optimizer, step=True)
    assert all(g["lr"] is lr and g["foreach"] and not g["fused"] for g in optimizer.param_groups)
    lr.fill_(0.25)
    state = optimizer.state_dict()
    eager = build_optimizer(model, cfg)
    eager.load_state_dict(state)
    assert configure_optimizer(eager, step=False) is None
    assert all(g["fused"] and g["foreach"] is None and g["lr"] == 0.25 for g in eager.param_groups)


# ------------------------------------------------------------------------------------------------ the compiled step

#: The compiled step against the eager one. The forward and backward pass are bit for bit the eager ones (the same
#: operators on the same random numbers under aot_eager): metrics, gradients, teacher, vocabularies, queue
#: pointers, temperature statistics and batch-norm buffers are compared with torch.equal. The optimiser is not:
#: SGD with a tensor learning rate, as torch.optim compiles it, multiplies the update by -lr and then adds it (two
#: roundings), where the eager step's kernel adds ``-lr * update`` in one (fused: 2.4e-7 apart from foreach after 3
#: steps of a toy problem); the weights and momentum buffers after a step agree to :func:`rounding`.
#: Each step starts from the same state (the eager model takes the compiled one's), so that the comparison is of
#: one step, 20 times, and not of a trajectory, which k-means' nearest-word choices make chaotic.
STEPS = 20
#: A whole run, eager (fused SGD) against compiled: 6 steps of the tiny recipe, free-running from the same start.
RTOL, ATOL, MOMENTUM_RTOL = 1e-4, 1e-5, 1e-4


def random_batch(i: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.rand(8, 3, 24, 24, generator=g), [
        torch.rand(8, 1, 3, 16, 16, generator=g),
        torch.rand(8, 2, 3, 8, 8, generator=g),
    ]


def rounding(after: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """Two float32 roundings of ``after = before + update``: 2 ulps of the result and of the update (an element
    near zero after a large update keeps the update's rounding), and the smallest normal float."""
    eps = torch.finfo(torch.float32).eps
    return 2 * eps * (after.abs() + (after - before).abs()) + torch.finfo(torch.float32).tiny


def assert_buffers_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """SGD's momentum buffers (sums of gradients, whose terms cancel: an element near zero keeps the absolute
    rounding of its terms, not a relative one) agree to MOMENTUM_RTOL of the buffer's norm."""
    error = float((got.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30))
    assert error <= MOMENTUM_RTOL, f"momentum buffer {tuple(expected.shape)}: relative error {error:.3g}"


def eager_and_compiled(cfg: Config, steps: int, per_group: bool, backend) -> tuple:
    """Two models of ``cfg`` (``steps`` steps long), their optimisers, and the second's :class:`CompiledStep` on
    ``backend``: ``(eager, eager_opt, compiled, compiled_opt, step)``."""
    eager, compiled = (build_model(cfg, steps, torch.device("cpu")).train() for _ in range(2))
    eager_opt, compiled_opt = build_optimizer(eager, cfg), build_optimizer(compiled, cfg)

    def compiled_forward_backward(teacher, views):
        return forward_backward(compiled, teacher, views, None, contextlib.nullcontext(), per_group)

    step = CompiledStep(compiled, compiled_opt, compiled_forward_backward, backend=backend)
    return eager, eager_opt, compiled, compiled_opt, step


def step_both_from_one_state(
    eager, eager_opt, compiled, step: CompiledStep, i: int, lr: float, logged: bool, per_group: bool, batch=None
) -> tuple[dict, list, dict]:
    """Step ``i`` twice from the compiled model's state: the eager model and optimiser take that state (the
    optimiser fused, as an eager run's), and both run ``batch(i)`` (:func:`random_batch`) at ``lr`` from the same
    random state; the compiled step must draw as many random numbers as the eager one and give the same metrics'
    keys. Returns ``(eager metrics, eager gradients, compiled metrics)``."""
    eager.load_state_dict(compiled.state_dict())
    eager_opt.load_state_dict(copy.deepcopy(step.optimizer.state_dict()))  # (else they share the buffers)
    configure_optimizer(eager_opt, step=False)  # fused, as an eager run's
    teacher, views = (batch or random_batch)(i)
    for model in (eager, compiled):
        model.begin_step(logged, i)
    state = torch.get_rng_state()
    for group in eager_opt.param_groups:
        group["lr"] = lr
    eager_opt.zero_grad(set_to_none=True)
    expected = forward_backward(eager, teacher, views, None, contextlib.nullcontext(), per_group)
    gradients = [p.grad for p in eager.parameters()]
    eager_opt.step()
    drawn = torch.get_rng_state()
    torch.set_rng_state(state)
    got = step(teacher, views, lr)
    assert torch.equal(torch.get_rng_state(), drawn), f"step {i}: the compiled step drew other random numbers"
    assert got.keys() == expected.keys()
    return expected, gradients, got


@pytest.mark.slow
@pytest.mark.parametrize(
    "sections",
    [
        {},
        {"model": {"vocabulary": "kmeans", "rare_word_steps": 3, "levels": ["conv4", "conv5"], "border": 0}},
        # shuffled batch norm (a permutation drawn every step) and a queue of 4 batches (its pointer goes round)
        {"model": {"method": "mocov2"}, "moco": {"queue_size": 32, "bn_splits": 2}},
        # a box and a permutation per group and step, drawn on the host: 20 boxes, one graph
        {"model": {"cutmix": True}},
    ],
    ids=["queue", "kmeans_multiscale", "mocov2", "cutmix"],
)
@pytest.mark.parametrize("per_group", [False, True], ids=["whole", "per_group"])
@torch._dynamo.config.patch(error_on_recompile=True)
def test_compiled_step_equals_the_eager_step(sections, per_group):
    """STEPS steps, logged and unlogged, with a learning rate that changes every step, each from the same state and
    random numbers: the compiled step computes what the eager one does (see STEPS), draws as many random numbers,
    and after the first unlogged and the first logged step nothing compiles again (a recompilation is an error)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    if per_group and sections.get("model", {}).get("method") != "mocov2" and not compiled_module.traces_leaf_tensors():
        pytest.skip(f"torch {torch.__version__}'s Dynamo cannot make leaf tensors: a compiled step is whole there")
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    eager, eager_opt, compiled, compiled_opt, step = eager_and_compiled(
        compile_config(**sections), STEPS, per_group, counter
    )
    graphs_after = {}
    for i in range(STEPS):
        before = {name: p.detach().clone() for name, p in compiled.named_parameters()}
        trained = [p for group in compiled_opt.param_groups for p in group["params"]]
        buffers_before = {p: compiled_opt.state[p]["momentum_buffer"].clone() for p in trained}
        lr = 0.05 * (1 + np.cos(np.pi * i / STEPS)) / 2
        expected, gradients, got = step_both_from_one_state(
            eager, eager_opt, compiled, step, i, lr, logged=i % 7 == 3, per_group=per_group
        )
        for key in expected:
            assert torch.equal(got[key], expected[key]), f"step {i}, {key}: {got[key]} != {expected[key]}"
        for p, gradient in zip(compiled.parameters(), gradients, strict=True):
            assert (p.grad is None) == (gradient is None) and (gradient is None or torch.equal(p.grad, gradient))
        parameters = {name for name, _ in compiled.named_parameters()}
        a, b = eager.state_dict(), compiled.state_dict()
        for key in a:
            if key in parameters:  # the optimiser's rounding
                excess = float(((b[key] - a[key]).abs() / rounding(a[key], before[key])).max())
                assert excess <= 1, f"step {i}, {key}: {excess:.3g} times the tolerance"
            else:  # the teacher (an EMA of the student before this update), vocabularies, statistics, BN buffers
                assert torch.equal(b[key], a[key]), f"step {i}, {key}"
        eager_trained = [p for group in eager_opt.param_groups for p in group["params"]]
        for p_eager, p_compiled in zip(eager_trained, trained, strict=True):
            a, b = eager_opt.state[p_eager]["momentum_buffer"], compiled_opt.state[p_compiled]["momentum_buffer"]
            excess = float(((b - a).abs() / rounding(a, buffers_before[p_compiled])).max())
            assert excess <= 1, f"step {i}, momentum buffer {tuple(a.shape)}: {excess:.3g} times the tolerance"
        graphs_after[i] = counter.frame_count
    assert int(compiled.iteration) == STEPS
    # compiled on the first step (forward-backward, optimiser) and the first logged one (step 3), never again
    assert graphs_after[STEPS - 1] == graphs_after[3] > graphs_after[0] > 0


@pytest.mark.slow
def test_a_compiled_run_never_recompiles_and_its_checkpoints_move_to_and_from_eager(
    tmp_path, tiny_recipe, write_images, monkeypatch, caplog
):
    """``obow pretrain``'s loop with ``train.compile=step``: two epochs (learning rate changing every step of the
    warm-up, then per epoch), logged and unlogged steps, the last batch of each epoch, and a resumption (a new
    process: Dynamo's caches emptied) compile each graph once: a recompilation is an error here. Its final state
    is the eager run's, and an epoch-1 checkpoint of either run, continued by the other mode, ends there too.
    The views come from the device pipeline, whose render a ``step`` run compiles too here (as on a GPU), under the
    same counter: one graph more, never recompiled, the same views (``aot_eager``)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from obow.config import load_config
    from obow.training import build
    from obow.training.loop import pretrain
    from obow.training.step import compiled
    from obow.weights.checkpoint import load_checkpoint

    data = write_images(tmp_path / "data")  # 24 images: 3 steps an epoch
    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(compiled, "BACKEND", counter)
    monkeypatch.setattr(build, "COMPILED_RENDER_DEVICES", ("cuda", "cpu"))
    settings = [f"data.path={data}", "optim.epochs=2", "train.log_every=2", "train.keep_every=1", "train.knn_every=0"]
    settings += ["train.tensorboard=false", f"model.arch_options.layers={ONE_BLOCK['layers']}"]
    settings += ["data.pipeline=device", f"data.cache_dir={tmp_path / 'cache'}"]

    def run(out: Path, mode: str) -> dict:
        torch._dynamo.reset()
        with torch._dynamo.config.patch(error_on_recompile=True):
            pretrain(load_config(tiny_recipe, [*settings, f"train.compile={mode}"]), out)
        return load_checkpoint(out / "checkpoint.pt")

    with caplog.at_level(logging.INFO, logger="obow"):
        finals = {mode: run(tmp_path / mode, mode) for mode in ("step", "off")}
    made = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Data: views made")]
    assert len(made) == 2 and made[0].startswith("Data: views made on the cpu (compiled) from 24 images")
    assert made[1].startswith("Data: views made on the cpu from 24 images")
    assert counter.frame_count > 0
    for mode, other in (("off", "step"), ("step", "off")):
        out = tmp_path / f"{mode}_then_{other}"
        out.mkdir()
        (out / "checkpoint.pt").write_bytes((tmp_path / mode / "checkpoints" / "epoch_0001.pt").read_bytes())
        (out / "config.yaml").write_bytes((tmp_path / mode / "config.yaml").read_bytes())
        finals[out.name] = run(out, other)
    reference = finals["off"]
    for name, final in finals.items():
        assert final["iteration"] == 6, name
        for key, value in reference["model"].items():
            torch.testing.assert_close(final["model"][key], value, rtol=RTOL, atol=ATOL, msg=f"{name}: {key}")
        for index, state in reference["optimizer"]["state"].items():
            assert_buffers_close(final["optimizer"]["state"][index]["momentum_buffer"], state["momentum_buffer"])


#: Inductor against eager: its generated kernels fuse and reorder the sums (batch norm, the losses, SGD), so one
#: step agrees to float32 rounding accumulated over a few operators, not bit for bit.
INDUCTOR_RTOL, INDUCTOR_ATOL = 1e-4, 1e-6


def one_shape_batch(i: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """:func:`random_batch`'s teacher images and two student view groups of one shape: Inductor compiles each
    distinct kernel once (a C++ compiler process each, about 2 s on a 2-core CPU), and the second group's are then
    the first's: 56 kernels to compile against 84 with 8-pixel patches, for the same two-group step."""
    g = torch.Generator().manual_seed(2000 + i)
    return torch.rand(8, 3, 24, 24, generator=g), [torch.rand(8, 1, 3, 16, 16, generator=g) for _ in range(2)]


@pytest.mark.slow
def test_inductor_compiled_step_equals_the_eager_step_to_rounding():
    """The backend a run uses (Inductor, with ``fallback_random``; its C++ compilation takes minutes on a CPU):
    3 unlogged steps of OBoW with a queue vocabulary and two student view groups (:func:`one_shape_batch`), each
    from the same state and random numbers as an eager step, draw the same random numbers and give the same
    metrics, gradients, weights, teacher, queue and batch-norm buffers to float32 rounding (INDUCTOR_RTOL of each
    tensor's norm)."""
    torch._dynamo.reset()
    eager, eager_opt, compiled, _, step = eager_and_compiled(compile_config(), 3, False, "inductor")

    def close(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
        if not torch.is_floating_point(expected):
            assert torch.equal(got, expected), what
            return
        error = float((got.double() - expected.double()).norm())
        bound = INDUCTOR_RTOL * float(expected.double().norm()) + INDUCTOR_ATOL
        assert error <= bound, f"{what}: {error:.3g} > {bound:.3g}"

    for i in range(3):
        # fallback_random: PyTorch's own generator, as many numbers as the eager step draws
        expected, gradients, got = step_both_from_one_state(
            eager, eager_opt, compiled, step, i, 0.05 / (i + 1), logged=False, per_group=False, batch=one_shape_batch
        )
        for key in expected:
            close(got[key], expected[key], f"step {i}, {key}")
        for (name, p), gradient in zip(compiled.named_parameters(), gradients, strict=True):
            assert (p.grad is None) == (gradient is None), name
            if gradient is not None:
                close(p.grad, gradient, f"step {i}, gradient of {name}")
        a, b = eager.state_dict(), compiled.state_dict()
        for key in a:
            close(b[key], a[key], f"step {i}, {key}")
