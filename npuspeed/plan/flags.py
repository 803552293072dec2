"""`npuspeed plan`'s command line: a training run's flags plus the world and the device.

Megatron's model, parallel and batch flags keep Megatron-LM's names (so a launch script's
argument list works as is, `--script FILE` reads one). The Megatron flags npuspeed's runtime
reads are npuspeed/megatron_flags.py's, declared there once (given or None); the ones only the
planner needs are declared here; one parse of the argv yields both the planner's namespace and
the features' view of Megatron's flags (`megatron_args`). npuspeed's feature flags are the
runtime's own parser's; flags neither knows are ignored, as a training run's launcher would
pass them through. Defaults are Megatron-LM's where a flag is optional there (dropout 0.1,
LayerNorm, learned absolute positions, tied embeddings, bias), the example's tokenizer
(258 byte-level ids) when no vocabulary is named.
"""
from __future__ import annotations

import argparse

from npuspeed import megatron_flags
from npuspeed.plan.spec import Batch, Layout, ModelSpec, RunSpec


class PlanInputError(ValueError):
    """A flag the planner cannot work with; the message names it and the fix."""


#: Megatron-LM's defaults of the megatron_flags.py flags the planner reads (those parse to None
#: when not given: "not said" to a feature, Megatron's default to the planner)
MEGATRON_DEFAULTS = {
    "normalization": "LayerNorm", "position_embedding_type": "learned_absolute", "attention_dropout": 0.1,
    "moe_token_dispatcher_type": "alltoall", "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
    "context_parallel_size": 1, "expert_model_parallel_size": 1, "micro_batch_size": 1,
}
#: values the planner models, per megatron_flags.py flag that has a closed set
CHOICES = {"recompute_granularity": ("full", "selective")}


def _megatron(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and parallelism (Megatron-LM's flags)")
    for dest, (flag, kwargs) in megatron_flags.FLAGS.items():
        g.add_argument(flag, dest=dest, default=None, **kwargs)
    add = g.add_argument  # the Megatron flags only the planner reads
    add("--hidden-size", type=int)
    add("--group-query-attention", action="store_true")
    add("--kv-channels", type=int)
    add("--max-position-embeddings", type=int)
    add("--hidden-dropout", type=float, default=0.1)
    add("--make-vocab-size-divisible-by", type=int, default=128)
    add("--vocab-size", type=int)
    add("--tokenizer-type", default=None)
    add("--moe-router-topk", type=int, default=2)
    add("--moe-shared-expert-intermediate-size", type=int)
    add("--recompute-method", choices=["uniform", "block"])
    add("--recompute-num-layers", type=int)
    add("--use-distributed-optimizer", action="store_true")
    add("--overlap-grad-reduce", action="store_true")
    # Megatron-LM checks every gradient bucket for NaN before its reduction unless told not to
    add("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_false")


def megatron_args(ns: argparse.Namespace) -> argparse.Namespace:
    """The features' view of Megatron's flags (megatron_flags.parse's namespace) from this
    parser's namespace: the same dests, None where not given."""
    return argparse.Namespace(**{dest: getattr(ns, dest) for dest in megatron_flags.FLAGS})


def _with_defaults(ns: argparse.Namespace) -> argparse.Namespace:
    out = argparse.Namespace(**vars(ns))
    for dest, value in MEGATRON_DEFAULTS.items():
        if getattr(out, dest) is None:
            setattr(out, dest, value)
    for dest, (_flag, kwargs) in megatron_flags.FLAGS.items():
        if kwargs.get("action") == "store_const":  # a switch not given is off for the planner
            setattr(out, dest, bool(getattr(out, dest)))
    for dest, allowed in CHOICES.items():
        value = getattr(out, dest)
        if value is not None and value not in allowed:
            raise PlanInputError(f"{megatron_flags.FLAGS[dest][0]} {value}: the planner models "
                                 f"{' or '.join(allowed)}")
    return out


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
    """(RunSpec, the planner's own namespace, the feature argv) from a run's flags; the
    namespace holds Megatron's flags as given (None: not said; `megatron_args` reads them)."""
    raw, rest = build_parser().parse_known_args(list(argv))
    if raw.pipeline_model_parallel_layout is not None:  # Megatron 0.14+: never silently ignored
        raise PlanInputError(f"{LAYOUT}: the planner models --num-layers / --pipeline-model-parallel-size layers "
                             "on every stage, not an explicit per-stage layout; drop the layout to plan the run")
    ns = _with_defaults(raw)
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
    return spec, raw, rest
