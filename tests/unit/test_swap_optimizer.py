"""--swap-optimizer in one process: Megatron's optimizers on a tiny GPT, with and without the flag.

Proves the states and masters leave the device between steps (storage freed, host copies
hold the values), the chunks are pipelined (chunk k+1 comes in before chunk k is updated,
chunk k goes out before chunk k+1 is updated), bytes in equal bytes out in a steady step, and
losses and parameters are bitwise those of the plain optimizer (fp32, bf16, the distributed
optimizer, --reuse-fp32-param), also across a state_dict / load_state_dict round trip.
"""
from __future__ import annotations

import pytest
import torch
from tiny_gpt_steps import train_steps as _train

from npuspeed import telemetry
from npuspeed.features.swap_optimizer import ENV
from npuspeed.features.swap_optimizer.patches import ATTR
from npuspeed.features.swap_optimizer.swapper import PREFIX

#: a chunk this small cuts the tiny model into many chunks (MiB)
CHUNK = ["--swap-optimizer-chunk-mb", "0.004"]


@pytest.fixture(autouse=True)
def _mechanics_on_cpu(monkeypatch):
    """On the CPU backend the states stay in place unless the mechanics are asked for."""
    monkeypatch.setenv(ENV, "run")


def _build(bf16: bool, distopt: bool):
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
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-2, weight_decay=0.01, clip_grad=1.0, bf16=bf16,
        use_distributed_optimizer=distopt), [model])
    return model, optimizer




