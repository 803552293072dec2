"""The device feature: megatron.core's CUDA assumptions answered by the CPU accelerator."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from launch import free_port
from tiers import pinned

from npuspeed.features.cuda_mapping.redirect import CudaToDevice, on_device
from npuspeed.patching import registry

CPU = torch.device("cpu")


@pytest.fixture
def acc(npuspeed_runtime):
    acc = npuspeed_runtime.accelerator
    if acc.name != "cpu":
        pytest.skip("checks the CPU backend's device layer")
    device_state, host_state = acc.get_rng_state(), torch.get_rng_state()
    yield acc
    acc.set_rng_state(device_state)
    torch.set_rng_state(host_state)


def _seeded(seed: int) -> torch.Tensor:
    return torch.Generator().manual_seed(seed).get_state()


def _draws(seed: int, n: int) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed))


def test_current_device_is_the_accelerator_device(acc):
    assert torch.cuda.current_device() == CPU
    assert torch.zeros(2, device=torch.cuda.current_device()).device == CPU
    assert torch.cuda.is_available() and torch.cuda.device_count() >= 1
    torch.cuda.synchronize()
    torch.cuda.set_device(0)
    assert torch.cuda.current_device.__npuspeed_patch__ == "torch.cuda.current_device"


def test_cuda_rng_goes_to_the_device_state(acc):
    host_before = torch.get_rng_state()
    torch.cuda.manual_seed(1234)
    assert torch.equal(torch.cuda.get_rng_state(), _seeded(1234))
    assert torch.equal(acc.get_rng_state(), _seeded(1234))
    assert torch.equal(torch.get_rng_state(), host_before)  # the host generator did not move
    torch.cuda.set_rng_state(_seeded(99))
    assert torch.equal(torch.cuda.get_rng_state(), _seeded(99))
    with acc.device_rng_scope():
        x = torch.rand(3)
    assert torch.equal(x, _draws(99, 3))
    assert torch.equal(torch.get_rng_state(), host_before)


def _tracker(**seeds):
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    tracker = CudaRNGStatesTracker()
    for name, seed in seeds.items():
        tracker.add(name, seed)
    return tracker


@pytest.mark.parametrize("in_scope", [False, True], ids=["outside-schedule", "inside-schedule"])
def test_tracker_fork_draws_from_tracked_state(acc, caplog, in_scope):
    """Dropout in a forked region draws from the tracked state, inside a schedule's
    device-RNG scope or not, and leaves the outer device and host states as they were."""
    assert registry.is_applied("megatron.core.tensor_parallel.random.CudaRNGStatesTracker.fork")
    tracker = _tracker(a=101, b=202)
    assert torch.equal(tracker.get_states()["a"], _seeded(101))
    acc.set_rng_state(_seeded(7))
    host_before = torch.get_rng_state()
    scope = acc.device_rng_scope() if in_scope else torch.random.fork_rng(devices=[], enabled=False)
    caplog.set_level(logging.WARNING)
    with scope:
        outer = acc.get_rng_state()
        with tracker.fork("a"):
            a1 = torch.rand(2)
            with tracker.fork("b"):
                b1 = torch.rand(2)
            a2 = torch.rand(2)
        assert torch.equal(acc.get_rng_state(), outer)
        with tracker.fork("a"):
            a3 = torch.rand(2)
    assert torch.equal(torch.cat([a1, a2, a3]), _draws(101, 6))
    assert torch.equal(b1, _draws(202, 2))
    assert torch.equal(acc.get_rng_state(), _seeded(7))
    if not in_scope:
        assert torch.equal(torch.get_rng_state(), host_before)
    assert "CPU RNG state changed" not in caplog.text
    with pytest.raises(Exception, match="not added"):
        with tracker.fork("missing"):
            pass


def test_redirect_maps_cuda_onto_the_device():
    x = torch.ones(3)
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")  # a CPU build cannot
    assert x.type() == "torch.FloatTensor"
    with CudaToDevice(CPU):
        assert torch.zeros(2, device="cuda").device == CPU
        assert torch.ones(2, device=torch.device("cuda", 0)).device == CPU
        assert torch.tensor([1.0], device="cuda:0").device == CPU
        assert x.cuda().device == CPU
        assert x.to("cuda").device == CPU and x.to(device="cuda:0").device == CPU
        assert x.new_zeros(2, device="cuda").device == CPU
        assert x.type() == "torch.cuda.FloatTensor"
        assert x.bfloat16().type() == "torch.cuda.BFloat16Tensor"
        assert x.half().type() == "torch.cuda.HalfTensor"
        assert x.type(torch.float64).dtype == torch.float64  # a conversion, not a query
        # 0.12-0.13 get_batch_on_this_cp_rank: a pinned host index, then .cuda()
        index = torch.tensor([0, 3], device="cpu", pin_memory=True).cuda(non_blocking=True)
        assert index.device == CPU and index.tolist() == [0, 3]
    assert x.type() == "torch.FloatTensor"

    @on_device(lambda: CPU)
    def make():
        return torch.empty(2, device="cuda").cuda()

    assert make().device == CPU


def test_patched_megatron_function_runs_on_cpu(acc):
    from megatron.core.transformer import utils

    target = "megatron.core.transformer.utils.get_default_causal_mask"
    assert registry.is_applied(target)
    mask = utils.get_default_causal_mask(4)
    assert mask.device == CPU and mask.dtype == torch.bool
    assert torch.equal(mask, torch.ones(4, 4).triu(1).bool())


def _config(**kw):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                             use_cpu_initialization=True, **kw)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_wrapped_torch_norm_with_sequence_parallel(acc, normalization):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = _config(tensor_model_parallel_size=2, sequence_parallel=True, normalization=normalization)
    norm = WrappedTorchNorm(config, 8)
    assert isinstance(norm, torch.nn.LayerNorm if normalization == "LayerNorm" else torch.nn.RMSNorm)
    params = list(norm.parameters())
    assert params and all(getattr(p, "sequence_parallel", False) for p in params)
    assert config.sequence_parallel is True  # the caller's config is untouched
    plain = WrappedTorchNorm(_config(normalization=normalization), 8)
    assert not any(hasattr(p, "sequence_parallel") for p in plain.parameters())
    upstream = registry.original("megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__")
    with pytest.raises(AssertionError, match="sequence parallel"):
        upstream(WrappedTorchNorm, config, 8)


def test_maybe_move_tensor_to_cpu(acc):
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    got = moe_utils.maybe_move_tensor_to_cpu(torch.tensor([3, 1, 2]), as_numpy=True)
    assert isinstance(got, np.ndarray) and got.tolist() == [3, 1, 2]
    t = torch.tensor([1.0])
    assert moe_utils.maybe_move_tensor_to_cpu(t).device == CPU
    assert moe_utils.maybe_move_tensor_to_cpu(None) is None
    # the dispatcher's `from moe_utils import maybe_move_tensor_to_cpu` copy is the patched one
    assert token_dispatcher.maybe_move_tensor_to_cpu is moe_utils.maybe_move_tensor_to_cpu
    upstream = registry.original("megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu")
    assert not isinstance(upstream(torch.tensor([1]), as_numpy=True), np.ndarray)  # why the patch exists


_DIST_PROBE = r"""
import json, torch
import npuspeed.megatron_adaptor
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import random as mrandom
from npuspeed.accelerator import get_accelerator

