"""--use-ascend-mc2's engine against each release's MC2 kernels (schema, meta shapes, documented
limits; emulated on two gloo ranks in threads): the fused calls bind and compute what the
unfused collective + matmul does. The layers' MC2 path runs in tests/distributed/test_coc_layers.py."""
from __future__ import annotations

import types

import pytest
import torch

from npu_contract import emulate_comm, gloo_threads, standin, wheel


@pytest.mark.parametrize("release", wheel.RELEASES)
def test_mc2_engine_on_the_release(release):
    from npuspeed.features.coc_overlap.mc2 import Mc2Engine

    module, rel = standin.module(release), standin.release(release)
    gen = torch.Generator().manual_seed(11)
    xs = [torch.randn(4, 256, generator=gen).bfloat16() for _ in range(2)]
    w_t = torch.randn(256, 8, generator=gen).bfloat16()

    def body(rank, group):
        chunked = types.SimpleNamespace(comm=types.SimpleNamespace(size=2))  # never reached: MC2 takes these
        engine = Mc2Engine(module, chunked, group, acc=None)
        engine._hcom = emulate_comm.register_group(group)
        out, gathered = engine.ag_mm(xs[rank], w_t, keep_gathered=True)
        rs = engine.mm_rs(xs[rank], w_t).wait()
        ar = engine.mm_ar(xs[rank], w_t).wait()
        return out, gathered, rs, ar

    before = dict(rel.calls)
    results = gloo_threads.two_ranks(body)
    full = torch.cat(xs)
    total = sum(x.float() @ w_t.float() for x in xs)
    for rank, (out, gathered, rs, ar) in results.items():
        assert torch.equal(gathered, full)
        torch.testing.assert_close(out, (full.float() @ w_t.float()).bfloat16())
        torch.testing.assert_close(rs, total[rank * 2:(rank + 1) * 2].bfloat16())
        torch.testing.assert_close(ar, total.bfloat16())
    for op in ("npu_all_gather_base_mm", "npu_mm_reduce_scatter_base", "npu_mm_all_reduce_base"):
        assert rel.calls.get(op, 0) - before.get(op, 0) == 2, op
