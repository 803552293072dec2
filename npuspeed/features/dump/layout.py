"""This rank's place in the run, written once beside its dump: the parallel sizes and ranks
(Megatron's parallel_state), sequence parallelism and the gated MLP from the model's config, and
for each parameter whether and along which dimension tensor parallelism splits it (Megatron's own
`tensor_model_parallel` / `partition_dim` attributes, what its sharded state dict reads)."""
from __future__ import annotations

import torch


def _get(fn_name: str, default=None):
    from megatron.core import parallel_state as mpu

    fn = getattr(mpu, fn_name, None)
    try:
        value = fn() if fn is not None else default
    except (AssertionError, AttributeError, RuntimeError):  # a group this run did not build
        value = default
    return default if value is None else value


def rank_layout(chunks, named_parameters) -> dict:
    """The layout dict (json) of this rank; `chunks` are the unwrapped model chunks and
    `named_parameters` [(global name, parameter)]."""
    config = getattr(chunks[0], "config", None) if chunks else None
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    try:
        from npuspeed.patching.versions import megatron_version

        version = str(megatron_version())
    except Exception:  # noqa: BLE001 - the version is informative only
        version = None
    params = {}
    for name, p in named_parameters:
        split = bool(getattr(p, "tensor_model_parallel", False))
        params[name] = {"shape": list(p.shape), "dtype": str(p.dtype),
                        "partition_dim": int(getattr(p, "partition_dim", -1)) if split else None,
                        "sequence_parallel": bool(getattr(p, "sequence_parallel", False)),
                        "expert": not bool(getattr(p, "allreduce", True))}
    return {
        "format": "npuspeed-dump/1", "rank": rank, "world_size": world, "megatron_core": version,
        "tp_rank": _get("get_tensor_model_parallel_rank", 0), "tp_size": _get("get_tensor_model_parallel_world_size", 1),
        "pp_rank": _get("get_pipeline_model_parallel_rank", 0), "pp_size": _get("get_pipeline_model_parallel_world_size", 1),
        "vpp_size": _get("get_virtual_pipeline_model_parallel_world_size", 1),
        "cp_rank": _get("get_context_parallel_rank", 0), "cp_size": _get("get_context_parallel_world_size", 1),
        "ep_rank": _get("get_expert_model_parallel_rank", 0), "ep_size": _get("get_expert_model_parallel_world_size", 1),
        "dp_rank": _get("get_data_parallel_rank", 0), "dp_size": _get("get_data_parallel_world_size", 1),
        "sequence_parallel": bool(getattr(config, "sequence_parallel", False)),
        "gated_linear_unit": bool(getattr(config, "gated_linear_unit", False)),
        "params_dtype": str(getattr(config, "params_dtype", None)),
        "num_layers": getattr(config, "num_layers", None),
        "chunks": len(chunks),
        "parameters": params,
    }
