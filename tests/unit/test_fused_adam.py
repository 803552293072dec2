"""torch's fused Adam where megatron-core falls back to torch's Adam (the device layer, always on).

In one process, a tiny GPT trained by Megatron's optimizers as npuspeed builds them (fused) and
as Megatron builds them (the patched function's original, `__wrapped__`): losses within 1e-6
over 10 steps (fp32, bf16, the distributed optimizer), the fused kernel really ran (the
optimizer's groups, torch's dispatcher saw `_fused_adamw_`, the step counter), a wrong eps
moves the losses past that bound (so the bound catches one), a checkpoint of either kind
resumes in the other, and what cannot take the kernel keeps Megatron's optimizer and says so.
"""
from __future__ import annotations

import logging

import pytest
import torch
from tiny_gpt_steps import train_steps as _train
from torch.utils._python_dispatch import TorchDispatchMode

from npuspeed import telemetry
from npuspeed.features.device import fused_adam

STEPS = 10
TOL = 1e-6


class _Ops(TorchDispatchMode):
    """The aten ops that ran (names only)."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def megatrons(monkeypatch):
    """Megatron's own optimizer factory while the fixture is in use (the device layer's wrapper
    taken off, for the parity baseline)."""
    import megatron.core.optimizer as mo

    patched = mo._get_megatron_optimizer_based_on_param_groups
    assert hasattr(patched, "__wrapped__"), "the device layer's wrapper is not installed"

    class Swap:
        def __enter__(self):
            monkeypatch.setattr(mo, "_get_megatron_optimizer_based_on_param_groups", patched.__wrapped__)

        def __exit__(self, *exc):
            monkeypatch.setattr(mo, "_get_megatron_optimizer_based_on_param_groups", patched)

    return Swap()


def _build(bf16: bool, distopt: bool, **opt_kwargs):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0, bf16=bf16,
                               params_dtype=torch.bfloat16 if bf16 else torch.float32)
    gpt = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16)
    if bf16:
        gpt = Float16Module(config, gpt)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(
        use_distributed_optimizer=distopt, grad_reduce_in_fp32=True), gpt)
    optimizer = get_megatron_optimizer(OptimizerConfig(**{
        "optimizer": "adam", "lr": 1e-2, "weight_decay": 0.01, "clip_grad": 1.0, "bf16": bf16,
        "use_distributed_optimizer": distopt, **opt_kwargs}), [model])
    return model, optimizer




def _inners(optimizer):
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def _diff(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


LAYOUTS = {"fp32": (False, False), "bf16": (True, False), "fp32-distopt": (False, True),
           "bf16-distopt": (True, True)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_losses_within_1e6_of_megatrons_adam_and_the_fused_kernel_ran(megatron_mp, megatrons, layout):
    bf16, distopt = LAYOUTS[layout]
    with megatrons:
        model, optimizer = _build(bf16, distopt)
        assert all(not g["fused"] for inner in _inners(optimizer) for g in inner.param_groups)
        want = _train(model, optimizer, STEPS)
    telemetry.reset("adam.")
    model, optimizer = _build(bf16, distopt)
    inners = _inners(optimizer)
    assert all(type(inner) is torch.optim.AdamW for inner in inners)
    assert all(inner.defaults["fused"] is True and all(g["fused"] is True for g in inner.param_groups)
               for inner in inners)
    with _Ops() as ops:
        got = _train(model, optimizer, STEPS)
    assert "aten._fused_adamw_.default" in ops.seen
    assert telemetry.get(fused_adam.STEPS) == STEPS * len(inners)
    assert _diff(got, want) <= TOL, (got, want)
    assert fused_adam.built()[-1]["implementation"] == "torch AdamW fused=True"


def test_a_wrong_eps_moves_the_losses_past_the_bound(megatron_mp, megatrons):
    """The bound above is tight enough to catch a mistake in what the fused optimizer is given."""
    with megatrons:
        model, optimizer = _build(False, False)
        want = _train(model, optimizer, STEPS)
    model, optimizer = _build(False, False)
    for inner in _inners(optimizer):
        for group in inner.param_groups:
            group["eps"] = 1e-6  # Megatron's is 1e-8
    assert _diff(_train(model, optimizer, STEPS), want) > 10 * TOL


def test_adam_without_decoupled_weight_decay_is_fused_too(megatron_mp, megatrons):
    """0.15+: decoupled_weight_decay=False builds torch.optim.Adam (its kernel: _fused_adam_)."""
    with megatrons:
        model, optimizer = _build(False, False, decoupled_weight_decay=False)
        assert type(_inners(optimizer)[0]) is torch.optim.Adam
        want = _train(model, optimizer, STEPS)
    model, optimizer = _build(False, False, decoupled_weight_decay=False)
    assert _inners(optimizer)[0].defaults["fused"] is True
    with _Ops() as ops:
        got = _train(model, optimizer, STEPS)
    assert "aten._fused_adam_.default" in ops.seen
    assert _diff(got, want) <= TOL


@pytest.mark.parametrize("fused_first", [True, False], ids=["fused-saves", "megatron-saves"])
def test_a_checkpoint_of_either_kind_resumes_in_the_other(megatron_mp, megatrons, fused_first):
    """bf16 (Megatron's Float16 optimizer: its state dict holds the Adam states and the masters),
    3 steps, state dicts to a fresh optimizer of the other kind, 3 more: within the bound of the
    uninterrupted run. A checkpoint leaves `fused` unset, as Megatron's; a fused optimizer stays
    fused after loading one, a Megatron one stays Megatron's."""
    import copy

    with megatrons:
        model, optimizer = _build(True, False)
        want = _train(model, optimizer, 6)

    def build(fused):
        if fused:
            return _build(True, False)
        with megatrons:
            return _build(True, False)

    model, optimizer = build(fused_first)
    _train(model, optimizer, 3)
    saved = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
    assert all(g["fused"] is None for g in saved[1]["optimizer"]["param_groups"])
    model, optimizer = build(not fused_first)
    _train(model, optimizer, 1)  # states exist before the load, as after Megatron's dummy step
    model.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    inner = _inners(optimizer)[0]
    assert all(bool(g["fused"]) is (not fused_first) for g in inner.param_groups)
    steps = [s["step"] for s in inner.state.values()]
    assert len({id(s) for s in steps}) == len(steps) and {float(s) for s in steps} == {3.0}
    got = _train(model, optimizer, 3, start=3)
    assert _diff(got, want[3:]) <= TOL, (got, want[3:])


def _plain_adamw(params, fused=None):
    return torch.optim.AdamW(params, lr=0.1, weight_decay=0.01, fused=fused)


def test_a_gradient_that_does_not_fit_the_kernel_goes_back_to_torchs_update(caplog):
    """torch's CPU kernel reads a gradient as a flat array in its parameter's layout: a transposed
    gradient would update the wrong elements. The pre-step check sees it and the step (and those
    after) run torch's unfused update, bitwise what Megatron's optimizer does, said once."""
    torch.manual_seed(0)
    weight = torch.randn(8, 6)
    grad = torch.randn(6, 8).t()  # shape (8, 6), strides of a transpose
    fused = torch.nn.Parameter(weight.clone())
    plain = torch.nn.Parameter(weight.clone())
    opt = _plain_adamw([fused])
    entry = fused_adam.adopt(opt)
    assert entry["fused"] and opt.param_groups[0]["fused"]
    ref = _plain_adamw([plain])
    with caplog.at_level(logging.WARNING, logger="npuspeed"):
        for _ in range(2):
            fused.grad, plain.grad = grad.clone(), grad.clone()
            opt.step()
            ref.step()
    assert not opt.param_groups[0]["fused"] and entry["fused"] is False
    assert torch.equal(fused, plain)
    assert sum("not fused here" in r.message for r in caplog.records) == 1
    # what the check prevents: the kernel given that gradient
    raw = torch.nn.Parameter(weight.clone())
    raw.grad = grad.clone()
    _plain_adamw([raw], fused=True).step()
    assert not torch.allclose(raw, _one_plain_step(weight, grad))


def _one_plain_step(weight, grad):
    p = torch.nn.Parameter(weight.clone())
    p.grad = grad.clone()
    _plain_adamw([p]).step()
    return p


def test_what_cannot_take_the_kernel_keeps_megatrons_optimizer_and_says_so(caplog):
    telemetry.reset("adam.")
    cases = {
        "meta": [torch.nn.Parameter(torch.empty(4, device="meta"))],
        "non-contiguous": [torch.nn.Parameter(torch.randn(4, 6).t())],
    }
    with caplog.at_level(logging.WARNING, logger="npuspeed"):
        for what, params in cases.items():
            opt = _plain_adamw(params)
            entry = fused_adam.adopt(opt)
            assert entry["fused"] is False and entry["reason"], what
            assert opt.param_groups[0]["fused"] is None, what
            assert entry["implementation"].startswith("torch AdamW (Megatron's default"), what
    assert telemetry.get(fused_adam.KEPT) == 2
    lines = [r.message for r in caplog.records if "not fused here" in r.message]
    assert any("no _fused_adamw_ kernel for meta" in m for m in lines)
    assert any("not contiguous" in m for m in lines)
    assert fused_adam.adopt(torch.optim.SGD([torch.nn.Parameter(torch.randn(2))], lr=0.1)) is None


def test_megatron_mode_leaves_the_optimizer_as_built():
    opt = _plain_adamw([torch.nn.Parameter(torch.randn(3))])
    entry = fused_adam.adopt(opt, fuse=False)
    assert entry["fused"] is False and entry["reason"] == "--npuspeed-adam megatron"
    assert opt.param_groups[0]["fused"] is None


@pytest.mark.slow  # the swap and the shared masters are compared bitwise by their own tests (both fused now)
@pytest.mark.parametrize("flags", [["--reuse-fp32-param"], ["--swap-optimizer", "--swap-optimizer-chunk-mb", "0.004"]],
                         ids=["reuse-fp32-param", "swap-optimizer"])
def test_with_the_optimizer_features_it_stays_fused(megatron_mp, megatrons, with_features, monkeypatch, flags):
    monkeypatch.setenv("NPUSPEED_SWAP_OPTIMIZER", "run")
    with megatrons:
        model, optimizer = _build(True, True)
        want = _train(model, optimizer, STEPS)
    with with_features(flags):
        telemetry.reset("adam.")
        model, optimizer = _build(True, True)
        assert _inners(optimizer)[0].defaults["fused"] is True
        got = _train(model, optimizer, STEPS)
        assert telemetry.get(fused_adam.STEPS) >= STEPS
    assert _diff(got, want) <= TOL
