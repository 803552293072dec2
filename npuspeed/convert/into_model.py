"""Fill a training run's own model chunks (any TP/PP/VPP/EP layout) straight from a Hugging
Face directory: no checkpoint is written.

Each rank reads, for each of its parameters, the Hugging Face tensors of that parameter's
global counterpart (npuspeed.convert.names), builds the global tensor and keeps its own shard
(npuspeed.convert.layout): host memory holds one global parameter at a time.
"""
from __future__ import annotations

import torch

from npuspeed.convert import architectures, hf_files, layout, megatron_args, name_table
from npuspeed.errors import UserError


def _ranks():
    from megatron.core import parallel_state as mpu

    return dict(tp=(mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()),
                ep=(mpu.get_expert_model_parallel_rank(), mpu.get_expert_model_parallel_world_size()),
                etp=(mpu.get_expert_tensor_parallel_rank(), mpu.get_expert_tensor_parallel_world_size()))


def check_flags(spec, padded_vocab: int, model_flags: dict, hf: str) -> None:
    """The run's model flags (the example's names) against the model the directory holds."""
    want = megatron_args.fingerprint(spec, padded_vocab)
    label = {"padded_vocab_size": "a padded vocabulary of"}
    diff = [f"{label.get(k, '--' + k.replace('_', '-'))} {v!r} (the run has {model_flags.get(k)!r})"
            for k, v in want.items()
            if k in model_flags and k not in ("kv_channels", "max_position_embeddings") and model_flags[k] != v]
    if diff:
        raise UserError(f"--hf-checkpoint {hf} holds another model than the run's flags describe: it needs "
                        f"{'; '.join(diff)}; `npuspeed convert hf-to-megatron` prints the full set")


@torch.no_grad()
def load_into(chunks, hf: str, padded_vocab: int, model_flags: dict | None = None) -> int:
    """Copy this rank's shard of every parameter of `chunks` (GPTModels) from `hf`; return how
    many parameters were filled. Every parameter must have a Hugging Face source."""
    reader = hf_files.HFReader(hf, flag="--hf-checkpoint")
    spec = architectures.from_hf_config(reader.config)
    if model_flags is not None:
        check_flags(spec, padded_vocab, model_flags, hf)
    by_name = {g.megatron: g for g in name_table.groups(spec, padded_vocab)}
    ranks = _ranks()
    ep_rank, ep_size = ranks["ep"]
    num_local = spec.experts.num_experts // ep_size if spec.experts else 0
    filled = 0
    for chunk in chunks:
        # DeepSeek-V3's routing bias is a buffer (Megatron's router.expert_bias), not a parameter
        bias = [(n, b) for n, b in chunk.named_buffers() if n.endswith("router.expert_bias")]
        for name, param in list(chunk.named_parameters()) + bias:
            gname = layout.global_name(name, chunk, num_local, ep_rank)
            group = by_name.get(gname)
            if group is None:
                raise UserError(f"--hf-checkpoint {hf}: parameter {gname} of this run has no Hugging Face source "
                                "(e.g. --moe-grouped-gemm's weights are not mapped yet); drop the flag that adds it")
            full = group.to_megatron([reader.read(n) for n in group.hf])
            expert = getattr(param, "allreduce", True) is False
            rank, size = ranks["etp"] if expert else ranks["tp"]
            part = layout.shard(full, param, gname, True, rank, size)
            if tuple(part.shape) != tuple(param.shape):
                raise UserError(f"--hf-checkpoint {hf}: {gname} is {tuple(full.shape)} there, which does not "
                                f"give this rank's {tuple(param.shape)}; check the model flags")
            param.copy_(part.to(param.dtype))
            filled += 1
    return filled
