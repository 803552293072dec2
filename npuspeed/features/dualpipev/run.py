"""One DualPipeV step: the per-rank order (pipeline/v_order.py) run with Megatron's forward_step and
backward_step, npuspeed's sends and receives (links.py) and Megatron's gradient finalisation.

Each chunk's forward takes its input from the previous stage (rank 0's chunk 0: the data) and
sends its output to the next; rank P-1 hands chunk 0's output to its own chunk 1, and chunk 1's
input gradient back to chunk 0, without a transfer. A paired step (a forward and a backward of
different micro-batches) receives both inputs first, then runs the two computations, taking
turns at each expert all-to-all when `--moe-fb-overlap` asked for it (pipeline/turns.py)
and one after the other otherwise, then sends both results. Data-parallel gradient reduction
waits until each chunk's last backward (Megatron's no_sync around the others), as in Megatron's
interleaved schedule.
"""
from __future__ import annotations

import contextlib
import time

import torch

from npuspeed import telemetry
from npuspeed.features.dualpipev.links import Links
from npuspeed.features.moe_common import a2a_clock
from npuspeed.features.pipeline import v_order
from npuspeed.features.pipeline.bubble import measure as bubble
from npuspeed.features.pipeline.chunks import backward_chunk, forward_chunk
from npuspeed.features.pipeline.message import message_shape


def _no_sync(config, chunk: int):
    func = config.no_sync_func
    if func is None:
        return contextlib.nullcontext()
    return (func[chunk] if isinstance(func, list) else func)()


class Step:
    """One call of the schedule on this rank."""

    def __init__(self, call: dict, pair=None, measure: bool = False):
        from megatron.core.utils import get_model_config

        from npuspeed.accelerator import get_accelerator

        self.call, self.model = call, call["model"]
        self.config = config = get_model_config(self.model[0])
        self.m = call["num_microbatches"]
        dtype = config.pipeline_dtype or torch.float32
        self.measure = measure  # the bubble measure (pipeline/bubble/): receive waits and paired steps
        self.links = Links(message_shape(config, call["seq_length"], call["micro_batch_size"]), dtype,
                           get_accelerator().device(), bubble.record_wait if measure else None)
        self.pair = pair  # run_pair(forward, backward) when the overlap is on
        self.store, self.tokens = [], torch.zeros([], dtype=torch.int, device=get_accelerator().device())
        self.inputs, self.outputs = {}, {}
        self.handoff_act, self.handoff_grad = {}, {}

    # -- forward ---------------------------------------------------------------------------
    def _forward_input(self, chunk: int, micro: int):
        links = self.links
        if chunk == 0 and links.up is None:
            return None  # rank 0's chunk 0 reads the data
        if chunk == 1 and links.down is None:
            return self.handoff_act.pop(micro).requires_grad_()
        return links.recv(links.activation_from(chunk), links.activations, requires_grad=True)

    def _forward(self, chunk: int, micro: int, input_tensor):
        call = self.call
        last = chunk == 1 and self.links.up is None
        first_val = call.get("first_val_step")
        is_first = micro == 0 if first_val is None else (micro == 0 and first_val)
        output, tokens = forward_chunk(self.config, call["forward_step_func"], call["data_iterator"], self.model,
                                       self.m, self.store, chunk, micro, input_tensor, is_first,
                                       call.get("collect_non_loss_data", False), last=last)
        if last:
            self.tokens = self.tokens + tokens
        return output

    def _forward_output(self, chunk: int, micro: int, input_tensor, output) -> None:
        from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor

        links = self.links
        if not self.call.get("forward_only"):
            self.inputs[(chunk, micro)], self.outputs[(chunk, micro)] = input_tensor, output
        if chunk == 1 and links.up is None:
            return  # the loss
        data = output.detach()  # the values travel; Megatron then frees the output's own copy
        if chunk == 0 and links.down is None:
            self.handoff_act[micro] = data
        else:
            links.send(data, links.activation_to(chunk), links.activations)
        deallocate_output_tensor(output, self.config.deallocate_pipeline_outputs)

    # -- backward --------------------------------------------------------------------------
    def _backward_input(self, chunk: int, micro: int):
        links = self.links
        if chunk == 1 and links.up is None:
            return None  # the loss
        if chunk == 0 and links.down is None:
            return self.handoff_grad.pop(micro)
        return links.recv(links.activation_to(chunk), links.gradients, requires_grad=False)

    def _backward(self, chunk: int, micro: int, grad):
        key = (chunk, micro)
        tensors = (self.inputs.pop(key), self.outputs.pop(key), grad)
        last = micro == self.m - 1  # this chunk's gradients reduce from here on (as Megatron's schedule)
        with contextlib.nullcontext() if last else _no_sync(self.config, chunk):
            input_grad = backward_chunk(self.config, self.model, tensors)
        if last and self.config.grad_sync_func is not None:
            sync = self.config.grad_sync_func
            (sync[chunk] if isinstance(sync, list) else sync)(self.model[chunk].parameters())
        return input_grad

    def _backward_output(self, chunk: int, micro: int, input_grad) -> None:
        links = self.links
        if chunk == 1 and links.down is None:
            self.handoff_grad[micro] = input_grad
        elif not (chunk == 0 and links.up is None):
            links.send(input_grad, links.activation_from(chunk), links.gradients)

    # -- the step --------------------------------------------------------------------------
    def op(self, op: v_order.Op) -> None:
        f_in = b_in = None
        if op.forward is not None:
            f_in = self._forward_input(op.forward, op.f_micro)
        if op.backward is not None:
            b_in = self._backward_input(op.backward, op.b_micro)
        out = {}

        def forward():
            out["f"] = self._forward(op.forward, op.f_micro, f_in)

        def backward():
            out["b"] = self._backward(op.backward, op.b_micro, b_in)

        if op.paired:
            telemetry.count("dualpipev.paired_ops")
            t0 = time.perf_counter()
            if self.pair is not None:
                telemetry.count("moe.fb_overlap.pairs")
                with a2a_clock.phase("steady"):
                    self.pair(forward, backward)
            else:
                backward()
                forward()
            if self.measure:
                from npuspeed.accelerator import get_accelerator

                get_accelerator().synchronize()
                bubble.record_pair(time.perf_counter() - t0)
        elif op.forward is not None:
            with a2a_clock.phase("warm_up"):
                forward()
        else:
            with a2a_clock.phase("cool_down"):
                backward()
        if op.forward is not None:
            self._forward_output(op.forward, op.f_micro, f_in, out["f"])
        if op.backward is not None:
            self._backward_output(op.backward, op.b_micro, out["b"])

    def run(self) -> list:
        from megatron.core import parallel_state

        ranks = parallel_state.get_pipeline_model_parallel_world_size()
        rank = parallel_state.get_pipeline_model_parallel_rank()
        if self.call.get("forward_only"):
            for micro in range(self.m):
                for chunk in (0, 1):
                    self.op(v_order.Op(forward=chunk, f_micro=micro))
        else:
            telemetry.count("dualpipev.steps")
            for _phase, op in v_order.schedule(ranks, rank, self.m):
                self.op(op)  # a2a_clock's phase follows the op: paired steady, lone forward/backward warm-up/cool-down
        self.links.finish()
        assert not self.inputs and not self.handoff_act and not self.handoff_grad, "DualPipeV left work undone"
        config = self.config
        if config.finalize_model_grads_func is not None and not self.call.get("forward_only"):
            config.finalize_model_grads_func(self.model, self.tokens if config.calculate_per_token_loss else None)
        return self.store
