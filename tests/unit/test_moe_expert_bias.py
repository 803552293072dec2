"""Expert biases (Megatron's default, without --disable-bias-linear) in SequentialMLP at EP 1 / TP 1
(npuspeed/features/device/moe_expert_bias.py): Megatron's in-place bias add fails on the view the
TP reduce returns; the patch adds the same values out of place. Parity is against Megatron's own
in-place add run on a copy of that output (what it computes where the add is allowed)."""
from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from npuspeed.features.device import moe_expert_bias
from npuspeed.patching.versions import in_range

TARGET = "megatron.core.transformer.mlp.MLP.forward"
pytestmark = pytest.mark.skipif(not in_range(moe_expert_bias.INPLACE_ADD),
                                reason="the in-place expert-bias add is megatron-core 0.15-0.19's")
COUNTS = [5, 0, 7, 4]  # expert 1 gets no tokens


def _experts(dtype, swiglu: bool):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, ffn_hidden_size=24,
                               moe_ffn_hidden_size=24, num_moe_experts=4, add_bias_linear=True,
                               gated_linear_unit=swiglu, activation_func=F.silu if swiglu else F.gelu,
                               bias_activation_fusion=False, use_cpu_initialization=True,
                               params_dtype=dtype, bf16=dtype == torch.bfloat16)
    experts = SequentialMLP(4, config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                            pg_collection=get_default_pg_collection())
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in experts.parameters():  # biases are zero at init: give them values
            p.copy_(torch.randn(p.shape, generator=gen).to(dtype) * 0.3)
    return experts


def _run(experts, dtype, forward=None):
    """Output and every gradient (input, probabilities, parameters) of one forward/backward."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(sum(COUNTS), 16, generator=gen).to(dtype).requires_grad_()
    probs = torch.rand(sum(COUNTS), generator=gen).requires_grad_()  # router probabilities: fp32
    experts.zero_grad()
    out, bias = (forward or experts)(x, torch.tensor(COUNTS), probs)
    assert bias is None
    out.backward(torch.randn(out.shape, generator=gen).to(dtype))
    grads = [x.grad, probs.grad] + [p.grad for p in experts.parameters()]
    return [out.detach()] + [g.clone() for g in grads]


class _MegatronsAddOnACopy:
    """Each expert's linear_fc2 output copied (no longer the reduce's view), so that Megatron's
    own in-place `output += bias * scale` runs: the reference."""

    def __init__(self, experts):
        self.handles = [e.linear_fc2.register_forward_hook(lambda _m, _a, r: (r[0].clone(), r[1]))
                        for e in experts.local_experts]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def test_the_fix_is_installed_on_this_release(npuspeed_runtime):
    from npuspeed.patching import registry

    rows = [r for r in registry.report() if r["target"] == TARGET and r["feature"] == "device"]
    assert rows and rows[0]["status"] == "applied", rows


def test_without_the_fix_megatron_fails_in_its_in_place_add(megatron_mp):
    from megatron.core.transformer.mlp import MLP
    from npuspeed.patching import registry

    experts = _experts(torch.float32, swiglu=False)
    upstream = registry.original(TARGET)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(MLP, "forward", upstream)
        with pytest.raises(RuntimeError, match="_ReduceFromModelParallelRegion is a view and is being modified inplace"):
            _run(experts, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("swiglu", [False, True])
def test_expert_biases_equal_megatrons_add(megatron_mp, monkeypatch, dtype, swiglu):
    experts = _experts(dtype, swiglu)
    added = []
    hook = moe_expert_bias.scaled_bias_hook

    def counting(scale):
        inner = hook(scale)

        def spy(*args):
            result = inner(*args)
            added.append(result is not None)
            return result

        return spy

    monkeypatch.setattr(moe_expert_bias, "scaled_bias_hook", counting)
    patched = _run(experts, dtype)
    assert added == [True] * 4, added  # the out-of-place add ran, once per expert (expert 1 on no tokens)
    added.clear()
    with _MegatronsAddOnACopy(experts):
        reference = _run(experts, dtype)
    assert added == [False] * 4  # on a copy, Megatron's own add ran
    for got, want in zip(patched, reference):
        assert got.dtype == want.dtype
        assert torch.equal(got, want), (got - want).abs().max()
    assert patched[-1].abs().sum() > 0  # the last parameter (an fc2 bias) got a gradient


def test_0_13_and_0_14_refuse_expert_biases_in_one_line():
    """There MLP.forward asserts 'Bias is not supported with per_token_scale': refused at build."""
    built = []
    init = moe_expert_bias.refuse_expert_bias(lambda self, n, config, *a, **k: built.append(n))
    with pytest.raises(moe_expert_bias.ExpertBiasError, match="add --disable-bias-linear") as err:
        init(object(), 4, types.SimpleNamespace(add_bias_linear=True))
    assert "\n" not in str(err.value) and not built
    init(object(), 4, types.SimpleNamespace(add_bias_linear=False))
    assert built == [4]
    assert moe_expert_bias.ASSERTS_NO_BIAS == ">=0.13,<0.15" and moe_expert_bias.INPLACE_ADD == ">=0.15,<0.20"