dist.init_process_group("nccl", rank=0, world_size=1)
backend = dist.get_backend()
parallel_state.initialize_model_parallel(1, 1)
sub = dist.new_group([0], backend="nccl")
mrandom.model_parallel_cuda_manual_seed(1234)
tracker = mrandom.get_cuda_rng_tracker()
states = tracker.get_states()
seeded = lambda s: torch.Generator().manual_seed(s).get_state()
acc = get_accelerator()
with acc.device_rng_scope():
    with tracker.fork():
        drop = torch.nn.functional.dropout(torch.ones(64), p=0.5)
with torch.random.fork_rng(devices=[]):
    torch.set_rng_state(seeded(1234 + 2718))
    expect = torch.nn.functional.dropout(torch.ones(64), p=0.5)
x = torch.ones(4)
dist.all_reduce(x, group=sub)
print(json.dumps({
    "backend": backend,
    "sub_backend": dist.get_backend(sub),
    "names": sorted(states),
    "tp_state_ok": bool(torch.equal(states[mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME], seeded(1234 + 2718))),
    "dp_state_ok": bool(torch.equal(states[mrandom._DATA_PARALLEL_RNG_TRACKER_NAME], seeded(1234))),
    "device_state_ok": bool(torch.equal(acc.get_rng_state(), seeded(1234))),
    "dropout_kept": int((drop != 0).sum()),
    "dropout_from_tp_state": bool(torch.equal(drop, expect)),
    "allreduce": x.tolist(),
}))
parallel_state.destroy_model_parallel()
dist.destroy_process_group()
"""


def test_nccl_maps_to_gloo_and_megatron_seeds_in_a_one_rank_group():
    env = pinned({k: v for k, v in os.environ.items() if k != "NPUSPEED_ARGS"})  # the CPU backend
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0")
    proc = subprocess.run([sys.executable, "-c", _DIST_PROBE], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["backend"] == "gloo" and result["sub_backend"] == "gloo"
    assert "distributed backend 'nccl' requested; using 'gloo'" in proc.stderr
    assert result["tp_state_ok"] and result["dp_state_ok"] and result["device_state_ok"]
    assert {"model-parallel-rng", "data-parallel-rng"} <= set(result["names"])
    assert 0 < result["dropout_kept"] < 64 and result["dropout_from_tp_state"]
    assert result["allreduce"] == [1.0] * 4
    assert "CPU RNG state changed" not in proc.stderr


COMPILE_UNDER_SHIM = """
import torch
import npuspeed.megatron_adaptor
from torch.utils import _triton
assert torch.cuda.is_available()  # the CPU shim's answer
probes = [getattr(_triton, n) for n in dir(_triton) if n.startswith("has_") and hasattr(getattr(_triton, n), "cache_info")]
print("CACHED", all(p.cache_info().currsize == 1 for p in probes), "TRITON", _triton.has_triton())
"""


def test_torch_probes_for_triton_are_answered_before_the_shim(tmp_path):
    """With triton installed (a CUDA build of torch on a CPU host, or the test extra), torch's
    cached probes would ask the shimmed torch.cuda for a device's properties inside dynamo and
    fail every torch.compile (Megatron's MoE router); the device feature asks them first."""
    proc = subprocess.run([sys.executable, "-c", COMPILE_UNDER_SHIM], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path, env=dict(os.environ, NPUSPEED_DEVICE="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CACHED True TRITON False" in proc.stdout
