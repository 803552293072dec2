"""`npuspeed plan`'s command line: a training run's flags plus the world and the device.

Megatron's model, parallel and batch flags keep Megatron-LM's names (so a launch script's
argument list works as is, `--script FILE` reads one); npuspeed's feature flags are the
runtime's own parser's; flags neither knows are ignored, as a training run's launcher would
pass them through. Defaults are Megatron-LM's where a flag is optional there (dropout 0.1,
LayerNorm, learned absolute positions, tied embeddings, bias), the example's tokenizer
(258 byte-level ids) when no vocabulary is named.
"""
from __future__ import annotations

import argparse

from npuspeed.plan.spec import Batch, Layout, ModelSpec, RunSpec


class PlanInputError(ValueError):
    """A flag the planner cannot work with; the message names it and the fix."""


def _megatron(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and parallelism (Megatron-LM's flags)")
    add = g.add_argument
    add("--num-layers", type=int)
    add("--hidden-size", type=int)
    add("--ffn-hidden-size", type=int)
    add("--num-attention-heads", type=int)
    add("--group-query-attention", action="store_true")
    add("--num-query-groups", type=int)
    add("--kv-channels", type=int)
    add("--seq-length", type=int)
    add("--max-position-embeddings", type=int)
    add("--normalization", default="LayerNorm")
    add("--swiglu", action="store_true")
    add("--position-embedding-type", default="learned_absolute")
    add("--untie-embeddings-and-output-weights", action="store_true")
    add("--disable-bias-linear", action="store_true")
    add("--hidden-dropout", type=float, default=0.1)
    add("--attention-dropout", type=float, default=0.1)
    add("--make-vocab-size-divisible-by", type=int, default=128)
    add("--vocab-size", type=int)
    add("--tokenizer-type", default=None)
    add("--num-experts", type=int)
    add("--moe-router-topk", type=int, default=2)
    add("--moe-ffn-hidden-size", type=int)
    add("--moe-token-dispatcher-type", default="alltoall")
    add("--moe-expert-capacity-factor", type=float)
    add("--moe-shared-expert-intermediate-size", type=int)
    add("--expert-tensor-parallel-size", type=int)
    add("--recompute-granularity", choices=["full", "selective"])
    add("--recompute-method", choices=["uniform", "block"])
    add("--recompute-num-layers", type=int)
    add("--tensor-model-parallel-size", type=int, default=1)
    add("--pipeline-model-parallel-size", type=int, default=1)
    add("--num-layers-per-virtual-pipeline-stage", type=int)
    add("--virtual-pipeline-model-parallel-size", type=int)
    add("--context-parallel-size", type=int, default=1)
    add("--expert-model-parallel-size", type=int, default=1)
    add("--sequence-parallel", action="store_true")
    add("--use-distributed-optimizer", action="store_true")
    add("--overlap-grad-reduce", action="store_true")
    # Megatron-LM checks every gradient bucket for NaN before its reduction unless told not to
    add("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_false")
    add("--micro-batch-size", type=int, default=1)
    add("--global-batch-size", type=int)
    add("--bf16", action="store_true")
    add("--fp16", action="store_true")


def _plan(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the world and the device")
    add = g.add_argument
    add("--nproc-per-node", "--nproc_per_node", type=int, default=None, help="ranks per node (torchrun's)")
    add("--nnodes", type=int, default=1, help="nodes (torchrun's)")
    add("--device-memory-gb", type=float, default=None, help="memory of one device, GiB")
    add("--profile", default=None, help="calibration profile (JSON) from `npuspeed plan --calibrate`")
    add("--script", default=None, help="a Megatron-LM launch script: its argument list is read "
        "(flags given here as well win)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="npuspeed plan", add_help=False, allow_abbrev=False)
    _megatron(p)
    _plan(p)
    return p


def _required(ns, names):
    missing = [f"--{n.replace('_', '-')}" for n in names if getattr(ns, n) is None]
    if missing:
        raise PlanInputError(f"npuspeed plan needs {', '.join(missing)} (the model's shape, as the "
                             "training run is given it)")


def _vocab(ns) -> int:
    kind = ns.tokenizer_type
    if kind == "NullTokenizer":
        if ns.vocab_size is None:
            raise PlanInputError("--tokenizer-type NullTokenizer needs --vocab-size N (ids 0..N-1, eod N)")
        return ns.vocab_size + 1
    if ns.vocab_size is not None:
        return ns.vocab_size
    if kind in (None, "ByteLevelTokenizer"):
        return 258
    raise PlanInputError(f"--tokenizer-type {kind}: give --vocab-size N (the tokenizer's size) so the "
                         "planner knows the embedding and logits size")


#: Megatron's explicit per-stage layer layout (0.14+), which the planner does not model
LAYOUT = "--pipeline-model-parallel-layout"


def parse(argv: list[str]) -> tuple[RunSpec, argparse.Namespace, list[str]]:
    """(RunSpec, the planner's own namespace, the feature argv) from a run's flags."""
    ns, rest = build_parser().parse_known_args(list(argv))
    if any(a.split("=", 1)[0] == LAYOUT for a in rest):  # Megatron 0.14+: never silently ignored
        raise PlanInputError(f"{LAYOUT}: the planner models --num-layers / --pipeline-model-parallel-size layers "
                             "on every stage, not an explicit per-stage layout; drop the layout to plan the run")
    _required(ns, ["num_layers", "hidden_size", "num_attention_heads", "seq_length"])
    if ns.bf16 and ns.fp16:
        raise PlanInputError("--bf16 and --fp16 are exclusive; pick one")
    heads = ns.num_attention_heads
    groups = ns.num_query_groups if (ns.group_query_attention and ns.num_query_groups) else heads
    ffn = ns.ffn_hidden_size or 4 * ns.hidden_size
    if heads < 1 or ns.hidden_size < 1:
        raise PlanInputError(f"--num-attention-heads {heads} and --hidden-size {ns.hidden_size} must be >= 1")
    problems = []
    if ns.kv_channels is None and ns.hidden_size % heads:
        problems.append(f"--hidden-size {ns.hidden_size} is not divisible by --num-attention-heads {heads}; "
                        "give --kv-channels or change one of them")
    model = ModelSpec(
        num_layers=ns.num_layers, hidden=ns.hidden_size, ffn=ffn, heads=heads, query_groups=groups,
        kv_channels=ns.kv_channels or max(ns.hidden_size // heads, 1), seq_length=ns.seq_length,
        vocab=_vocab(ns), vocab_divisible_by=ns.make_vocab_size_divisible_by,
        max_position_embeddings=ns.max_position_embeddings or ns.seq_length,
        normalization=ns.normalization, swiglu=ns.swiglu, position_embedding=ns.position_embedding_type,
        tied_embeddings=not ns.untie_embeddings_and_output_weights, bias=not ns.disable_bias_linear,
        hidden_dropout=ns.hidden_dropout, attention_dropout=ns.attention_dropout,
        num_experts=ns.num_experts, moe_topk=ns.moe_router_topk,
        moe_ffn=ns.moe_ffn_hidden_size or (ffn if ns.num_experts else 0),
        recompute_granularity=ns.recompute_granularity, recompute_method=ns.recompute_method,
        recompute_num_layers=ns.recompute_num_layers,
    )
    pp = ns.pipeline_model_parallel_size
    vpp = ns.virtual_pipeline_model_parallel_size
    if ns.num_layers_per_virtual_pipeline_stage:
        per_stage = ns.num_layers // max(pp, 1)
        vpp = max(per_stage // ns.num_layers_per_virtual_pipeline_stage, 1)
        if per_stage % ns.num_layers_per_virtual_pipeline_stage:
            problems.append(f"--num-layers-per-virtual-pipeline-stage {ns.num_layers_per_virtual_pipeline_stage} "
                            f"does not divide the {per_stage} layers of a pipeline stage")
    tp, cp = ns.tensor_model_parallel_size, ns.context_parallel_size
    nproc = ns.nproc_per_node
    devices = (nproc if nproc is not None else tp * pp * cp) * ns.nnodes
    layout = Layout(tp=tp, pp=pp, vpp=vpp if vpp and vpp > 1 else None, cp=cp,
                    ep=ns.expert_model_parallel_size, sp=ns.sequence_parallel, world=devices,
                    distributed_optimizer=ns.use_distributed_optimizer,
                    overlap_grad_reduce=ns.overlap_grad_reduce)
    batch = Batch(micro_batch=ns.micro_batch_size, global_batch=ns.global_batch_size,
                  dtype="bf16" if ns.bf16 else "fp16" if ns.fp16 else "fp32")
    if ns.num_experts:
        for given, what in ((ns.moe_token_dispatcher_type != "alltoall", f"--moe-token-dispatcher-type "
                             f"{ns.moe_token_dispatcher_type} (the planner models the all-to-all dispatcher)"),
                            (ns.moe_expert_capacity_factor is not None, "--moe-expert-capacity-factor (token dropping)"),
                            (ns.moe_shared_expert_intermediate_size is not None, "--moe-shared-expert-intermediate-size"),
                            (ns.expert_tensor_parallel_size not in (None, ns.tensor_model_parallel_size),
                             "--expert-tensor-parallel-size other than TP")):
            if given:
                problems.append(f"not modeled: {what}; drop it to plan the rest")
    mem = int(ns.device_memory_gb * 2**30) if ns.device_memory_gb else None
    spec = RunSpec(model=model, layout=layout, batch=batch, feature_argv=tuple(rest), devices=devices,
                   device_memory_bytes=mem, extra={"problems": problems, "nproc_per_node": nproc,
                          "check_for_nan_in_grad": ns.check_for_nan_in_loss_and_grad and not ns.fp16})
    return spec, ns, rest