def _bits(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _subs(optimizer):
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _swaps(optimizer):
    return [getattr(o, ATTR) for o in _subs(optimizer)]


def _plain(bf16, distopt, steps):
    model, optimizer = _build(bf16, distopt)
    return _train(model, optimizer, steps), _bits(model)


# CI: fp32, bf16 and the distributed optimizer (a second or two each); reuse-fp32-param -m slow
@pytest.mark.parametrize("bf16, distopt, extra", [
    (False, False, []), (True, False, []), (True, True, []),
    pytest.param(True, False, ["--reuse-fp32-param"], marks=pytest.mark.slow),
], ids=["fp32", "bf16", "bf16-distopt", "bf16-reuse-fp32"])
def test_bitwise_equal_to_the_plain_optimizer(megatron_mp, with_features, bf16, distopt, extra):
    want_losses, want_params = _plain(bf16, distopt, 4)
    with with_features(["--swap-optimizer", *CHUNK, *extra]):
        telemetry.reset(PREFIX)
        model, optimizer = _build(bf16, distopt)
        swaps = _swaps(optimizer)
        assert all(s is not None for s in swaps)
        got = _train(model, optimizer, 4)
        assert got == want_losses
        for a, b in zip(_bits(model), want_params):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert telemetry.get(PREFIX + "steps") == 4 * len(swaps)
        assert max(s.chunk_count for s in swaps) >= 4  # really cut into chunks


def test_on_the_cpu_backend_the_states_stay_in_place_by_default(megatron_mp, with_features, monkeypatch):
    """The host is the device: copying the states would cost time and free nothing, so by
    default no swap is attached (and the run is the plain one); the report says why."""
    monkeypatch.delenv(ENV)
    want_losses, want_params = _plain(True, False, 2)
    from feature_ctx import features_enabled
    from npuspeed.features.swap_optimizer import SwapOptimizerFeature

    with with_features(["--swap-optimizer", *CHUNK]):
        ctx = features_enabled.ctx
        telemetry.reset(PREFIX)
        model, optimizer = _build(True, False)
        assert [getattr(o, ATTR, None) for o in _subs(optimizer)] == [None]
        assert _train(model, optimizer, 2) == want_losses
        assert telemetry.get(PREFIX + "steps") == 0
        assert any("stay in place" in n for n in ctx.notes), ctx.notes
        assert "stay in place" in SwapOptimizerFeature().path(ctx)
    for a, b in zip(_bits(model), want_params):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("argv, message", [
    (["--swap-optimizer-mode", "whole"], "--swap-optimizer-mode is given without --swap-optimizer"),
    (["--swap-optimizer", "--swap-optimizer-mode", "full"], "--swap-optimizer-mode 'full': give hidden .* or whole"),
])
def test_a_bad_sizing_mode_is_one_clear_error(npuspeed_runtime, argv, message):
    from feature_ctx import ctx_for
    from npuspeed.features.base import FeatureError
    from npuspeed.features.swap_optimizer import SwapOptimizerFeature

    ctx = ctx_for(argv)
    assert SwapOptimizerFeature().enabled(ctx.args)
    with pytest.raises(FeatureError, match=message):
        SwapOptimizerFeature().validate(ctx)


def test_a_bad_mode_value_is_refused(monkeypatch):
    from npuspeed.features.base import FeatureError
    from npuspeed.features.swap_optimizer import moves

    monkeypatch.setenv(ENV, "always")
    with pytest.raises(FeatureError, match=ENV):
        moves(object())


def test_states_and_masters_live_on_the_host_between_steps(megatron_mp, with_features):
    with with_features(["--swap-optimizer", *CHUNK]):
        model, optimizer = _build(True, False)
        (swap,) = _swaps(optimizer)
        inner = swap.inner
        masters = [p for g in _subs(optimizer)[0].fp32_from_float16_groups for p in g]
        assert masters and all(p.untyped_storage().nbytes() == 0 for p in masters)  # from the start
        _train(model, optimizer, 2)
        states = [v for s in inner.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
        assert len(states) == 2 * len(masters)
        assert all(t.untyped_storage().nbytes() == 0 for t in states + masters)
        assert swap.resident_bytes() == 0
        expect = sum(t.numel() * t.element_size() for t in states + masters)
        assert swap.host_bytes() == expect
        # the host copies hold the values: a state dict brings them back and they are real
        sd = optimizer.state_dict()
        assert swap.resident_bytes() == expect
        assert all(t.untyped_storage().nbytes() > 0 for t in states + masters)
        exp_avg_sq = [s["exp_avg_sq"] for s in sd["optimizer"]["state"].values()]
        assert all(torch.all(t >= 0) for t in exp_avg_sq) and any(torch.any(t > 0) for t in exp_avg_sq)
        for p in masters:  # masters are what the bf16 weights were rounded from
            key = (id(p), "param")
            assert torch.equal(swap.host[key], p.detach())


def test_chunks_are_pipelined_and_bytes_balance(megatron_mp, with_features):
    with with_features(["--swap-optimizer", *CHUNK]):
        model, optimizer = _build(True, False)
        (swap,) = _swaps(optimizer)
        _train(model, optimizer, 1)  # the first step creates the states on the device
        before = telemetry.snapshot(PREFIX)
        _train(model, optimizer, 1, start=1)
        step = {k[len(PREFIX):]: v for k, v in telemetry.since(before, PREFIX).items()}
        n = swap.chunk_count
        assert n >= 4
        assert step["chunks_in"] == step["chunks_out"] == n
        assert step["bytes_in"] == step["bytes_out"] == swap.host_bytes()
        order = swap.order
        pos = {event: i for i, event in enumerate(order)}
        for k in range(n):
            assert pos[("in", k)] < pos[("update", k)] < pos[("out", k)]
            if k + 1 < n:  # k+1 is on its way in before k is updated; k goes out before k+1 is
                assert pos[("in", k + 1)] < pos[("update", k)]
                assert pos[("out", k)] < pos[("update", k + 1)]
            if k + 2 < n:  # a bounded window: k+2 comes in only after k was updated
                assert pos[("update", k)] < pos[("in", k + 2)]
        assert telemetry.get(PREFIX + "copies_skipped") >= 2  # Megatron's full main->model copy


def test_state_dict_round_trip_resumes_bitwise(megatron_mp, with_features):
    """Save with the flag after 2 steps, load into a fresh optimizer with and without the flag,
    and into one with the flag from a plain save: the next 2 losses are the uninterrupted run's."""
    want, _ = _plain(True, False, 4)
    model, optimizer = _build(True, False)
    _train(model, optimizer, 2)
    plain_sd = (model.state_dict(), optimizer.state_dict())
    with with_features(["--swap-optimizer", *CHUNK]):
        model, optimizer = _build(True, False)
        _train(model, optimizer, 2)
        swap_sd = (model.state_dict(), optimizer.state_dict())
        import copy

        swap_sd = copy.deepcopy(swap_sd)
        for saved in (swap_sd, plain_sd):
            model, optimizer = _build(True, False)
            model.load_state_dict(saved[0])
            optimizer.load_state_dict(copy.deepcopy(saved[1]))
            assert _train(model, optimizer, 2, start=2) == want[2:]
            (swap,) = _swaps(optimizer)
            assert swap.resident_bytes() == 0
    model, optimizer = _build(True, False)
    model.load_state_dict(swap_sd[0])
    optimizer.load_state_dict(copy.deepcopy(swap_sd[1]))
    assert _train(model, optimizer, 2, start=2) == want[2:]


class _Stream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))


