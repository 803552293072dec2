"""DualPipeV's V placement of the layers, in Megatron's own model-building terms.

The model is built as two virtual-pipeline chunks per rank (`vp_stage` 0 and 1, VPP 2), as for
Megatron's interleaved schedule; only which stage each chunk is changes: chunk 1 of rank r is
stage 2P-1-r instead of P+r. Three of Megatron's functions say where a chunk sits, and are
replaced while `--schedules-method dualpipev` is on:

- `get_transformer_layer_offset`: the first global layer of a chunk, so layer numbers, the
  checkpoint's layer keys (sharded_state_dict uses global layer numbers) and the example's
  layout-independent initialisation are those of the stage the chunk is. A DualPipeV checkpoint
  therefore holds Megatron's keys and loads in any other layout, and the other way round.
- `parallel_state.is_pipeline_last_stage` and `pipeline_parallel.utils.is_pp_last_stage`: the
  last stage (the output layer and the loss, post_process, the fp32 output of Megatron's
  Float16Module, whose rank reports the loss) is pipeline rank 0's chunk 1.

The first stage is unchanged: rank 0's chunk 0.
"""
from __future__ import annotations

import functools

RANGE = ">=0.14,<0.20"  # the offset function's vp_stage argument and pipeline_parallel.utils


def stage_of(rank: int, ranks: int, chunk: int) -> int:
    """The pipeline stage (of 2 x ranks) that chunk `chunk` of pipeline rank `rank` is."""
    return rank if chunk == 0 else 2 * ranks - 1 - rank


def offset_wrapper(original):
    @functools.wraps(original)
    def get_transformer_layer_offset(config, vp_stage=None, *args, **kwargs):
        if vp_stage is None:
            return original(config, vp_stage, *args, **kwargs)
        pp_rank = kwargs.get("pp_rank", args[0] if args else None)
        if pp_rank is None:
            from megatron.core import parallel_state

            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        ranks = config.pipeline_model_parallel_size
        return stage_of(pp_rank, ranks, vp_stage) * (config.num_layers // (2 * ranks))

    return get_transformer_layer_offset


def last_stage_wrapper(original):
    @functools.wraps(original)
    def is_pipeline_last_stage(ignore_virtual=True, vp_stage=None):
        from megatron.core import parallel_state

        if parallel_state.get_pipeline_model_parallel_rank() != 0:
            return False
        if ignore_virtual or parallel_state.get_virtual_pipeline_model_parallel_world_size() is None:
            return True
        if vp_stage is None:
            vp_stage = parallel_state.get_virtual_pipeline_model_parallel_rank()
        return vp_stage == 1

    return is_pipeline_last_stage


def pp_last_wrapper(original):
    @functools.wraps(original)
    def is_pp_last_stage(pp_group):
        import torch.distributed as dist

        return dist.get_rank(group=pp_group) == 0

    return is_pp_last_stage


def reporting_rank_wrapper(original):
    """Megatron-LM's `is_last_rank` (its log line and progress log print there): under the V the
    loss is on pipeline rank 0, so the reporting rank is the first stage of the last global rank's
    pipeline group (no assumption about Megatron's rank order)."""

    @functools.wraps(original)
    def is_last_rank():
        import torch.distributed as dist
        from megatron.core import parallel_state

        ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
        return dist.get_world_size() - 1 in ranks and dist.get_rank() == ranks[0]

    return is_last_rank


def batch_on_tp_rank_wrapper(original):
    """megatron-core 0.18+'s `get_batch_on_this_tp_rank` (Megatron-LM's pretrain_gpt.py loads
    through it) keeps labels and loss mask only on a last stage that is not also the first; under
    the V rank 0 is both, so it gets the whole batch, as a single stage does."""
    import inspect

    signature = inspect.signature(original)

    @functools.wraps(original)
    def get_batch_on_this_tp_rank(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        a = bound.arguments
        if a.get("is_pipeline_first_stage") and a.get("is_pipeline_last_stage"):
            a["pipeline_model_parallel_size"] = 1
        return original(*bound.args, **bound.kwargs)

    return get_batch_on_this_tp_rank
