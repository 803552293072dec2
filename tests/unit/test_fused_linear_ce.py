"""--use-fused-linear-cross-entropy at TP1: the tiled function and the patched GPT head against
Megatron's output layer + vocab_parallel_cross_entropy (loss, hidden and weight gradients),
the tiles issued, and no [tokens, V] tensor alive (CPU tracking allocator)."""
from __future__ import annotations

import gc

import pytest
import torch

from npuspeed import telemetry
from npuspeed.features.fused_linear_ce import FusedLinearCEFeature
from npuspeed.features.fused_linear_ce.function import CALLS, CHUNKS, linear_cross_entropy, tile

FLAG, CHUNK, FALLBACK = ("--use-fused-linear-cross-entropy", "--fused-linear-cross-entropy-chunk-size",
                         "--fused-linear-cross-entropy-fallback")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _megatron(h, w, labels, g):
    from megatron.core import tensor_parallel

    h = h.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    loss = tensor_parallel.vocab_parallel_cross_entropy(torch.matmul(h, w.t()), labels)
    loss.backward(g)
    return loss.detach(), h.grad, w.grad


def _fused(h, w, labels, g, chunk):
    h = h.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    loss = linear_cross_entropy(h, w, labels, None, False, chunk)
    loss.backward(g)
    return loss.detach(), h.grad, w.grad


def _inputs(s, b, hidden, vocab, dtype, seed=0, negative=False):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(s, b, hidden, generator=gen).to(dtype)
    w = (torch.randn(vocab, hidden, generator=gen) * 0.3).to(dtype)
    labels = torch.randint(0, vocab, (s, b), generator=gen)
    g = torch.rand(s, b, generator=gen)
    g[0] = 0.0  # masked tokens
    if negative:
        g[1] = -g[1]
    return h, w, labels, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk,negative", [(None, False), (4000, False), (300, True), (10**9, False)])