class _Event:
    count = 0

    def __init__(self, log):
        _Event.count += 1
        self.log, self.id = log, _Event.count

    def record(self, stream):
        self.log.append(("record", self.id, stream.name))

    def wait(self, stream):
        self.log.append(("wait_event", self.id, stream.name))


class _RecordingAccelerator:
    """Streams and events that log what the swap asks of them (the CPU backend's are no-ops):
    the device path's ordering, checked without a device."""

    name = "recording"

    def __init__(self):
        import contextlib

        self.log, self.streams = [], 0
        self.compute = _Stream(self.log, "compute")
        self.current = self.compute
        self._ctx = contextlib.contextmanager(self._enter)

    def Stream(self):
        self.streams += 1
        return _Stream(self.log, ("in", "out")[self.streams - 1])

    def Event(self):
        return _Event(self.log)

    def current_stream(self):
        return self.current

    def _enter(self, stream):
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def stream(self, stream):
        return self._ctx(stream)

    def pinned_empty(self, nbytes):
        self.log.append(("pinned", nbytes))
        return torch.empty(nbytes, dtype=torch.uint8)

    def record_stream(self, tensor, stream):
        self.log.append(("record_stream", stream.name, tensor.untyped_storage().nbytes()))


def test_stream_protocol_of_the_device_path_and_bitwise_adam():
    """On the device path: chunk k's update waits for its copy-in event on the compute stream;
    its copy out runs on the out stream after that stream waited for the compute stream, and the
    allocator is told (record_stream) while the storage is still there; the in stream waits for
    the out stream before the step's first copy in (the host buffers it reads). The swapped
    AdamW (no Megatron) is bitwise torch's own."""
    from npuspeed.features.swap_optimizer.swapper import OptimizerSwap

    torch.manual_seed(0)
    shapes = [(64, 32), (32,), (128, 16), (16,), (48, 48)]
    plain = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    swapped = [torch.nn.Parameter(p.detach().clone()) for p in plain]
    ref = torch.optim.AdamW(plain, lr=1e-2, weight_decay=0.1)
    inner = torch.optim.AdamW(swapped, lr=1e-2, weight_decay=0.1)
    acc = _RecordingAccelerator()
    swap = OptimizerSwap(acc, inner, masters=[], chunk_bytes=16 * 1024)

    def update(closure=None, step=swap._orig_step):
        acc.log.append(("update", acc.current.name))
        return step(closure)

    swap._orig_step = update
    for i in range(3):
        for a, b in zip(plain, swapped):
            a.grad = torch.randn(a.shape, generator=torch.Generator().manual_seed(i))
            b.grad = a.grad.clone()
        ref.step()
        acc.log.clear()
        swap.in_step = True
        swap.step()
        swap.in_step = False
        assert all(t.untyped_storage().nbytes() == 0 for s in inner.state.values()
                   for k, t in s.items() if k != "step")
        for a, b in zip(plain, swapped):
            assert torch.equal(a, b)
        log = acc.log
        assert swap.chunk_count >= 3
        assert all(e[1] == "compute" for e in log if e[0] == "update")
        updates = [j for j, e in enumerate(log) if e[0] == "update"]
        for j in updates:  # the compute stream waited for an in event just before the update
            assert log[j - 1][0] == "wait_event" and log[j - 1][2] == "compute"
        recs = {e[1]: e[2] for e in log if e[0] == "record"}
        assert all(recs[log[j - 1][1]] == "in" for j in updates)
        outs = [j for j, e in enumerate(log) if e == ("wait_stream", "out", "compute")]
        assert len(outs) == len(updates) and all(u < o for u, o in zip(updates, outs))
        rs = [e for e in log if e[0] == "record_stream"]
        assert rs and all(e[1] == "out" and e[2] > 0 for e in rs)
        if i > 0:  # the step's first copy in waits for the previous step's copies out
            assert log.index(("wait_stream", "in", "out")) < updates[0]
        assert sum(1 for e in log if e[0] == "pinned") == (2 * len(shapes) if i == 0 else 0)


