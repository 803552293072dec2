"""The expert layout the command line asks for, and what each MoE flag needs of it.

Read from Megatron's flags as given (`ctx.megatron`; None = not said: a megatron.core
script may set it in code, so only contradictions among given flags are refused here, and
the rest is checked on the built model).
"""
from __future__ import annotations

from dataclasses import dataclass

from npuspeed.features.base import FeatureError
from npuspeed.patching.versions import in_range, megatron_version


@dataclass
class Layout:
    experts: int | None
    tp: int
    ep: int
    #: expert tensor-parallel size as given (None: Megatron's default, the TP size)
    etp: int | None
    tp_extend_ep: bool
    ffn: int | None
    dispatcher: str | None
    bias_disabled: bool

    @classmethod
    def from_ctx(cls, ctx, tp_extend_ep: bool) -> "Layout":
        """`tp_extend_ep`: --moe-tp-extend-ep, from the asking feature's typed config."""
        m = ctx.megatron
        return cls(
            experts=getattr(m, "num_experts", None),
            tp=getattr(m, "tensor_model_parallel_size", None) or 1,
            ep=getattr(m, "expert_model_parallel_size", None) or 1,
            etp=getattr(m, "expert_tensor_parallel_size", None),
            tp_extend_ep=bool(tp_extend_ep),
            ffn=getattr(m, "moe_ffn_hidden_size", None) or getattr(m, "ffn_hidden_size", None),
            dispatcher=getattr(m, "moe_token_dispatcher_type", None),
            bias_disabled=bool(getattr(m, "disable_bias_linear", None)),
        )

    @property
    def expert_parallel(self) -> int:
        """Ranks the experts are spread over."""
        return self.ep * self.tp if self.tp_extend_ep else self.ep

    @property
    def expert_tp(self) -> int:
        """Ranks each expert's weights are split over."""
        if self.tp_extend_ep:
            return 1
        return self.etp if self.etp is not None else self.tp


def layers_of(block):
    """The MoE layers (those with a token dispatcher) of a built TransformerBlock."""
    return [layer.mlp for layer in getattr(block, "layers", ()) if hasattr(getattr(layer, "mlp", None),
                                                                         "token_dispatcher")]


def needs_experts(flag: str, block) -> str | None:
    """A model without experts gives the flag nothing to do (a pipeline stage may still hold
    only dense layers of a MoE model: that is fine)."""
    if not getattr(getattr(block, "config", None), "num_moe_experts", None):
        return f"{flag}: the model has no experts (needs --num-experts with a MoE layer spec)"
    return None


def needs_release(flag: str, spec: str, why: str) -> None:
    """A flag whose patches are written for releases `spec` refuses others at start-up
    (a skipped patch would leave the flag doing nothing)."""
    if not in_range(spec):
        raise FeatureError(f"{flag} needs megatron-core {spec} ({why}); this is {megatron_version()}: upgrade "
                           "megatron-core or drop the flag")


def needs_all_to_all(flag: str, ctx, tp_extend_ep: bool) -> None:
    """A flag that overlaps the all-to-all dispatcher's exchange refuses another dispatcher and
    expert-parallel size 1 (no exchange), as given on the command line."""
    lay = Layout.from_ctx(ctx, tp_extend_ep)
    if lay.dispatcher is not None and lay.dispatcher != "alltoall":
        raise FeatureError(f"{flag} overlaps the all-to-all dispatcher; --moe-token-dispatcher-type is "
                           f"{lay.dispatcher}: use alltoall or drop the flag")
    if lay.expert_parallel == 1 and (ctx.megatron.expert_model_parallel_size is not None or lay.tp_extend_ep):
        raise FeatureError(f"{flag}: expert-parallel size is 1, so there is no all-to-all to overlap; use "
                           "--expert-model-parallel-size > 1 (or --moe-tp-extend-ep with TP > 1)")


def built_all_to_all(flag: str, block) -> str | None:
    """The built block's problem for such a flag: no experts, or no all-to-all dispatcher."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    problem = needs_experts(flag, block)
    if problem:
        return problem
    layers = layers_of(block)
    if layers and not any(isinstance(layer.token_dispatcher, MoEAlltoAllTokenDispatcher) for layer in layers):
        kinds = sorted({type(layer.token_dispatcher).__name__ for layer in layers})
        return f"{flag} needs --moe-token-dispatcher-type alltoall (built: {kinds})"
    return None
