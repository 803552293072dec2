"""--moe-alltoall-overlap-comm on 2 gloo ranks (EP2): a MoELayer through the chunked
dispatch/experts/combine pipeline against Megatron's own forward with the same weights.

One spawn runs every case (Megatron's import is the slow part); each rank writes the max
|difference| of output, input gradient and every parameter gradient, and the counters of the
chunked path. Cases: SequentialMLP and GroupedMLP experts (the latter with the fused
permute), 2 and 3 chunks, shared experts computed during the first chunk, a router that
sends no token to one expert, and an expert-parallel layout with one local expert.
"""
from __future__ import annotations

import functools
import json
import os

import pytest
import torch
import torch.multiprocessing as mp
from launch import free_port

WORLD = 2
CASES = {
    "sequential-n2": dict(grouped=False, chunks=2, experts=4, shared=False, starve=None),
    "sequential-n3-shared": dict(grouped=False, chunks=3, experts=4, shared=True, starve=None),
    "grouped-n2-starved-expert": dict(grouped=True, chunks=2, experts=4, shared=False, starve=1),
    # one expert per rank, top-1, so that rank 0's expert can get no token at all
    "grouped-n2-one-local-expert-shared": dict(grouped=True, chunks=2, experts=2, shared=True, starve=0, topk=1),
}


@pytest.fixture(scope="module", autouse=True)
def _force_npuspeed_kernels():
    """These runs test npuspeed's kernels (their counters are asserted): force them instead of the
    per-shape measurement, which may pick Megatron's path on a tiny model (tests/unit/test_*choice*)."""
    with pytest.MonkeyPatch.context() as mp_:
        mp_.setenv("NPUSPEED_FUSED_OP_PATH", "npuspeed")
        yield


def _layer(c: dict):
    import torch.nn.functional as F
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    config = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=4, ffn_hidden_size=24, num_moe_experts=c["experts"],
        moe_router_topk=c.get("topk", 2), moe_router_pre_softmax=c.get("topk", 2) == 1, moe_ffn_hidden_size=24,
        expert_model_parallel_size=WORLD,
        moe_token_dispatcher_type="alltoall", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        bias_activation_fusion=False, use_cpu_initialization=True, moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=c["grouped"], moe_shared_expert_intermediate_size=32 if c["shared"] else None)
    spec = get_moe_module_spec(use_te=False, num_experts=c["experts"], moe_grouped_gemm=c["grouped"])
    if isinstance(spec, functools.partial):  # 0.19: a builder (MlpBuilder), not a ModuleSpec
        return spec(config=config)
    return build_module(spec, config=config)


def _starve(layer, expert: int) -> None:
    """The router never picks `expert`: a row that picked it takes the lowest expert it had not
    picked instead, with the same probability, so every row still selects top-k experts (the
    dispatcher sizes its buffers as tokens x top-k; since 0.17 Megatron's unfused permute honours
    that size, so a row left with fewer would not be a routing Megatron can make)."""
    route = layer.route

    def starved(hidden_states, padding_mask=None):
        probs, routing_map = route(hidden_states, padding_mask)
        routing_map, probs = routing_map.clone(), probs.clone()
        for row in routing_map[:, expert].nonzero().flatten().tolist():
            spare = next(e for e in range(routing_map.shape[1]) if e != expert and not routing_map[row, e])
            routing_map[row, spare], probs[row, spare] = True, probs[row, expert]
        routing_map[:, expert] = False
        return probs * routing_map, routing_map

    layer.route = starved


def _run(layer, forward, x, g):
    for p in layer.parameters():
        p.grad = None
    inp = x.clone().requires_grad_(True)
    out, _ = forward(layer, inp)
    out.backward(g)
    return out.detach(), inp.grad, {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


def _rank(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from npuspeed import runtime, telemetry

    runtime.initialize(["--moe-grouped-gemm", "--use-fused-moe-token-permute-and-unpermute"])
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from npuspeed.features.moe_alltoall_overlap.overlap import forward_wrapper

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=WORLD)
    results = {}
    for name, c in CASES.items():
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        torch.manual_seed(7)
        layer = _layer(c)
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0, 0.3)  # routing that spreads the tokens
        if c["starve"] is not None:
            _starve(layer, c["starve"])
        gen = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(13, 3, 16, generator=gen)  # 39 tokens: chunks do not divide the segments
        g = torch.randn(13, 3, 16, generator=gen)
        ref = _run(layer, MoELayer.forward, x, g)
        before = telemetry.snapshot("moe.")
        got = _run(layer, forward_wrapper(c["chunks"], print)(MoELayer.forward), x, g)
        ran = telemetry.since(before, "moe.")
        diffs = {"output": (ref[0] - got[0]).abs().max().item(), "input_grad": (ref[1] - got[1]).abs().max().item()}
        for pname in ref[2]:
            diffs[pname] = (ref[2][pname] - got[2][pname]).abs().max().item()
        results[name] = {"diffs": diffs, "counters": ran, "params": sorted(got[2])}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_pipeline")
    mp.spawn(_rank, args=(free_port(), str(out)), nprocs=WORLD, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_pipeline_matches_megatron(results, case):
    c = CASES[case]
    for rank_results in results:
        r = rank_results[case]
        assert all(v <= 1e-5 for v in r["diffs"].values()), r["diffs"]
        assert any("experts" in p for p in r["params"]) and any("router" in p for p in r["params"])
        if c["shared"]:
            assert any("shared_experts" in p for p in r["params"])
            assert r["counters"].get("moe.a2a_overlap.shared_experts_overlapped") == 1
        n = c["chunks"]
        assert r["counters"]["moe.a2a_overlap.dispatch_chunks"] == n == r["counters"]["moe.a2a_overlap.combine_chunks"]
        # every chunk went out and came back, forward and backward, tokens and probabilities
        for label in ("dispatch", "dispatch_probs", "combine"):
            assert r["counters"][f"moe.a2a.{label}"] == n and r["counters"][f"moe.a2a.{label}.backward"] == n, r
        if c["grouped"]:
            assert r["counters"].get("moe.grouped_gemm.torch", 0) == 2 * n  # fc1 and fc2 per chunk
