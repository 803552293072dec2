"""--use-fused-linear-cross-entropy against what later releases added to `GPTModel._postprocess`:
MuP's logit multiplier (0.17+: the tiles apply it, loss and gradients match Megatron), a model
with its own `_scale_logits` and an `output_processor` (0.18+: Megatron's path runs, counted),
`padding_mask` (0.18+: the tiles run, same loss). Each case runs where its release has it."""
from __future__ import annotations

import inspect

import pytest
import torch

from npuspeed import telemetry
from npuspeed.features.fused_linear_ce.function import CALLS, linear_cross_entropy
from npuspeed.features.fused_linear_ce.postprocess import MUP

FLAG = ["--use-fused-linear-cross-entropy", "--fused-linear-cross-entropy-fallback", "never",
        "--fused-linear-cross-entropy-chunk-size", "5000"]
SEQ, BATCH, HIDDEN, VOCAB = 16, 2, 32, 600
FALLBACK = "fused_linear_ce.fallback."


def _has(name: str) -> bool:
    from megatron.core.models.gpt.gpt_model import GPTModel

    return name in inspect.signature(GPTModel._postprocess).parameters


def _mup() -> bool:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return "use_mup" in TransformerConfig.__dataclass_fields__


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_function_applies_the_logit_multiplier(megatron_mp, dtype, tol):
    from megatron.core import tensor_parallel

    gen = torch.Generator().manual_seed(1)
    h, w = torch.randn(12, 2, 32, generator=gen).to(dtype), (torch.randn(500, 32, generator=gen) * 0.3).to(dtype)
    labels, g = torch.randint(0, 500, (12, 2), generator=gen), torch.rand(12, 2, generator=gen)
    results = []
    for fused in (False, True):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = (linear_cross_entropy(hh, ww, labels, chunk=3000, scale=0.25) if fused else
                tensor_parallel.vocab_parallel_cross_entropy(torch.matmul(hh, ww.t()) * 0.25, labels))
        loss.backward(g)
        results.append((loss.detach(), hh.grad, ww.grad))
    for name, a, b in zip(("loss", "dhidden", "dweight"), *results):
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol, msg=name)


def _gpt(cls=None, **config):
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    tensor_parallel.model_parallel_cuda_manual_seed(7)
    torch.manual_seed(7)
    cfg = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, hidden_dropout=0.0,
                            attention_dropout=0.0, use_cpu_initialization=True, **config)
    return (cls or GPTModel)(cfg, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ)


def _step(model, **kwargs):
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    out = model(tokens, torch.arange(SEQ).expand(BATCH, SEQ), None, labels=torch.roll(tokens, -1, 1), **kwargs)
    if out.dim() != 2:
        return out, {}
    out.float().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _both(with_features, cls=None, config=None, **kwargs):
    """(Megatron's loss and grads, the flag's, the flag's counters)."""
    baseline = _gpt(cls, **(config or {}))
    expected = _step(baseline, **kwargs)
    with with_features(FLAG):
        model = _gpt(cls, **(config or {}))
        model.load_state_dict(baseline.state_dict())
        before = telemetry.snapshot("fused_linear_ce.")
        got = _step(model, **kwargs)
        counted = telemetry.since(before, "fused_linear_ce.")
    return expected, got, counted


def _assert_same(expected, got):
    torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=1e-5)
    assert got[1].keys() == expected[1].keys()
    for name, g in expected[1].items():
        torch.testing.assert_close(got[1][name], g, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.skipif(not _mup(), reason="MuP arrived in megatron-core 0.17")
def test_mup_logit_scaling_is_applied_by_the_tiles(megatron_mp, with_features):
    config = dict(use_mup=True, mup_base_hidden_size=HIDDEN // 4)  # mup_output_mult = 1/4
    expected, got, counted = _both(with_features, config=config)
    assert counted.get(CALLS) == 1 and counted.get(MUP) == 1, counted
    _assert_same(expected, got)


@pytest.mark.skipif(not _mup(), reason="_scale_logits arrived in megatron-core 0.17")
def test_a_model_with_its_own_logit_scaling_takes_megatrons_path(megatron_mp, with_features):
    from megatron.core.models.gpt import GPTModel

    class Scaled(GPTModel):
        def _scale_logits(self, logits):
            return logits * 3.0

    expected, got, counted = _both(with_features, cls=Scaled)
    assert counted == {FALLBACK + "custom__scale_logits": 1}, counted
    _assert_same(expected, got)


@pytest.mark.skipif(not _mup() or not _has("output_processor"), reason="output_processor arrived in 0.18")
def test_an_output_processor_gets_the_hidden_states(megatron_mp, with_features):
    seen = []

    def processor(**kw):
        seen.append(sorted(kw))
        logits, _ = kw["output_layer"](kw["hidden_states"], weight=kw["output_weight"])
        return kw["scale_logits"](logits).sum(-1).transpose(0, 1)

    expected, got, counted = _both(with_features, output_processor=processor)
    assert len(seen) == 2 and seen[0] == seen[1]
    assert counted == {FALLBACK + "output_processor_given": 1}, counted
    torch.testing.assert_close(got[0], expected[0])


@pytest.mark.skipif(not _has("padding_mask"), reason="padding_mask arrived in megatron-core 0.18")
def test_padding_mask_keeps_the_tiles(megatron_mp, with_features):
    padding = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    padding[:, -3:] = True
    expected, got, counted = _both(with_features, padding_mask=padding)
    assert counted.get(CALLS) == 1 and not any(k.startswith(FALLBACK) for k in counted), counted
    _assert_same(expected, got)