def test_function_matches_megatron(megatron_mp, dtype, chunk, negative):
    h, w, labels, g = _inputs(24, 3, 32, 1000, dtype, negative=negative)
    expected = _megatron(h, w, labels, g)
    before = telemetry.snapshot("fused_linear_ce.")
    got = _fused(h, w, labels, g, chunk)
    block, width = tile(72, 1000, chunk)
    tiles = -(-72 // block) * -(-1000 // width)
    assert telemetry.since(before, "fused_linear_ce.") == {CALLS: 1, CHUNKS: 2 * tiles}
    for name, a, b in zip(("loss", "dhidden", "dweight"), got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        torch.testing.assert_close(a.float(), b.float(), **TOL[dtype], msg=name)


def test_exp2_form_keeps_fp32_parity_with_wide_logits(megatron_mp):
    """The tiles' exp (exp2 of x * log2 e on CPU) against Megatron's torch.exp where the logits
    spread over tens (many exps subnormal or 0): still within fp32's 1e-5."""
    from npuspeed.features.fused_linear_ce.function import _exp_

    x = torch.linspace(-20, 0, 100_001)
    torch.testing.assert_close(_exp_(x.clone()), torch.exp(x), atol=0, rtol=2e-6)  # ~1e-6 measured
    h, w, labels, g = _inputs(16, 2, 32, 700, torch.float32)
    w = w / w.std() * 2.0  # logits of std ~ 11 (h ~ N(0, 1), 32 wide)
    expected = _megatron(h, w, labels, g)
    got = _fused(h, w, labels, g, 3000)
    for name, a, b in zip(("loss", "dhidden", "dweight"), got, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


def test_tiles_bound_the_logits():
    assert tile(1024, 65536, None) == (1024, 1024)  # all tokens, a 1/64 slice of the vocabulary
    assert tile(72, 1000, 20000) == (72, 277)
    assert tile(72, 1000, 4000) == (15, 256)  # 55 columns of all tokens: 256 columns of fewer
    assert tile(72, 1000, 300) == (1, 256)  # narrower than 256 columns: fewer tokens instead
    assert tile(10, 50, 10**9) == (10, 50)
    for tokens, vocab, chunk in ((1000, 7, 100), (3, 70000, 1 << 20), (5000, 150000, None)):
        block, width = tile(tokens, vocab, chunk)
        assert 1 <= block <= tokens and 1 <= width <= vocab
        assert block * width <= max(chunk or (1 << 20), min(256, vocab))


def test_no_tokens_by_vocab_tensor_is_alive(megatron_mp):
    acc = megatron_mp.accelerator
    if acc.name != "cpu":
        pytest.skip("peak memory from the CPU tracking allocator")
    s, b, hidden, vocab = 128, 4, 16, 8192
    logits_bytes = s * b * vocab * 4  # 16 MiB of fp32 logits
    h, w, labels, g = _inputs(s, b, hidden, vocab, torch.float32)

    def peak(run):
        gc.collect()
        base = acc.memory_allocated()
        acc.reset_peak_memory_stats()
        out = run()
        del out
        return acc.max_memory_allocated() - base

    megatron = peak(lambda: _megatron(h, w, labels, g))
    fused = peak(lambda: _fused(h, w, labels, g, None))
    assert megatron >= logits_bytes  # Megatron holds the logits (and the softmax in them)
    # one 1 Mi-entry tile, the fp32 weight gradient, small [tokens] vectors
    assert fused <= 4 * (1 << 20) + 2 * vocab * hidden * 4 + 64 * s * b + (1 << 16), (fused, megatron)
    assert fused <= 0.3 * megatron


# -- the patched GPT head ----------------------------------------------------------------------
SEQ, BATCH, HIDDEN, VOCAB = 32, 2, 32, 1000


def _gpt(dtype, untie):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, use_cpu_initialization=True, params_dtype=dtype,
                               bf16=dtype == torch.bfloat16)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ,
                     share_embeddings_and_output_weights=not untie)
    if dtype == torch.bfloat16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    return model


def _step(model, labels=True):
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    out = model(tokens, torch.arange(SEQ).expand(BATCH, SEQ), None,
                labels=torch.roll(tokens, -1, 1) if labels else None)
    if not labels:
        return out
    mask = torch.ones(BATCH, SEQ)
    mask[:, :3] = 0
    (out.float() * mask).sum().div(mask.sum()).backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype,untie", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False)])
def test_gpt_head_matches_megatron(megatron_mp, with_features, dtype, untie):
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(7)
    baseline = _gpt(dtype, untie)
    loss, grads = _step(baseline)
    with with_features([FLAG, FALLBACK, "never", CHUNK, "5000"]):
        model = _gpt(dtype, untie)
        model.load_state_dict(baseline.state_dict())
        before = telemetry.snapshot("fused_linear_ce.")
        got_loss, got_grads = _step(model)
        counted = telemetry.since(before, "fused_linear_ce.")
        logits = _step(model, labels=False)  # inference: Megatron's output layer gives the logits
        assert logits.shape == (BATCH, SEQ, VOCAB)
        fell_back = telemetry.since(before, "fused_linear_ce.fallback.")
    assert counted[CALLS] == 1 and counted[CHUNKS] > 2
    assert fell_back == {"fused_linear_ce.fallback.no_labels": 1}
    assert got_loss.shape == loss.shape == (BATCH, SEQ)
    torch.testing.assert_close(got_loss, loss, **TOL[dtype])
    assert got_grads.keys() == grads.keys()
    tied = [n for n in grads if "word_embeddings" in n or "output_layer" in n]
    assert len(tied) == (2 if untie else 1)
    for name, g in grads.items():
        torch.testing.assert_close(got_grads[name].float(), g.float(), **TOL[dtype], msg=name)


def test_auto_measures_once_per_shape_and_the_report_says_which(megatron_mp, with_features):
    from npuspeed.features.fused_linear_ce.candidates import CHOICE

    tensor_seed = 5
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(tensor_seed)
    with with_features([FLAG]) as args:
        model = _gpt(torch.float32, False)
        before = telemetry.snapshot("fused_linear_ce.")
        _step(model)
        _step(model)
        counted = telemetry.since(before, "fused_linear_ce.")
        choice = telemetry.last(CHOICE)
        ctx = type("Ctx", (), {"args": args, "accelerator": megatron_mp.accelerator})()
        path = FusedLinearCEFeature().path(ctx)
    assert choice["key"][2:] == (SEQ * BATCH, HIDDEN, VOCAB) and choice["chunked_ms"] > 0 and choice["megatron_ms"] > 0
    if choice["path"] == "chunked":  # the trial's own tiles are not counted
        assert counted[CALLS] == 2
    else:
        assert counted == {"fused_linear_ce.fallback.measured_slower": 2}
    assert "measured once" in path and "chunked torch on" in path


def test_label_smoothing_is_refused(megatron_mp, with_features):
    from npuspeed.errors import UserError

    with with_features([FLAG, FALLBACK, "never"]):
        model = _gpt(torch.float32, False)
        model.config.label_smoothing = 0.1
        with pytest.raises(UserError, match="label smoothing.*--use-fused-linear-cross-entropy"):
            _step(model)


@pytest.mark.parametrize("argv,match", [
    ([CHUNK, "100"], "without --use-fused-linear-cross-entropy"),
    ([FALLBACK, "never"], "without --use-fused-linear-cross-entropy"),
    ([FLAG, CHUNK, "0"], "positive number of logits"),
])
def test_bad_flags(npuspeed_runtime, argv, match):
    from npuspeed import runtime
    from npuspeed.features import all_features
    from npuspeed.features.base import FeatureError

    ctx = runtime.make_context(all_features(), argv, npuspeed_runtime.accelerator)
    with pytest.raises(FeatureError, match=match):
        FusedLinearCEFeature().validate(ctx)


@pytest.mark.parametrize("chunked_s,megatron_s,expected", [(1.0, 1.0, "chunked"), (1.2, 1.0, "chunked"),
                                                           (1.3, 1.0, "megatron")])
def test_auto_keeps_the_tiles_within_the_time_allowance(megatron_mp, with_features, monkeypatch, chunked_s,
                                                        megatron_s, expected):
    """Memory first: the tiles hold fewer bytes, so they run while their head takes at most
    ALLOWANCE (1.25x) Megatron's time; the trial's timings are made up here, so both branches
    run: Megatron's path past the allowance, said once in the notes and counted."""
    from megatron.core import tensor_parallel

    from npuspeed.features.fused_linear_ce import candidates
    from npuspeed.ops.choose.trial import Clock

    assert candidates.ALLOWANCE == 1.25
    monkeypatch.setattr(Clock, "time", lambda self, run, inputs: megatron_s if run.fn is candidates._megatron
                        else chunked_s)
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    baseline = _gpt(torch.float32, False)
    loss, _ = _step(baseline)
    with with_features([FLAG]):
        ctx = with_features.ctx
        model = _gpt(torch.float32, False)
        model.load_state_dict(baseline.state_dict())
        before = telemetry.snapshot("fused_linear_ce.")
        got, _ = _step(model)
        counted = telemetry.since(before, "fused_linear_ce.")
    torch.testing.assert_close(got, loss, atol=1e-5, rtol=1e-5)
    if expected == "chunked":
        assert counted == {CALLS: 1, CHUNKS: counted[CHUNKS]} and counted[CHUNKS] >= 2
    else:
        assert counted == {"fused_linear_ce.fallback.measured_slower": 1}
        assert any("measured faster" in n and "chunked 1300.0 ms, Megatron 1000.0 ms" in n for n in ctx.notes), ctx.notes


def test_deterministic_mode_takes_the_tiles_without_timing(monkeypatch):
    """--deterministic-mode: no trial decides (two runs could pick paths that round differently)."""
    from npuspeed import get_accelerator
    from npuspeed.features.fused_linear_ce import candidates
    from npuspeed.ops.choose.trial import Clock

    def no_trial(*_a):
        raise AssertionError("timed under --deterministic-mode")

    monkeypatch.setattr(Clock, "time", no_trial)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        chooser = candidates.LossPaths("auto")
        path = chooser.choose(64, torch.zeros(64, 1, 8), torch.zeros(32, 8), None, get_accelerator())
    finally:
        torch.use_deterministic_algorithms(was)
    assert path == candidates.CHUNKED
    assert "deterministic" in next(iter(chooser.choices.values()))["why"]



def test_the_planner_drops_the_logits():
    """`npuspeed plan` with the flag: the head's [tokens, V] logits, fp32 softmax and gradient go."""
    from npuspeed.plan.planner import plan

    model = ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "256",
             "--micro-batch-size", "4", "--vocab-size", "65536", "--nproc-per-node", "1"]
    base = plan(model, with_removes=False).peak
    fused = plan(model + [FLAG], with_removes=False)
    logits = 256 * 4 * 65536 * 4  # fp32: Megatron's softmax and its gradient reuse the logits' storage
    assert fused.peak <= base - 0.9 * logits, (fused.peak, base)
    assert fused.peak <= 0.5 * base
