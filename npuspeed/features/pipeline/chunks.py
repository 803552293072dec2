"""Megatron's forward_step and backward_step for one model chunk and micro-batch, called as its
interleaved schedule calls them: the runners of the paired interleaved step
(moe_fb_overlap/interleaved.py) and of DualPipeV's step (dualpipev/run.py)."""
from __future__ import annotations

import inspect


def forward_chunk(config, forward_step_func, data_iterator, model, num_microbatches, forward_data_store, chunk,
                  microbatch, input_tensor, is_first, collect_non_loss_data, last=None):
    """Megatron's forward_step for one chunk and micro-batch, as its interleaved helper calls it
    (`last`: whether this chunk computes the loss; by default Megatron's answer)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.pipeline_parallel.utils import is_pp_last_stage, is_vp_last_stage

    if last is None:
        last = is_vp_last_stage(vp_stage=chunk, vp_size=config.virtual_pipeline_model_parallel_size) and \
            is_pp_last_stage(parallel_state.get_pipeline_model_parallel_group())
    return schedules.forward_step(
        forward_step_func, data_iterator[chunk], model[chunk], num_microbatches, input_tensor, forward_data_store,
        config, cp_group_size=parallel_state.get_context_parallel_world_size(),
        collect_non_loss_data=collect_non_loss_data, checkpoint_activations_microbatch=None,
        is_first_microbatch=is_first, current_microbatch=microbatch, vp_stage=chunk, is_last_stage=last)


def backward_chunk(config, model, tensors):
    """Megatron's backward_step (0.19 dropped its model_type argument)."""
    from megatron.core.pipeline_parallel import schedules

    extra = {}
    if "model_type" in inspect.signature(schedules.backward_step).parameters:
        from megatron.core.utils import get_model_type

        extra["model_type"] = get_model_type(model[0])
    return schedules.backward_step(*tensors, config=config, **extra)
