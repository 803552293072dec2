"""The example's command line, with Megatron-LM's argument names.

Defaults give a tiny model that trains on CPU in seconds. npuspeed's own feature flags are
added by `npuspeed.add_arguments` (the adaptor has already read them).
"""
from __future__ import annotations

import argparse

import npuspeed
from npuspeed import arguments as npuspeed_arguments


def _model(p):
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=64)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "none"],
                   default="learned_absolute")
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--use-rope-scaling", action="store_true", help="Llama 3.x's RoPE frequency scaling")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0, help="its factor (with --use-rope-scaling)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="biases on the query/key/value projection even with --disable-bias-linear (Qwen2)")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="normalise each head's query and key (--normalization's kind) before RoPE (Qwen3)")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--num-experts", type=int, default=None)
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None)
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    g.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall"], default="alltoall")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="drop tokens beyond this multiple of an even share per expert (default: dropless)")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                   help="with a capacity factor: pad every expert's input to its capacity")
    g.add_argument("--moe-token-drop-policy", choices=["probs", "position"], default="probs")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="softmax over all experts before top-k (Megatron requires it for top-1)")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="FFN size of the shared experts every token also goes through (default: none)")
    g.add_argument("--moe-shared-expert-overlap", action="store_true")
    g.add_argument("--moe-shared-expert-gate", action="store_true",
                   help="scale the shared experts' output by a learned sigmoid gate (Qwen2-MoE)")
    g.add_argument("--moe-router-load-balancing-type", choices=["aux_loss", "seq_aux_loss", "none"],
                   default="aux_loss")
    _mla_and_routing(g)
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--transformer-impl", choices=["local"], default="local",
                   help="only Megatron-Core's local modules (no Transformer Engine)")


def _mla_and_routing(g):
    """DeepSeek-V2/V3 (Megatron-LM's names and defaults): multi-latent attention, whose q/kv
    latent norms the local spec builds with --qk-layernorm, and DeepSeek's routing."""
    g.add_argument("--multi-latent-attention", action="store_true")
    g.add_argument("--q-lora-rank", type=int, default=None, help="query latent rank (default: no query latent)")
    g.add_argument("--kv-lora-rank", type=int, default=32)
    g.add_argument("--qk-head-dim", type=int, default=128, help="query/key head size without RoPE")
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=64, help="query/key head size with RoPE")
    g.add_argument("--v-head-dim", type=int, default=128)
    g.add_argument("--rope-type", choices=["rope", "yarn"], default=None, help="MLA's RoPE (default: yarn, as "
                   "Megatron's MLA; its original context 4096, beta fast 32 and slow 1 are MLA's defaults)")
    g.add_argument("--no-rope-fusion", action="store_true", help="Megatron-LM's flag; the example never fuses "
                   "RoPE (apply_rope_fusion is off), so it only documents the run")
    g.add_argument("--rotary-scaling-factor", type=float, default=1.0, help="MLA's YaRN factor")
    g.add_argument("--mscale", type=float, default=1.0, help="MLA's YaRN mscale (cos/sin scaling)")
    g.add_argument("--mscale-all-dim", type=float, default=0.0, help="MLA's YaRN mscale_all_dim (softmax scaling)")
    g.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid"], default="softmax")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="a per-expert bias added to the scores for choosing experts only (DeepSeek-V3)")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None)
    g.add_argument("--moe-router-num-groups", type=int, default=None, help="group-limited routing: groups")
    g.add_argument("--moe-router-group-topk", type=int, default=None, help="group-limited routing: groups kept")
    g.add_argument("--moe-layer-freq", type=moe_layer_freq, default=1,
                   help="N: every N-th layer MoE; or a pattern such as [0]*3+[1]*58 (0 dense, 1 MoE)")


def moe_layer_freq(text: str):
    """Megatron-LM's --moe-layer-freq without eval: an int, or terms `[0, 1, ...]*N` joined by +."""
    import ast

    if "[" not in text:
        return int(text)
    pattern = []
    for term in text.replace(" ", "").split("+"):
        body, _, times = term.partition("]*") if "]*" in term else (term[:-1], "", "1")
        items = ast.literal_eval(body.lstrip("(") + "]")
        if not isinstance(items, list) or any(i not in (0, 1) for i in items) or not times.rstrip(")").isdigit():
            raise argparse.ArgumentTypeError(f"{text!r}: use an int or terms like [0]*3+[1]*5")
        pattern += items * int(times.rstrip(")"))
    return pattern


def _parallel(p):
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--overlap-p2p-comm", action="store_true",
                   help="interleaved pipeline: post the next send/receive before the current compute and wait "
                        "for it after (Megatron's overlap_p2p_comm; no batched send/receive)")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="split each sequence over this many ranks (npuspeed's CP: see --context-parallel-algo)")
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="ranks each expert's weights are split over (default: the TP size)")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--distributed-backend", default=None,
                   help="default: the accelerator's (hccl / nccl / gloo); 'nccl' maps to it")
    g.add_argument("--distributed-timeout-minutes", type=float, default=None,
                   help="how long a collective waits for a peer before the run stops with an error "
                        "(default: torch.distributed's); fractions allowed")


def _training(p):
    from gpt_example import profiling, throughput

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=None, help="default: mbs x DP")
    g.add_argument("--train-iters", type=int, default=20)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="constant")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--deterministic-mode", action="store_true",
                   help="Megatron-LM's flag: deterministic kernels and collectives, so that two runs (and a "
                        "save/resume) give identical bits on every backend (npuspeed sets it up at import).")
    g.add_argument("--use-cpu-initialization", action="store_true",
                   help="initial weights drawn on the host, identical for every parallel layout")
    g.add_argument("--log-interval", type=int, default=1)
    throughput.add_arguments(g)
    profiling.add_arguments(g)
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--hf-checkpoint", default=None,
                   help="start from this Hugging Face model directory (config.json + safetensors): each rank "
                        "reads its own shards; the model flags must describe it (npuspeed convert prints them)")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="load this iteration's checkpoint instead of the latest")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop after this iteration (saving first when --save is set)")
    g.add_argument("--summary-json", default=None, help="rank 0 writes losses and timings here")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false",
                   help="as Megatron-LM: by default a NaN/Inf loss or gradient stops the run before the "
                        "step is applied (fp16: the loss scaler skips the step instead)")


def build_parser() -> argparse.ArgumentParser:
    from gpt_example import data

    parser = npuspeed_arguments.ArgumentParser(
        description="GPT pretraining on megatron.core with npuspeed", allow_abbrev=False)
    _model(parser)
    _parallel(parser)
    _training(parser)
    data.add_data_args(parser)
    npuspeed.add_arguments(parser)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and check; a bad setting raises npuspeed.errors.UserError (validate.py)."""
    from gpt_example.validate import validate_args

    args = build_parser().parse_args(npuspeed_arguments.argv_with_env(argv))
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.num_query_groups is None or not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads if not args.group_query_attention else args.num_query_groups
    validate_args(args)
    return args
