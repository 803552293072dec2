"""--moe-grouped-gemm's NPU backend keeps torch_npu's npu_grouped_matmul contract: with
group_list_type=1 (sizes per group) its documentation says "当group_list_type为1时, group_list必须为
非负数列, 且长度不能为1" (non-negative, and never of length 1). One local expert (EP = number of
experts) is one group: it must never reach the op that way, whatever chose the backend (the
measured choice, NPUSPEED_FUSED_OP_PATH, --deterministic-mode all end in the same call).

The NPU is simulated: a fake torch_npu records each call and whether it keeps the rule, and
computes the grouped product on the CPU."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from npuspeed import telemetry
from npuspeed.features.moe_grouped_gemm import grouped_gemm
from npuspeed.features.moe_grouped_gemm.grouped_gemm import grouped_mm
from npuspeed.ops import fused_choice


def _fake_torch_npu(calls):
    def npu_grouped_matmul(x, weight, *, group_list=None, split_item=0, group_type=None, group_list_type=0,
                           **_kwargs):
        sizes = group_list.tolist()
        ok = group_list_type == 1 and len(sizes) != 1 and min(sizes) >= 0 and len(sizes) == weight[0].shape[0]
        calls.append("ok" if ok else f"breaks the contract: group_list {sizes}, type {group_list_type}")
        (x,), (w,) = x, weight
        return [torch.cat([xs @ wg for xs, wg in zip(x.split(sizes), w)])]

    return types.SimpleNamespace(npu_grouped_matmul=npu_grouped_matmul)


@pytest.mark.parametrize("mode", ["forced", "deterministic"])
@pytest.mark.parametrize("counts", [[7], [3, 0, 4]])
def test_npu_grouped_matmul_never_gets_a_length_one_group_list(monkeypatch, counts, mode):
    calls = []
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu(calls))
    monkeypatch.setattr(grouped_gemm, "backend_for", lambda x: "npu")  # CPU tensors stand in for the NPU's
    monkeypatch.setattr(fused_choice, "CHOOSER", fused_choice.Chooser(repeats=1, budget_s=0.0))
    if mode == "forced":
        monkeypatch.setenv(fused_choice.FORCE_ENV, "npuspeed")
    else:
        monkeypatch.delenv(fused_choice.FORCE_ENV, raising=False)
    telemetry.reset("moe.grouped_gemm.")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), 8, generator=gen, requires_grad=True)
    w = torch.randn(len(counts), 8, 5, generator=gen, requires_grad=True)
    torch.use_deterministic_algorithms(mode == "deterministic")
    try:
        out = grouped_mm(x, w, counts)
    finally:
        torch.use_deterministic_algorithms(False)
    assert telemetry.snapshot("moe.grouped_gemm.") == {"moe.grouped_gemm.npu": 1}
    out.backward(torch.arange(out.numel(), dtype=out.dtype).view_as(out))
    got = (out, x.grad, w.grad)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = grouped_mm(x2, w2, counts, backend="loop")
    ref.backward(torch.arange(ref.numel(), dtype=ref.dtype).view_as(ref))
    for a, b in zip(got, (ref, x2.grad, w2.grad)):
        torch.testing.assert_close(a, b)
    # forward and input gradient; under --deterministic-mode also the forward that checks the
    # unmeasured kernel against Megatron's path once (fused_choice.Chooser._checked)
    assert calls == ([] if len(counts) == 1 else ["ok"] * (3 if mode == "deterministic" else 2))