@pytest.mark.parametrize("config, needle", [
    ({"use_precision_aware_optimizer": True}, "--swap-optimizer with --use-precision-aware-optimizer"),
    ({"optimizer_cpu_offload": True}, "--swap-optimizer with --optimizer-cpu-offload: .* pick one"),
    ({"reuse_grad_buf_for_mxfp8_param_ag": True}, "--swap-optimizer with fp8 parameters"),
])
def test_optimizer_configs_set_in_code_that_cannot_compose_are_refused(config, needle):
    """A script may set Megatron's optimizer config in code, past the flag checks: the optimizer
    the swap would attach to refuses it with the same one-line errors."""
    from types import SimpleNamespace

    from npuspeed.features.base import FeatureError
    from npuspeed.features.swap_optimizer import patches

    with pytest.raises(FeatureError, match=needle):
        patches._check(SimpleNamespace(config=SimpleNamespace(**config)))
    patches._check(SimpleNamespace(config=SimpleNamespace()))


@pytest.mark.parametrize("mode", ["hidden", "whole"])
def test_sizing_keeps_what_would_not_hide_resident_bitwise(megatron_mp, with_features, mode):
    """A fast fake link that overlaps compute: after the measured step the hidden sizing keeps
    the first chunk resident (nothing before it to hide its copy in behind) and moves the
    others; whole moves every chunk and states its cost. Losses and parameters stay bitwise
    those of the plain optimizer, and after each sized step only the resident chunk holds
    device bytes."""
    from npuspeed.accelerator import host_link
    from npuspeed.features.swap_optimizer import sizer
    from npuspeed.offload import decisions

    steps = sizer.SKIP + sizer.MEASURE + 2
    want_losses, want_params = _plain(True, False, steps)
    decisions.reset()
    with host_link.fake(1e9), with_features(  # a 4 KiB chunk: ~4 us each way, under an update here
        ["--swap-optimizer", *CHUNK, "--swap-optimizer-mode", mode]):
        model, optimizer = _build(True, False)
        (swap,) = _swaps(optimizer)
        got = _train(model, optimizer, steps)
        chunks = swap.chunks()
        on_device = [sum(t.untyped_storage().nbytes() for p in c for _, t in swap.tensors(p)) for c in chunks]
    assert got == want_losses
    for a, b in zip(_bits(model), want_params):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    (made,) = decisions.all_dicts()
    assert made["mode"] == mode and made["units"] == len(chunks) >= 4
    if mode == "hidden":
        assert swap.resident == {0} and list(made["kept"]) == ["chunk0"]
        assert on_device[0] > 0 and not any(on_device[1:])
        assert made["bytes_moved"] == made["bytes_total"] - swap.chunk_nbytes(chunks[0])
    else:
        assert swap.resident == set() and not any(on_device) and "cost: about" in made["line"]
    assert made["exposed_ms_measured"] is not None


def test_on_the_cpu_the_hidden_sizing_keeps_every_chunk_resident(megatron_mp, with_features):
    """The real CPU link copies in order with compute: after the measured step nothing moves,
    every chunk stays resident, the losses are the plain ones, and the decision says why."""
    from npuspeed.features.swap_optimizer import sizer
    from npuspeed.offload import decisions

    steps = sizer.SKIP + sizer.MEASURE + 1
    want_losses, _ = _plain(True, False, steps)
    decisions.reset()
    with with_features(["--swap-optimizer", *CHUNK]):
        model, optimizer = _build(True, False)
        (swap,) = _swaps(optimizer)
        assert _train(model, optimizer, steps) == want_losses
        n = len(swap.chunks())  # (named first: an assertion's repr of freed tensors would crash)
        assert swap.resident == set(range(n)) and swap.host_bytes() == 0
    (made,) = decisions.all_dicts()
    assert made["moved"] == [] and all("in order" in why for why in made["kept"].values())
