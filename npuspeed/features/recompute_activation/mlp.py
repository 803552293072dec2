"""The MLP side: fc1, the activation under a checkpoint that keeps no output, fc2, release.

Megatron's `MLP.forward` computes the activation inline (GeLU, GLU closures, the fused
bias-GeLU/SwiGLU kernels, TE activations; the branches differ across 0.12-0.16). Rather than
copy that dispatch, the activation is taken from Megatron's own forward, run on a stand-in
whose fc1 returns the given tensors and whose fc2 returns its input: whatever Megatron (or
`--use-fused-swiglu`, which routes that same code) would compute, we compute, in forward and
in the recompute alike, so gradients match bit for bit.

Only MLPs selected at build time (`layers.py`) take this path, and only when it can pay:
with grad enabled and without MoE's per-token scale (expert MLPs are not selected).
"""
from __future__ import annotations

import functools

import torch

TARGET = "megatron.core.transformer.mlp.MLP.forward"
#: set on an MLP instance that recomputes its activation
ATTR = "_npuspeed_recompute_activation"


class _Returns(torch.nn.Module):
    """A module whose forward returns what it was given: megatron-core 0.17+ calls fc1/fc2
    through `apply_module`, which refuses anything that is not an nn.Module."""

    def __init__(self, fn):
        super().__init__()
        self._fn = fn

    def forward(self, value):
        return self._fn(value)


class _ActivationOnly:
    """Stands in for an MLP so that its forward runs only the activation of (x, bias)."""

    def __init__(self, mlp, x, bias):
        self._mlp = mlp
        self.linear_fc1 = _Returns(lambda _hidden: (x, bias))
        self.linear_fc2 = _Returns(lambda act: (act, None))

    def __getattr__(self, name):
        return getattr(self._mlp, name)


def _activation(forward, mlp, x, bias):
    return forward(_ActivationOnly(mlp, x, bias), x)[0]


def recompute_activation(forward):
    from npuspeed.features.activation_checkpoint import ActivationCheckpoint  # imports megatron

    @functools.wraps(forward)
    def mlp_forward(self, hidden_states, *args, **kwargs):
        per_token_scale = kwargs.get("per_token_scale", args[0] if args else None)
        if not getattr(self, ATTR, False) or per_token_scale is not None or not torch.is_grad_enabled():
            return forward(self, hidden_states, *args, **kwargs)
        x, bias = self.linear_fc1(hidden_states)
        checkpoint = ActivationCheckpoint()
        act = checkpoint.checkpoint(functools.partial(_activation, forward, self), x, bias)
        output, output_bias = self.linear_fc2(act)
        # fc2 has saved `act`; its storage goes now and comes back when fc2's output gets its grad.
        checkpoint.discard_output_and_register_recompute(output)
        return output, output_bias

    return mlp_forward
