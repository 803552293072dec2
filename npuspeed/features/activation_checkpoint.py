"""Megatron-Core's own `CheckpointWithoutOutput`, made safe to use on every version we support:
the checkpoint --recompute-activation-function (its mlp.py) and --recompute-norm (its norms.py)
both run, so it sits beside the feature folders.

It already does what the feature needs: run a function without saving its graph, release its
output's storage (`untyped_storage().resize_(0)`) once the consumer has saved the tensor, and,
from a gradient hook, recompute it under the forward's RNG states and copy it back into the
same storage. What we add:

* 0.13-0.16 take `fp8=` and read the default `False` as "fp8 on" (`fp8 is not None`), which
  calls Transformer Engine's FP8 state manager: a NameError without TE. We pass `fp8=None`
  (no fp8 there); 0.12 has no such argument.
* Only an output that owns its storage alone is released (a function returning a view of its
  input would otherwise free the input); a shared one is kept and recomputed harmlessly.
* 0.12-0.16 copy the recomputed tensor into the released storage; 0.17+ re-point that storage
  at the recomputed data (a C++ extension Megatron compiles on first use: it needs a C++
  compiler on the host). Whether a recomputed copy exists is read off the storages after each
  recompute: releasing it where the storage is shared would free what fc2's backward reads.
* Megatron keeps the recomputed tensor until the checkpoint's backward has run, and the
  checkpoint's input (fc1's output) as long; with the copy that is up to three activations at
  once in the layer being backpropagated, more than the baseline ever holds there. Whatever
  the recompute's graph did not save is not needed for backward (its autograd nodes are):
  the input is released before the copy (with a bias the graph saved `x + bias`, not `x`),
  the recomputed tensor right after it (GeLU and SwiGLU, fused or not, save their input, not
  their output). What the graph saved, or what shares its storage, is left alone.
"""
from __future__ import annotations

import inspect

import torch
from megatron.core.tensor_parallel.random import CheckpointWithoutOutput

from npuspeed import telemetry

#: counter prefix of what ran (the tests' proof that the storages were really freed/recomputed):
#: recompute.freed, .freed_bytes, .kept_shared, .recomputed, .inputs_released, .shared (0.17+:
#: the released storage re-pointed at the recomputed data, no copy)
PREFIX = "recompute."


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _SavedStorages(torch.autograd.graph.saved_tensors_hooks):
    """Notes which storages a recompute's graph saves; the tensors themselves pass through."""

    def __init__(self, ptrs: set):
        def pack(t):
            ptrs.add(_ptr(t))
            return t.detach()  # not `t`: a saved output would otherwise reference its own node

        super().__init__(pack, lambda t: t)


class ActivationCheckpoint(CheckpointWithoutOutput):
    """One use: `checkpoint(fn, *args)`, then `discard_output_and_register_recompute(t)`."""

    _takes_fp8 = "fp8" in inspect.signature(CheckpointWithoutOutput.__init__).parameters

    def __init__(self, prefix: str = PREFIX, release_inputs: bool = True, random: bool = True):
        """`prefix`: the counters this use counts under (another feature reusing the mechanism,
        e.g. norm recompute, keeps its own); `release_inputs`: whether an activation input the
        recompute's graph does not save is released (fc1's output; never a residual stream);
        `random=False`: the function draws no random numbers (a norm), so the RNG states are not
        kept from forward to backward (on CPU they are ~5 KB per generator per checkpoint)."""
        if self._takes_fp8:
            super().__init__(fp8=None)
        else:
            super().__init__()
        self._prefix = prefix
        self._release_inputs = release_inputs
        self._random = random
        self._needed: set[int] = set()  # storages the recompute's graph (or its inputs) holds on to
        self._arg_ptrs: set[int] = set()
        self._activations: list[bool] = []  # which checkpoint inputs are activations (not leaves)
        self.freed = False

    def checkpoint(self, run_function, *args):
        def tracked(*inputs):
            if not torch.is_grad_enabled():  # the forward: nothing is saved anyway
                return run_function(*inputs)
            saved: set[int] = set()
            with _SavedStorages(saved):
                out = run_function(*inputs)
            outs = out if isinstance(out, tuple) else (out,)
            out_ptrs = {_ptr(t) for t in outs if isinstance(t, torch.Tensor)}
            for t, activation in zip(inputs, self._activations):
                # fc1's output, kept only by this checkpoint: done with it now. Parameters (the
                # bias) are leaves of the forward graph and never released.
                if self._release_inputs and activation and _ptr(t) not in saved | out_ptrs and self._sole(t):
                    t.untyped_storage().resize_(0)
                    telemetry.count(self._prefix + "inputs_released")
            self._needed = saved | {_ptr(t) for t in inputs if isinstance(t, torch.Tensor)}
            return out

        self._arg_ptrs = {_ptr(t) for t in args if isinstance(t, torch.Tensor)}
        self._activations = [isinstance(t, torch.Tensor) and t.grad_fn is not None for t in args]
        out = super().checkpoint(tracked, *args)
        if not self._random:
            self.rng_states = None  # taken again, unchanged, when the recompute runs
        return out

    @staticmethod
    def _sole(t: torch.Tensor) -> bool:
        """The tensor spans its whole storage (it is not a view into something bigger)."""
        return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()

    def _owns(self, t: torch.Tensor) -> bool:
        return _ptr(t) not in self._arg_ptrs and self._sole(t)

    def discard_output_and_register_recompute(self, hook_tensor):
        if all(self._owns(t) for t in self.outputs):
            nbytes = sum(t.untyped_storage().nbytes() for t in self.outputs)
            super().discard_output_and_register_recompute(hook_tensor)
            self.freed = all(t.untyped_storage().nbytes() == 0 for t in self.outputs)
            if self.freed:
                telemetry.count(self._prefix + "freed")
                telemetry.count(self._prefix + "freed_bytes", nbytes)
            return
        telemetry.count(self._prefix + "kept_shared")
        if hook_tensor.requires_grad:  # still needed: the checkpoint's backward reads ctx.outputs
            hook_tensor.register_hook(self._recompute)

    def _recompute(self, grad):
        ctx = self.ctx
        if ctx is not None and getattr(self, "rng_states", ()) is None:
            from megatron.core.tensor_parallel.random import _get_all_rng_states

            self.rng_states = _get_all_rng_states()
        originals = self.outputs or ()
        super()._recompute(grad)
        if ctx is None or self.ctx is not None:
            return  # nothing was recomputed (done already, or a cuda-graph warm-up)
        telemetry.count(self._prefix + "recomputed")
        outputs = ctx.outputs if isinstance(ctx.outputs, tuple) else (ctx.outputs,)
        for original, out in zip(originals, outputs):
            if not isinstance(out, torch.Tensor):
                continue
            if _ptr(original) == _ptr(out):
                # megatron-core 0.17+: the original's storage was re-pointed at the recomputed
                # data (no copy): one activation, which fc2's backward reads; nothing to release.
                telemetry.count(self._prefix + "shared")
                continue
            # 0.12-0.16: the recomputed data was copied into the original; this copy goes.
            if _ptr(out) not in self._needed and self._sole(out):
                out.untyped_storage().resize_(0)
