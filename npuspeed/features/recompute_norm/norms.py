"""The layer side of norm recompute: which norms, and when their outputs are freed.

A selected norm (a layer's `input_layernorm`, and `pre_mlp_layernorm` before a dense MLP) runs
under the activation-recompute checkpoint (features/activation_checkpoint.py: Megatron-Core's
CheckpointWithoutOutput, fp8-safe): its output is computed without a graph and only its input
is kept. The one consumer that saves the output is the next linear (`linear_qkv`, `linear_fc1`);
a forward hook on that linear frees the output's storage as soon as it has run, and a gradient
hook on the linear's output recomputes the norm into the same storage just before the linear's
backward reads it. So between forward and backward a layer keeps neither norm output nor the
norm's own saved statistics (the forward ran without a graph); backward holds one recomputed
norm at a time.

Megatron-Core 0.16's own `recompute_modules=['layernorm']` does the same for selective
granularity but constructs CheckpointWithoutOutput with fp8=False (read as fp8 on: Transformer
Engine is called), frees only after the whole attention/MLP, and cannot be limited to N layers.

Skipped, and said once: layers under full recompute (recomputed whole anyway), layers where
Megatron's own layernorm recompute is on, norms that are identities (fused into a TE linear),
the pre-MLP norm of MoE layers (its output feeds the router and the dispatcher, not one
linear), and everything when activations are offloaded to the host (offload hooks read them).
"""
from __future__ import annotations

import functools

import torch

from npuspeed import telemetry
from npuspeed.features import freed_outputs
from npuspeed.features.base import after_init

TARGET = "megatron.core.transformer.transformer_block.TransformerBlock.__init__"
MAIN, FLAG = "--recompute-norm", "--recompute-norm-num-layers"
#: counter prefix (selected, freed, freed_bytes, kept_shared, recomputed): the tests' proof
PREFIX = "recompute_norm."
SELECTED = PREFIX + "selected"
#: set on a norm module that recomputes; holds the pending checkpoint between norm and linear
ATTR = "_npuspeed_recompute_norm"


def _norm_forward(norm, x, *args, **kwargs):
    """The norm module's own forward (its class's: fused RMSNorm swaps the class)."""
    return type(norm).forward(norm, x, *args, **kwargs)


def _checkpointed(norm):
    from npuspeed.features.activation_checkpoint import ActivationCheckpoint  # imports megatron

    def forward(x, *args, **kwargs):
        if args or kwargs or not torch.is_grad_enabled() or not x.requires_grad:
            return _norm_forward(norm, x, *args, **kwargs)
        checkpoint = ActivationCheckpoint(prefix=PREFIX, release_inputs=False, random=False)
        out = checkpoint.checkpoint(functools.partial(_norm_forward, norm), x)
        setattr(norm, ATTR, checkpoint)
        if isinstance(out, torch.Tensor):  # until its consumer ran: --swap-attention leaves it alone
            freed_outputs.mark(out)
        return out

    return forward


def _free_after(norm):
    """Forward hook on the consuming linear: it has saved the norm's output; free it now."""

    def hook(_module, _inputs, output):
        checkpoint = getattr(norm, ATTR, None)
        if checkpoint is None:
            return
        setattr(norm, ATTR, None)
        for norm_out in checkpoint.outputs if isinstance(checkpoint.outputs, tuple) else (checkpoint.outputs,):
            if isinstance(norm_out, torch.Tensor):
                freed_outputs.unmark(norm_out)
        out = output[0] if isinstance(output, (tuple, list)) else output
        checkpoint.discard_output_and_register_recompute(out)
        norm._npuspeed_recompute_norm_last = checkpoint  # what was freed (tests and debugging)

    return hook


def install(norm, consumer) -> None:
    """Make `norm` recompute, its output freed once `consumer` (a linear) has run."""
    setattr(norm, ATTR, None)
    norm.forward = _checkpointed(norm)  # instance attribute: the state dict is unchanged
    consumer.register_forward_hook(_free_after(norm))
    telemetry.count(SELECTED)


def _is_norm(module) -> bool:
    return module is not None and type(module).__name__ != "IdentityOp" and any(
        True for _ in module.parameters(recurse=False))


def select(block, num_layers: int | None, note) -> None:
    """Install norm recompute in this block's selected layers; `note` says each skip once."""
    from megatron.core.transformer.mlp import MLP

    from npuspeed.features.first_layers import fully_recomputed, layers_taken

    config = block.config
    for index, layer in layers_taken(block, num_layers, note, (MAIN, FLAG), "the norms", "the norm outputs"):
        if fully_recomputed(config, index):
            note("--recompute-norm: --recompute-granularity full recomputes whole layers; full recompute "
                 "wins and those layers keep Megatron's behaviour")
            continue
        if getattr(layer, "recompute_input_layernorm", False) or getattr(layer, "recompute_pre_mlp_layernorm", False):
            note("--recompute-norm: Megatron's own recompute_modules=['layernorm'] is on; it wins in those layers")
            continue
        attention = getattr(layer, "self_attention", None)
        qkv = getattr(attention, "linear_qkv", None)
        if _is_norm(getattr(layer, "input_layernorm", None)) and isinstance(qkv, torch.nn.Module):
            install(layer.input_layernorm, qkv)
        else:
            note("--recompute-norm: an input norm that is an identity (fused into the QKV linear) or "
                 "feeds no linear_qkv is left as is")
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, MLP) and _is_norm(getattr(layer, "pre_mlp_layernorm", None)):
            install(layer.pre_mlp_layernorm, mlp.linear_fc1)
        elif mlp is not None and type(mlp).__name__ != "IdentityOp":
            note("--recompute-norm: the pre-MLP norm of MoE layers (it feeds the router and the "
                 "dispatcher) is left as is; their input norm is recomputed")


def selector(num_layers: int | None, note):
    """Wrapper for TransformerBlock.__init__: select this block's norms once it is built."""
    return after_init(select, num_layers, note)
