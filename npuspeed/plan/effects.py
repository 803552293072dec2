"""The enabled features' plan effects, merged: what the planner swaps, hides and keeps.

Each feature states its effect in one method (`Feature.plan_effect`, npuspeed/features/
base.py); this module asks every enabled feature and refuses an effect naming a slot,
variant or kernel the planner does not model, and an enabled feature that states nothing
while not declared neutral. So a new feature cannot be left out of the plan silently.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from npuspeed.plan.ops import OPTIONS, VARIANTS


class PlanEffectError(RuntimeError):
    pass


@dataclass
class Effects:
    variants: dict = field(default_factory=dict)
    variant_layers: dict = field(default_factory=dict)
    master_bytes: float | None = None
    kernels: dict = field(default_factory=dict)
    overlap: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)
    comm_per_layer: dict = field(default_factory=dict)
    #: --swap-optimizer's effect (PlanEffect.swap_optimizer); empty when off
    swap_optimizer: dict = field(default_factory=dict)
    #: --swap-modules names whose saved activations leave the device (empty: no swap or the host
    #: is the device)
    swap_modules: tuple = ()
    #: (feature name, summary) of every enabled feature with an effect
    summaries: list = field(default_factory=list)
    features: list = field(default_factory=list)

    def layers_for(self, slot: str, layers_in_chunk: int) -> set:
        """Layer indices of a chunk the variant of `slot` applies to (all unless limited)."""
        if slot not in self.variants or self.variants[slot] in ("keep",):
            return set()
        n = self.variant_layers.get(slot)
        return set(range(layers_in_chunk if n is None else min(n, layers_in_chunk)))


def check(name: str, effect) -> None:
    from npuspeed.plan.speed import KERNELS

    for slot, variant in effect.variants.items():
        if slot not in VARIANTS or variant not in VARIANTS[slot]:
            raise PlanEffectError(f"feature {name}: plan effect {slot}={variant!r} is not a variant "
                                  f"the planner models ({VARIANTS})")
    for kind, kernel in effect.kernels.items():
        if kind not in KERNELS or kernel not in KERNELS[kind]:
            raise PlanEffectError(f"feature {name}: kernel {kind}={kernel!r} is not one the planner "
                                  f"calibrates ({KERNELS})")
    for dim in (*effect.overlap, *effect.comm_per_layer):
        if dim not in ("tp", "dp", "pp", "cp", "ep"):
            raise PlanEffectError(f"feature {name}: overlap or communication of unknown dimension {dim!r}")
    from npuspeed.plan.ops import SWAP_PARTS

    for module in effect.swap_modules:
        if module not in SWAP_PARTS:
            raise PlanEffectError(f"feature {name}: swapped module {module!r} is not one the planner models "
                                  f"({', '.join(SWAP_PARTS)})")
    for key in effect.options:
        if key not in OPTIONS:
            raise PlanEffectError(f"feature {name}: plan option {key!r} is not one the planner reads ({OPTIONS})")


def collect(spec, ctx, features) -> Effects:
    """Merge the plan effects of the features enabled in `ctx` for the run `spec`."""
    from npuspeed.features.base import Feature

    out = Effects()
    for feature in features:
        if not feature.enabled(ctx.args) or feature.always_on:
            continue
        out.features.append(feature.name)
        overrides = type(feature).plan_effect is not Feature.plan_effect
        if not overrides:
            if not feature.plan_neutral:
                raise PlanEffectError(f"feature {feature.name} is enabled but states no plan effect: "
                                      "override Feature.plan_effect or set plan_neutral = True")
            continue
        effect = feature.plan_effect(spec, ctx)
        if effect is None:
            continue
        check(feature.name, effect)
        for slot, variant in effect.variants.items():
            if slot in out.variants and out.variants[slot] != variant:
                raise PlanEffectError(f"feature {feature.name}: {slot}={variant} conflicts with "
                                      f"{out.variants[slot]} from another feature")
            out.variants[slot] = variant
        out.variant_layers.update(effect.variant_layers)
        if effect.master_bytes_per_param is not None:
            out.master_bytes = effect.master_bytes_per_param
        out.swap_modules = tuple(dict.fromkeys(out.swap_modules + tuple(effect.swap_modules)))
        out.kernels.update(effect.kernels)
        out.swap_optimizer.update(effect.swap_optimizer)
        out.options.update(effect.options)
        for dim, nbytes in effect.comm_per_layer.items():
            out.comm_per_layer[dim] = out.comm_per_layer.get(dim, 0.0) + nbytes
        for dim, frac in effect.overlap.items():
            out.overlap[dim] = max(out.overlap.get(dim, 0.0), frac)
        if effect.summary:
            out.summaries.append((feature.name, effect.summary))
    return out
