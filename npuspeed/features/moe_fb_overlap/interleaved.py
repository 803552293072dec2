"""PP > 1: Megatron's interleaved (VPP) schedule, one extra warm-up micro-batch, each steady
step's forward beside its backward (megatron-core 0.14+).

With `config.overlap_moe_expert_parallel_comm` on, Megatron's interleaved schedule runs one more
forward in its warm-up, so that in every steady step the forward and the backward it pairs
belong to different micro-batches and do not depend on each other, and it hands each step to
`combined_1f1b_schedule_for_interleaved_pipelining`. npuspeed turns the field on for the
schedule call only (`interleaving_wrapper`; elsewhere it stays off: takeover.py) and replaces
that step (`paired_step`): Megatron's own pre/post-processing and pipeline send/receive hooks in
the order Megatron's combined step issues them (forward's before backward's), and between them
Megatron's `forward_step` on this thread beside its `backward_step` on a worker, taking turns at
each token all-to-all (pipeline/turns.py). A step with only a forward (warm-up) or only a backward
(cool-down) runs alone. Without VPP Megatron has no such schedule: refused (`refuse_plain_1f1b`).
"""
from __future__ import annotations

import contextlib
import functools
import inspect

from npuspeed import telemetry
from npuspeed.features.base import FeatureError
from npuspeed.features.moe_common import a2a_clock
from npuspeed.features.moe_fb_overlap.schedule import _config_of, training_call
from npuspeed.features.pipeline import turns
from npuspeed.features.pipeline.chunks import backward_chunk, forward_chunk
from npuspeed.features.pipeline.pair_choice import trial_step
from npuspeed.features.pipeline.pairing import pairing_scope, worker_setup

RANGE = ">=0.14,<0.20"


def no_vpp_message(flag: str, pp: int) -> str:
    return (f"{flag} at --pipeline-model-parallel-size {pp} pairs micro-batches in Megatron's interleaved "
            "schedule, as Megatron's own combined 1F1B does: add --num-layers-per-virtual-pipeline-stage "
            "(VPP) or use --pipeline-model-parallel-size 1")


def batch_message(flag: str, microbatches: int, pp: int) -> str:
    return (f"{flag} at --pipeline-model-parallel-size {pp} with VPP runs one extra warm-up micro-batch, so it "
            f"needs more micro-batches a step than pipeline stages ({microbatches} <= {pp}): raise "
            "--global-batch-size above data-parallel x pipeline-parallel x --micro-batch-size")


def interleaving_wrapper(flag: str, note):
    """Megatron's interleaved schedule with the extra warm-up micro-batch and paired steps (or,
    where the step trial measured it faster, Megatron's plain interleaved schedule)."""

    def wrap(original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def run(*args, **kwargs):
            call = training_call(signature, args, kwargs)
            if call is None:
                return original(*args, **kwargs)
            from megatron.core import parallel_state

            config = _config_of(call["model"])
            n, pp = call["num_microbatches"], parallel_state.get_pipeline_model_parallel_world_size()
            if n <= pp:
                raise FeatureError(batch_message(flag, n, pp))

            @contextlib.contextmanager
            def paired(acc):
                config.overlap_moe_expert_parallel_comm = True  # the schedule's extra warm-up and paired steps
                try:
                    with pairing_scope(acc):
                        yield
                finally:
                    config.overlap_moe_expert_parallel_comm = False

            return trial_step(n, lambda: original(*args, **kwargs), note, paired)

        return run

    return wrap


def refuse_plain_1f1b(flag: str):
    def wrap(original):
        @functools.wraps(original)
        def run(*args, **kwargs):
            if not kwargs.get("forward_only"):
                from megatron.core import parallel_state

                raise FeatureError(no_vpp_message(flag, parallel_state.get_pipeline_model_parallel_world_size()))
            return original(*args, **kwargs)

        return run

    return wrap


def paired_step(config, forward_step_func, data_iterator, model, num_microbatches, forward_data_store,
                forward_step_helper_preprocess, forward_step_helper_postprocess,
                backward_step_helper_preprocess, backward_step_helper_postprocess,
                get_microbatch_id_in_model_chunk, get_model_chunk_id, check_first_val_step,
                is_first_microbatch_for_model_chunk, collect_non_loss_data,
                f_virtual_microbatch_id=None, b_virtual_microbatch_id=None,
                pre_forward=None, pre_backward=None, post_forward=None, post_backward=None):
    """One step of the interleaved schedule: a forward, a backward, or the two paired. Returns
    (output tensor, input tensor gradient) as Megatron's step helper does."""
    f_chunk = b_chunk = input_tensor = b_tensors = None
    if f_virtual_microbatch_id is not None:
        f_chunk = get_model_chunk_id(f_virtual_microbatch_id, forward=True)
        f_micro = get_microbatch_id_in_model_chunk(f_virtual_microbatch_id, forward=True)
        input_tensor = forward_step_helper_preprocess(f_virtual_microbatch_id, f_chunk, f_micro)
        is_first = check_first_val_step(is_first_microbatch_for_model_chunk(f_virtual_microbatch_id))
    if b_virtual_microbatch_id is not None:
        b_chunk = get_model_chunk_id(b_virtual_microbatch_id, forward=False)
        b_tensors = backward_step_helper_preprocess(b_virtual_microbatch_id, b_chunk)
    if pre_forward is not None and f_chunk is not None:
        pre_forward(f_chunk)
    if pre_backward is not None and b_chunk is not None:
        pre_backward(b_chunk)

    out = {}

    def forward():
        out["f"] = forward_chunk(config, forward_step_func, data_iterator, model, num_microbatches, forward_data_store,
                            f_chunk, f_micro, input_tensor, is_first, collect_non_loss_data)

    def backward():
        out["b"] = backward_chunk(config, model, b_tensors)

    if f_chunk is not None and b_chunk is not None:
        telemetry.count("moe.fb_overlap.pairs")
        with a2a_clock.phase("steady"):
            turns.run_pair(forward, backward, worker_setup())
    elif f_chunk is not None:
        with a2a_clock.phase("warm_up"):
            forward()
    elif b_chunk is not None:
        with a2a_clock.phase("cool_down"):
            backward()

    output_tensor = input_tensor_grad = None
    if f_chunk is not None:
        output_tensor, num_tokens = out["f"]
        forward_step_helper_postprocess(f_chunk, output_tensor, num_tokens)
        if post_forward is not None:
            output_tensor = post_forward(output_tensor, f_chunk)
    if b_chunk is not None:
        input_tensor_grad = out["b"]
        backward_step_helper_postprocess(b_virtual_microbatch_id)
        if post_backward is not None:
            input_tensor_grad = post_backward(input_tensor_grad, b_chunk)
    return output_tensor, input_tensor_grad
