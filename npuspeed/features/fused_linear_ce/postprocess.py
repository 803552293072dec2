"""Where the fused loss replaces Megatron's: `GPTModel._postprocess` (megatron-core 0.16-0.19).

`_postprocess` runs `self.output_layer(hidden, weight=shared weight or None)` and, when labels
are given, `compute_language_model_loss(labels, logits)` (the unfused `vocab_parallel_cross_entropy`
or, with `cross_entropy_loss_fusion`, the native/TE fused one: the same math on full logits).
Both return the per-token loss [b, s]; the loss mask and the averaging (per-token loss or not,
`calculate_per_token_loss`) happen after, in the training loop's loss function, so replacing
the pair by one per-token function leaves them untouched.

Megatron's path runs unchanged (and says so once) where there is nothing to fuse or the fused
path would not compute the same thing: no labels (logits are the output), multi-token
prediction, inference, logits gathered over TP, a bias on the output layer, deferred embedding
wgrad, the config logger (it dumps the logits). Label smoothing (a `label_smoothing` on the config,
which megatron-core 0.16's GPT loss never applies) is refused.

What later releases added to `_postprocess`, and how each is honoured:
- 0.17: MuP (`config.use_mup`): `_scale_logits` multiplies the logits by `mup_output_mult`;
  the tiles apply the same multiplier (function.py), and a model whose `_scale_logits` is not
  Megatron's takes Megatron's path (its scaling is unknown here).
- 0.18: `output_processor(...)` replaces the output layer and loss: Megatron's path runs (it
  calls the processor); `padding_mask` only reaches multi-token prediction (Megatron's path
  already); inference is `InferenceMode.is_active()`, not a context in eval mode.
"""
from __future__ import annotations

import functools
import inspect

from npuspeed import telemetry
from npuspeed.errors import UserError
from npuspeed.features.fused_linear_ce.candidates import CHUNKED
from npuspeed.features.fused_linear_ce.function import linear_cross_entropy

TARGET = "megatron.core.models.gpt.gpt_model.GPTModel._postprocess"
#: _postprocess(hidden_states, ..., labels, ..., runtime_gather_output, inference_context); the
#: later keywords (is_spec_decode 0.17, padding_mask/output_processor 0.18) are read by name
MEGATRON_RANGE = ">=0.16,<0.20"
FLAG = "--use-fused-linear-cross-entropy"
FALLBACK = "fused_linear_ce.fallback."
MUP = "fused_linear_ce.mup_scaled"  # counter: calls whose tiles applied MuP's logit multiplier


def _why_not(model, args: dict) -> str | None:
    """Why this call must take Megatron's path (None: the fused path computes the same loss)."""
    from megatron.core.config_logger import has_config_logger_enabled

    config, layer = model.config, model.output_layer
    if args.get("labels") is None:
        return "no labels (logits requested)"
    if args.get("mtp_in_postprocess") or getattr(config, "mtp_num_layers", None) is not None:
        return "multi-token prediction"
    if args.get("inference_context") is not None and not model.training or _inference_mode():
        return "inference"
    if args.get("output_processor") is not None:
        return "output_processor given (it computes the output and loss)"
    if _logit_scale(model) == CUSTOM:
        return f"custom _scale_logits ({type(model).__name__}'s: its logit scaling is unknown here)"
    gather = args.get("runtime_gather_output")
    gather = layer.gather_output if gather is None else gather
    group = getattr(layer, "tp_group", None)
    if gather and group is not None and group.size() > 1:
        return "logits gathered over TP (parallel_output=False)"
    if getattr(layer, "bias", None) is not None:
        return "output layer has a bias"
    if getattr(config, "defer_embedding_wgrad_compute", False):
        return "defer_embedding_wgrad_compute"
    if has_config_logger_enabled(config):
        return "config logger dumps the logits"
    return None


CUSTOM = "custom"


def _inference_mode() -> bool:
    """Megatron 0.18+: inference is a global mode (InferenceMode), whatever model.training says."""
    try:
        from megatron.core.inference.utils import InferenceMode
    except ImportError:
        return False
    active = getattr(InferenceMode, "is_active", None)
    return bool(active()) if callable(active) else False


def _logit_scale(model):
    """MuP's logit multiplier (0.17+), None when logits are not scaled, CUSTOM when the model's
    `_scale_logits` is not Megatron's own."""
    scale_logits = getattr(type(model), "_scale_logits", None)
    if scale_logits is None:
        return None  # megatron-core 0.16: no MuP
    from megatron.core.models.common.language_module.language_module import LanguageModule

    if scale_logits is not LanguageModule._scale_logits:
        return CUSTOM
    config = model.config
    if not getattr(config, "use_mup", False) or float(config.mup_output_mult) == 1.0:
        return None
    return float(config.mup_output_mult)


def make_postprocess(chooser, accelerator, note):
    """The wrapper of `_postprocess`; `chooser` (candidates.LossPaths) picks the path per shape,
    `note` records a fallback once (the run's ctx.note)."""

    def wrapper(original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def _postprocess(self, *args, **kwargs):
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            params = bound.arguments
            if not self.post_process:
                return original(self, *args, **kwargs)
            reason = _why_not(self, params)
            if reason is not None:
                telemetry.count(FALLBACK + reason.split(" (")[0].replace(" ", "_"))
                note(f"{FLAG}: Megatron's output layer and loss run for this call: {reason}")
                return original(self, *args, **kwargs)
            if float(getattr(self.config, "label_smoothing", 0.0) or 0.0) > 0.0:
                raise UserError(f"{FLAG} does not support label smoothing (config.label_smoothing="
                                f"{self.config.label_smoothing}); set it to 0 or drop {FLAG}")
            layer = self.output_layer
            weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights \
                else layer.weight
            hidden, labels = params["hidden_states"], params["labels"]
            if chooser.choose(labels.numel(), hidden, weight, layer.tp_group, accelerator) != CHUNKED:
                telemetry.count(FALLBACK + "measured_slower")
                note(f"{FLAG}: Megatron's output layer and loss run at this shape, measured faster: "
                     f"{chooser.choices[chooser.key(labels.numel(), hidden, weight)]['why']} "
                     "(--fused-linear-cross-entropy-fallback never keeps the chunked path)")
                return original(self, *args, **kwargs)
            labels = labels.transpose(0, 1).contiguous()  # [b, s] -> [s, b]
            scale = _logit_scale(self)
            if scale is not None:
                telemetry.count(MUP)
            loss = linear_cross_entropy(hidden, weight, labels, group=layer.tp_group,
                                        sequence_parallel=layer.sequence_parallel, chunk=chooser.chunk, scale=scale)
            return loss.transpose(0, 1).contiguous()  # [s, b] -> [b, s], as Megatron returns it

        return _postprocess

    return wrapper
