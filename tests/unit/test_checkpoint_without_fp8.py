"""megatron.core's CheckpointWithoutOutput() defaults to FP8 (`fp8 is not None`) and then needs
Transformer Engine: without TE the device feature clears the flag (megatron_compat.py)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from npuspeed.features.device.megatron_compat import checkpoint_without_fp8

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None,
                                reason="with Transformer Engine upstream's FP8 path is real")


def _norm_checkpoint_runs(cls) -> torch.Tensor:
    x = torch.randn(4, 8, requires_grad=True)
    ckpt = cls()  # as transformer_layer.py builds it for --recompute-modules layernorm
    out = ckpt.checkpoint(lambda t: torch.nn.functional.layer_norm(t, (8,)), x)
    y = out * 2
    ckpt.discard_output_and_register_recompute(y)
    y.sum().backward()
    return x.grad


def test_upstream_default_needs_te_and_the_fix_runs(monkeypatch):
    from megatron.core.tensor_parallel import random as mrandom

    # the RNG bookkeeping around the checkpoint, kept on the host (no device shim in this test)
    monkeypatch.setattr(mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    monkeypatch.setattr(mrandom, "_set_cuda_rng_state", lambda *a, **k: None)
    from npuspeed.patching import registry

    # upstream's own __init__, also where an earlier test of the session left the fix installed
    target = "megatron.core.tensor_parallel.random.CheckpointWithoutOutput.__init__"
    init = registry.original(target) if registry.is_applied(target) else mrandom.CheckpointWithoutOutput.__init__
    Upstream = type("Upstream", (mrandom.CheckpointWithoutOutput,), {"__init__": init})
    assert Upstream().fp8 is True  # the bug: fp8=False reads as FP8 on
    with pytest.raises(NameError, match="FP8GlobalStateManager"):
        _norm_checkpoint_runs(Upstream)
    Fixed = type("Fixed", (Upstream,), {"__init__": checkpoint_without_fp8(Upstream.__init__)})
    grad = _norm_checkpoint_runs(Fixed)
    x = torch.randn(4, 8, requires_grad=True)
    torch.nn.functional.layer_norm(x, (8,)).mul(2).sum().backward()
    assert grad is not None and grad.shape == x.grad.shape and torch.isfinite(grad).all()
