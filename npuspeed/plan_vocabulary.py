"""The words a feature and the planner share about a run's memory and time, in one place.

A feature states its effect on a run as a `PlanEffect` (npuspeed/features/base.py re-exports
it); the planner (npuspeed/plan/) models exactly the slots, variants, swap parts, options,
kernels and parallel dimensions named here, and `check` refuses any other word, so the two
cannot drift apart. This module imports nothing from npuspeed: features (below the planner)
and the planner both read it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

#: op-graph slot -> the variants the planner's op graph (npuspeed/plan/ops.py) knows
VARIANTS = {
    "core_attention": ("unfused", "flash", "sdpa_math", "recompute", "cp"),
    "norm": ("torch", "fused"),
    "glu": ("unfused", "fused"),
    "rope": ("unfused", "fused"),
    "mlp_activation": ("keep", "recompute"),
    "norm_output": ("keep", "recompute"),
    "head": ("unfused", "chunked"),
}
#: --swap-modules name -> the parts of a layer's op names ("l{i}.<part>...") its module runs
SWAP_PARTS = {
    "input_norm": ("n1",),
    "self_attention": ("qkv", "split", "rope_q", "rope_k", "expand", "ctx", "proj"),
    "core_attention": ("ctx",),
    "post_attention_norm": ("n2",),
    "mlp": ("fc1", "fc1b", "glu", "act", "fc2"),  # a MoE layer's ops are named l{i}.fc2.*
}
#: op kind -> the kernels the calibration times (npuspeed/plan/calibrate.py)
KERNELS = {
    "attention": ("unfused", "flash", "sdpa_math"),
    "norm": ("torch", "fused"),
    "glu": ("unfused", "fused"),
    "rope": ("unfused", "fused"),
}
#: parallel dimensions an effect may overlap or send over
DIMENSIONS = ("tp", "dp", "pp", "cp", "ep")
#: pipeline schedules a feature may run instead of Megatron's (npuspeed/plan/placement.py
#: places the stages, npuspeed/plan/schedule.py runs the order)
SCHEDULES = ("dualpipev",)


@dataclass(frozen=True)
class PlanOptions:
    """Settings a PlanEffect may give with its variants (PlanEffect.options, by these names)."""

    #: context parallelism's Ulysses and ring degrees (None: no CP attention stated)
    cp_ulysses: int | None = None
    cp_ring: int | None = None
    #: expert parallel size and expert TP (None: Megatron's, EP as given and expert TP = TP)
    moe_ep: int | None = None
    moe_etp: int | None = None
    #: GroupedMLP: two grouped weights of all local experts instead of per-expert linears
    moe_grouped: bool = False
    #: chunks the all-to-all overlap splits a micro-batch into
    moe_chunks: int | None = None

    @classmethod
    def of(cls, options: dict) -> "PlanOptions":
        return cls(**options)


#: the option names (PlanOptions' fields)
OPTIONS = tuple(f.name for f in fields(PlanOptions))


@dataclass(frozen=True)
class PlanEffect:
    """What a feature changes in a run's memory or time, stated once, for `npuspeed plan`.

    The planner replays Megatron's ops (npuspeed/plan/ops.py); a feature names the op-graph
    slots it swaps (`variants`, e.g. {"core_attention": "flash"}), which calibrated kernel
    times an op kind (`kernels`), how much of a parallel dimension's communication it hides
    (`overlap`, e.g. {"tp": 0.5}) and what the fp32 master keeps between steps. A slot or
    value the planner does not know is an error there, so the two cannot drift apart.
    """

    #: op-graph slot -> variant (VARIANTS)
    variants: dict = field(default_factory=dict)
    #: slot -> how many layers of each pipeline stage it applies to (None/absent: all)
    variant_layers: dict = field(default_factory=dict)
    #: bytes per parameter the fp32 master keeps between optimizer steps (None: unchanged)
    master_bytes_per_param: float | None = None
    #: op kind -> the calibrated kernel that runs it (KERNELS)
    kernels: dict = field(default_factory=dict)
    #: parallel dimension (DIMENSIONS) -> fraction of its time hidden
    overlap: dict = field(default_factory=dict)
    #: settings of the variants it names (OPTIONS, e.g. {"cp_ulysses": 2})
    options: dict = field(default_factory=dict)
    #: parallel dimension -> bytes one rank sends per layer and micro-batch, forward and backward
    #: (replaces the planner's own estimate for that dimension)
    comm_per_layer: dict = field(default_factory=dict)
    #: optimizer states (and masters where "masters") off the device between steps
    #: (--swap-optimizer): {"frees": bool, "masters": bool, "window_bytes": int held during the
    #: step, "link_bytes_per_s": float, "overlapped": bool (copies hidden behind the update)}
    swap_optimizer: dict = field(default_factory=dict)
    #: --swap-modules names whose saved activations are kept in host memory between forward
    #: and backward (SWAP_PARTS); empty where the host is the device
    swap_modules: tuple = ()
    #: forward/backward pairs a step runs (--moe-fb-overlap: micro-batch i's backward beside
    #: i+1's forward, m - 1 of them at PP 1; at PP > 1 paired chunk steps of one chunk's layers): the planner hides each expert all-to-all of one behind
    #: the other's compute at the four pairing points, up to that compute (plan/fb_overlap.py);
    #: None: the schedule pairs nothing
    fb_pairs: int | None = None
    #: micro-batches' activations held at once beyond what the pipeline schedule holds (the
    #: paired schedule keeps micro-batch i's and i+1's alive together at PP 1)
    extra_in_flight: int = 0
    #: the pipeline schedule run instead of Megatron's (SCHEDULES; None: Megatron's). "dualpipev":
    #: rank r holds stages r and 2P-1-r (first and last on rank 0) and runs DualPipeV's order
    schedule: str | None = None
    #: one line for the plan: what it removes or costs
    summary: str = ""


class PlanEffectError(RuntimeError):
    pass


def check(name: str, effect: PlanEffect) -> None:
    """Refuse an effect of feature `name` that uses a word the planner does not model."""
    for slot, variant in effect.variants.items():
        if slot not in VARIANTS or variant not in VARIANTS[slot]:
            raise PlanEffectError(f"feature {name}: plan effect {slot}={variant!r} is not a variant "
                                  f"the planner models ({VARIANTS})")
    for kind, kernel in effect.kernels.items():
        if kind not in KERNELS or kernel not in KERNELS[kind]:
            raise PlanEffectError(f"feature {name}: kernel {kind}={kernel!r} is not one the planner "
                                  f"calibrates ({KERNELS})")
    for dim in (*effect.overlap, *effect.comm_per_layer):
        if dim not in DIMENSIONS:
            raise PlanEffectError(f"feature {name}: overlap or communication of unknown dimension {dim!r}")
    if effect.fb_pairs is not None and effect.fb_pairs < 0 or effect.extra_in_flight < 0:
        raise PlanEffectError(f"feature {name}: fb_pairs {effect.fb_pairs} and extra_in_flight "
                              f"{effect.extra_in_flight} count micro-batches (>= 0)")
    if effect.schedule is not None and effect.schedule not in SCHEDULES:
        raise PlanEffectError(f"feature {name}: pipeline schedule {effect.schedule!r} is not one the planner "
                              f"models ({SCHEDULES})")
    for module in effect.swap_modules:
        if module not in SWAP_PARTS:
            raise PlanEffectError(f"feature {name}: swapped module {module!r} is not one the planner models "
                                  f"({', '.join(SWAP_PARTS)})")
    for key in effect.options:
        if key not in OPTIONS:
            raise PlanEffectError(f"feature {name}: plan option {key!r} is not one the planner reads ({OPTIONS})")
