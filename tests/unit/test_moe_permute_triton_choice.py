"""--use-fused-moe-token-permute-and-unpermute offers npuspeed's Triton permute pair where Triton
runs, measures it with the others, and runs it when it wins or is forced: Megatron's results
(rows, probabilities, gradients of tokens and probabilities), counted `ops.moe_(un)permute.triton`.

A Triton-capable device is simulated on CPU: the script runs in a fresh process with
TRITON_INTERPRET=1 (set before triton is imported) and lets CPU tensors take the Triton kernels
(`fused_choice.TRITON_ON_HOST`); on a real CPU run they are not a candidate (last test).
"""
from __future__ import annotations

import pytest
import torch

from script_run import run_triton_script


_SCRIPT = r"""
import os, json, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
from megatron.core.transformer.moe import moe_utils
from npuspeed.features.moe_fused_permute import permute as feature
from npuspeed.ops import _dispatch, fused_choice
fused_choice.TRITON_ON_HOST = True  # the interpreter runs the kernels on CPU tensors

class Times:  # injected timings: triton fastest, so the rule's decision is deterministic
    def __call__(self, name, run):
        run()
        return {"megatron": 3.0, "cpp": 2.0, "triton": 1.0}[name]

permute = feature.wrappers()[0](moe_utils.permute)
unpermute = feature.wrappers()[1](moe_utils.unpermute)
gen = torch.Generator().manual_seed(0)
tokens, experts, hidden = 12, 5, 24
scores = torch.rand(tokens, experts, generator=gen)
rmap = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, scores.topk(2, -1).indices, True)
rmap[3] = False  # a dropped token
probs0 = torch.where(rmap, scores, torch.zeros_like(scores))
x0 = torch.randn(tokens, hidden, generator=gen)

def round_trip(perm, unperm):
    x, p = x0.clone().requires_grad_(), probs0.clone().requires_grad_()
    out, out_probs, order = perm(x, rmap, probs=p, num_out_tokens=int(rmap.sum()))[:3]
    a = unperm(out * out_probs.unsqueeze(-1), order, x.shape, routing_map=rmap)  # probs applied by the caller
    b = unperm(out * 2, order, x.shape, probs=p, routing_map=rmap)  # probs applied by unpermute
    ((a * torch.arange(hidden)).sum() + (b ** 2).sum()).backward()
    return [out, out_probs, order, a, b, x.grad, p.grad]

ref = round_trip(moe_utils.permute, moe_utils.unpermute)
result = {}
for force in ("auto", "triton"):
    os.environ["NPUSPEED_FUSED_OP_PATH"] = force
    fused_choice.CHOOSER = fused_choice.Chooser(repeats=2, budget_s=0.0, trial=Times())
    _dispatch.reset_calls()
    got = round_trip(permute, unpermute)
    calls = {f"{op}.{impl}": n for (op, impl), n in _dispatch.calls().items()}
    same = [bool(torch.equal(g, r)) if i == 2 else bool(torch.allclose(g, r, rtol=1e-5, atol=1e-6))
            for i, (g, r) in enumerate(zip(got, ref))]
    (choice,) = fused_choice.choices()
    result[force] = {"same": same, "calls": calls, "impl": choice.impl, "measured": sorted(choice.ms)}
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def runs() -> dict:
    """Both modes (measured, forced) in one interpreter process (megatron's import is the cost)."""
    return run_triton_script(_SCRIPT)


def test_triton_pair_is_measured_wins_and_matches_megatron(runs):
    from npuspeed.ops._extension import has_op

    out = runs["auto"]
    assert out["same"] == [True] * 7, out  # rows, probs, indices, both unpermutes, grads of tokens and probs
    assert out["impl"] == "triton"
    assert out["measured"] == sorted(["megatron", "triton"] + (["cpp"] if has_op("moe_permute") else []))
    assert out["calls"] == {"moe_permute.triton": 1, "moe_unpermute.triton": 2}, out


def test_triton_pair_forced(runs):
    out = runs["triton"]
    assert out["same"] == [True] * 7 and out["impl"] == "triton" and out["measured"] == []
    assert out["calls"] == {"moe_permute.triton": 1, "moe_unpermute.triton": 2}, out


def test_triton_is_not_a_candidate_on_a_real_cpu_run():
    from npuspeed.features.moe_fused_permute import permute as feature

    assert not feature._triton_runs(torch.randn(4, 8), "cpp")


def test_report_names_the_triton_pair_where_triton_runs(monkeypatch):
    import types

    from npuspeed.features.moe_fused_permute.moe_fused_permute_feature import MoeFusedPermuteFeature
    from npuspeed.ops.triton import moe_permute as kernels

    args = types.SimpleNamespace(use_fused_moe_token_permute_and_unpermute=True)
    cuda = types.SimpleNamespace(args=args, accelerator=types.SimpleNamespace(name="cuda"))
    monkeypatch.setattr(kernels, "available", lambda: False)
    assert "no npuspeed kernel" in MoeFusedPermuteFeature().path(cuda)
    monkeypatch.setattr(kernels, "available", lambda: True)
    assert MoeFusedPermuteFeature().path(cuda).startswith("npuspeed Triton kernels (npuspeed.ops.triton.moe_permute")
    npu = types.SimpleNamespace(args=args, accelerator=types.SimpleNamespace(name="npu", torch_npu=object()))
    assert "this torch_npu has no npu_moe_token_permute_with_routing_map" in MoeFusedPermuteFeature().path(npu)


def test_prepare_says_once_when_megatrons_permute_runs_decided_from_state(monkeypatch):
    """Issue 49: `prepare` notes the fallback from `permute_kernel`'s answer (whether a kernel runs),
    not by searching the report's text; the note is the report's words for it."""
    import types

    from npuspeed.features.moe_fused_permute import moe_fused_permute_feature as module
    from npuspeed.ops.triton import moe_permute as kernels

    args = types.SimpleNamespace(use_fused_moe_token_permute_and_unpermute=True)
    notes = []
    cuda = types.SimpleNamespace(args=args, accelerator=types.SimpleNamespace(name="cuda"), note=notes.append,
                                 megatron=types.SimpleNamespace())
    monkeypatch.setattr(kernels, "available", lambda: False)
    assert not module.permute_kernel(cuda.accelerator).runs
    module.MoeFusedPermuteFeature().prepare(cuda)
    assert notes == [f"--use-fused-moe-token-permute-and-unpermute: {module.MoeFusedPermuteFeature().path(cuda)}"]
    monkeypatch.setattr(kernels, "available", lambda: True)
    notes.clear()
    module.MoeFusedPermuteFeature().prepare(cuda)
    assert module.permute_kernel(cuda.accelerator).runs and notes == []
