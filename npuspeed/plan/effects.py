"""The enabled features' plan effects, merged: what the planner swaps, hides and keeps.

Each feature states its effect in its plan module's `effect(model, config)` (`Feature.plan`,
npuspeed/features/base.py; `plan = None`: none) in the words of npuspeed/plan_vocabulary.py;
this module asks every enabled feature and refuses an effect naming a slot, variant or kernel
the planner does not model, and an enabled feature that has not said its plan module. So a new feature cannot be
left out of the plan silently.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from npuspeed.plan_vocabulary import PlanEffect, PlanEffectError, check  # noqa: F401  (re-exported)


@dataclass(frozen=True)
class Effects(PlanEffect):
    """The enabled features' PlanEffects merged into one (the same fields), and who stated them."""

    #: (feature name, summary) of every enabled feature with an effect
    summaries: tuple = ()
    features: tuple = ()

    @property
    def master_bytes(self) -> float | None:
        return self.master_bytes_per_param

    def layers_for(self, slot: str, layers_in_chunk: int) -> set:
        """Layer indices of a chunk the variant of `slot` applies to (all unless limited)."""
        if slot not in self.variants or self.variants[slot] in ("keep",):
            return set()
        n = self.variant_layers.get(slot)
        return set(range(layers_in_chunk if n is None else min(n, layers_in_chunk)))


def _merge(out: dict, name: str, effect: PlanEffect) -> None:
    for slot, variant in effect.variants.items():
        if slot in out["variants"] and out["variants"][slot] != variant:
            raise PlanEffectError(f"feature {name}: {slot}={variant} conflicts with "
                                  f"{out['variants'][slot]} from another feature")
        out["variants"][slot] = variant
    out["variant_layers"].update(effect.variant_layers)
    if effect.master_bytes_per_param is not None:
        out["master_bytes_per_param"] = effect.master_bytes_per_param
    out["swap_modules"] = tuple(dict.fromkeys(out["swap_modules"] + tuple(effect.swap_modules)))
    out["kernels"].update(effect.kernels)
    out["swap_optimizer"].update(effect.swap_optimizer)
    out["options"].update(effect.options)
    for dim, nbytes in effect.comm_per_layer.items():
        out["comm_per_layer"][dim] = out["comm_per_layer"].get(dim, 0.0) + nbytes
    for dim, frac in effect.overlap.items():
        out["overlap"][dim] = max(out["overlap"].get(dim, 0.0), frac)
    if effect.fb_pairs is not None:
        out["fb_pairs"] = max(out["fb_pairs"] or 0, effect.fb_pairs)
    out["extra_in_flight"] = max(out["extra_in_flight"], effect.extra_in_flight)
    if effect.schedule is not None:
        if out["schedule"] not in (None, effect.schedule):
            raise PlanEffectError(f"feature {name}: pipeline schedule {effect.schedule} conflicts with "
                                  f"{out['schedule']} from another feature")
        out["schedule"] = effect.schedule
    if effect.summary:
        out["summaries"].append((name, effect.summary))


def collect(spec, ctx, features) -> Effects:
    """Merge the plan effects of the features enabled in `ctx` for the run `spec`."""
    out = {"variants": {}, "variant_layers": {}, "master_bytes_per_param": None, "kernels": {}, "overlap": {},
           "options": {}, "comm_per_layer": {}, "swap_optimizer": {}, "swap_modules": (), "fb_pairs": None,
           "extra_in_flight": 0, "schedule": None, "summaries": [],
           "features": []}
    spec = replace(spec, device=getattr(ctx.accelerator, "name", "cpu"))
    for feature in features:
        if not feature.enabled(ctx.args) or feature.always_on:
            continue
        out["features"].append(feature.name)
        effect = feature.plan_effect(spec, ctx)
        if effect is None:
            continue
        check(feature.name, effect)
        _merge(out, feature.name, effect)
    out["summaries"], out["features"] = tuple(out["summaries"]), tuple(out["features"])
    return Effects(**out)


def not_modeled(spec, effects: Effects) -> list[str]:
    """What this planner cannot predict yet for these effects, said instead of a wrong number."""
    out = []
    if spec.layout.cp > 1 and effects.variants.get("core_attention") != "cp":
        out.append(f"--context-parallel-size {spec.layout.cp} needs a context-parallel attention: Megatron-Core's "
                   "local DotProductAttention has none (npuspeed's context parallelism feature provides it)")
    return out
