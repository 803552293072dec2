"""The adaptive memory policy: per layer keep / norm recompute / activation recompute / swap /
full recompute, chosen by the planner for a per-rank device budget (`--adaptive-recompute-device-size`).

The candidates are what the features and Megatron apply per pipeline stage, counted from each
stage's first layer: full recompute of the first F layers (Megatron's block method) or
Megatron's selective recompute of core attention in every layer (its granularity is one value),
with activation-function recompute and norm recompute of the first A and R layers after F, and,
with `--adaptive-memory-optimization` on a device backend, `--swap-attention` of every layer
not fully recomputed (on CPU the host is the device: a swap frees nothing, so it is no
candidate, and the policy says so). Each is planned (npuspeed/plan/memory.py, the same replay
`npuspeed plan` prints, within a few per cent of measured peaks); those whose predicted peak
stays under the budget less a safety margin are ranked by predicted step time: the calibrated
profile's when the run names one (`--profile`), else the seconds each recompute adds by
recompute_cost.py's roofline of the planner's op graph (matmul FLOPs, bytes moved and op
calls at the backend's nominal rates: a FLOPs count alone priced Megatron's memory-bound
selective core-attention recompute at under half a layer's recompute where it costs about
two thirds on this CPU host); a swap adds its copies' time not hidden behind the layer's
compute, replayed by the swap's own sizing rule (npuspeed/offload/sizing.py, the schedule the
run's --swap-attention sizing decides with measured figures) over the host link this process
knows (a figure NPUSPEED_HOST_LINK_GBS gives every rank alike, else the backend's nominal one:
the policy is chosen at import, before a device is set, and ranks must choose alike); a chosen
swap runs in --swap-attention-mode whole (the budget needs all of it), whose log line states
the measured cost. The choice is returned as explicit flags, so the run, `npuspeed plan` and `npuspeed
report` all see the same configuration.
"""
from __future__ import annotations

from dataclasses import dataclass

from npuspeed.errors import UserError

MAIN = "--adaptive-recompute-device-size"
OPT = "--adaptive-memory-optimization"
#: added with --swap-attention when the policy chose it (the flag given by a user is refused)
SWAP_MARK = "--adaptive-swap"
#: the predicted peak must stay this far under the budget (the planner's largest error on the
#: README's configurations is -2.4% for dense models)
MARGIN = 0.05
#: at most this many candidates are planned (coarser steps for deep stages)
MAX_CANDIDATES = 400


class AdaptiveError(UserError, ValueError):
    pass


@dataclass
class Policy:
    full: int  # first F layers of each stage: full recompute
    activation: int  # then A layers: activation-function recompute
    norm: int  # then R layers: norm recompute
    layers: int  # layers per stage
    peak: int  # predicted per-rank peak, bytes
    cost: float  # predicted step seconds (profile) or added work (relative)
    budget: int  # bytes
    timed: bool  # cost is the profile's step time
    selective: bool = False  # Megatron's selective recompute of core attention, every layer
    swap: bool = False  # --swap-attention (the attention block's saves to host) on the other layers
    #: why swap is not a candidate here ("" where it is)
    no_swap: str = ""

    def flags(self) -> list[str]:
        out = []
        if self.selective:
            out += ["--recompute-granularity", "selective"]
        if self.full:
            out += ["--recompute-granularity", "full", "--recompute-method", "block",
                    "--recompute-num-layers", str(self.full)]
        if self.activation:
            out += ["--recompute-activation-function", "--recompute-activation-function-num-layers",
                    str(self.full + self.activation)]
        if self.norm:
            out += ["--recompute-norm", "--recompute-norm-num-layers", str(self.full + self.norm)]
        if self.swap:  # the budget needs the whole saving: its cost is what the policy priced
            out += ["--swap-attention", "--swap-attention-mode", "whole", SWAP_MARK]
        return out

    def describe(self) -> str:
        L, f, a, r = self.layers, self.full, self.activation, self.norm
        keep = L - f - max(a, r)
        parts = [f"full recompute {f}", f"activation recompute {a}", f"norm recompute {r}", f"keep all {keep}",
                 f"core attention recompute (selective) {'all' if self.selective else 0}"]
        return (f"of {L} layers per stage: " + ", ".join(parts) + f" (first layers first); predicted peak "
                f"{self.peak / 2**20:.1f} MiB of {self.budget / 2**20:.1f} MiB; swap: "
                + (f"attention block of the other {L - f} layers to host memory" if self.swap else
                   self.no_swap or "not chosen"))


def _value(argv: list[str], flag: str):
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _without(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == MAIN:
            skip = True
        elif a == OPT or a.startswith(MAIN + "="):
            continue
        else:
            out.append(a)
    return out


def _grid(n: int) -> list[int]:
    if (n + 1) ** 3 <= MAX_CANDIDATES:
        return list(range(n + 1))
    step = max(1, n // 6)
    return sorted(set(list(range(0, n + 1, step)) + [n]))


def _work(costs, n: int, f: int, a: int, r: int, selective: bool = False) -> float:
    """Seconds the recomputes add per micro-batch and stage (recompute_cost.py's roofline)."""
    return f * costs.full + a * costs.act + r * costs.norm + (n * costs.core if selective else 0.0)


def choose(argv: list[str], world: int | None = None) -> Policy:
    """The policy for `argv` (a run's flags with the adaptive ones); AdaptiveError if none fits."""
    from npuspeed.plan.planner import plan

    raw = _value(argv, MAIN)
    try:
        budget_mib = float(raw)
    except (TypeError, ValueError):
        raise AdaptiveError(f"{MAIN} needs a number of MiB, got {raw!r}") from None
    if budget_mib <= 0:
        raise AdaptiveError(f"{MAIN} must be a positive number of MiB, got {budget_mib:g}")
    from npuspeed.features.adaptive_memory import OWNED

    given = [f for f in OWNED if f in argv or any(a.startswith(f + "=") for a in argv)]
    if given:
        raise AdaptiveError(f"{MAIN} chooses recompute itself: drop {', '.join(given)} (or drop {MAIN})")
    if "--swap-attention" in argv or SWAP_MARK in argv:
        raise AdaptiveError(f"--swap-attention with {MAIN}: the adaptive policy chooses swap itself (MindSpeed refuses "
                            "the pair too); drop --swap-attention")
    base = _without(argv)
    if world is not None and "--nproc-per-node" not in base and "--nproc_per_node" not in base:
        base += ["--nproc-per-node", str(world)]
    budget = int(budget_mib * 2**20)
    from npuspeed.plan.flags import PlanInputError

    try:
        first = plan(base, with_removes=False)
    except PlanInputError as exc:  # e.g. a model shape the script takes from its own defaults
        raise AdaptiveError(f"{MAIN} plans the run from its flags: {exc}") from None
    if not first.ok:
        raise AdaptiveError(f"{MAIN}: the run cannot be planned: {'; '.join(first.problems)}")
    spec = first.spec
    n = spec.layers_per_chunk() * spec.layout.chunks
    timed = first.speed is not None
    from npuspeed.plan.context import device
    from npuspeed.plan.recompute_cost import layer_costs, swap_stage_seconds, swap_unavailable

    costs = layer_costs(first.run, device(base))
    mbs = spec.batch.num_microbatches(spec.layout.dp)
    no_swap = swap_unavailable(costs) or ("" if OPT in argv else f"not considered (add {OPT})")
    best, smallest = None, None
    grid = _grid(n)
    # Megatron's recompute granularity is one value: block full recompute of the first F layers,
    # or selective (core attention) in every layer; activation and norm recompute go with either;
    # swap of the attention block applies to every layer not fully recomputed (those save nothing)
    shapes = [(f, False) for f in grid] + [(0, True)]
    for swap in ([False] if no_swap else [False, True]):
        for f, sel in shapes:
            if swap and f == n:
                continue
            for a in [x for x in grid if x <= n - f]:
                for r in [x for x in grid if x <= n - f]:
                    cand = Policy(f, a, r, n, 0, 0.0, budget, timed, sel, swap, no_swap)
                    p = first if not cand.flags() else plan(base + cand.flags(), with_removes=False)
                    if not p.ok:
                        continue
                    cand.peak = p.peak
                    extra = 0.0
                    if swap:
                        per_layer = max(rank.swapped_per_layer for rank in p.ranks)
                        if not per_layer:
                            continue
                        extra = swap_stage_seconds(costs, per_layer, n - f)
                    cand.cost = p.speed.step_ms + extra * mbs * 1e3 if timed else _work(costs, n, f, a, r, sel) + extra
                    if smallest is None or cand.peak < smallest.peak:
                        smallest = cand
                    if cand.peak <= budget * (1 - MARGIN):
                        if best is None or (cand.cost, cand.peak) < (best.cost, best.peak):
                            best = cand
                        break  # more norm recompute only costs more (the grid's r ascends)
    if best is None:
        need = smallest.peak / (1 - MARGIN) / 2**20
        raise AdaptiveError(f"{MAIN} {budget_mib:g}: nothing fits; the least memory (full recompute {smallest.full}, "
                            f"activation {smallest.activation}, norm {smallest.norm} of {n} layers"
                            f"{', swap' if smallest.swap else ''}) is predicted at "
                            f"{smallest.peak / 2**20:.1f} MiB per rank: give at least {need:.1f} (MiB, with the "
                            f"{MARGIN:.0%} margin) or more ranks")
    return best


def expand(argv: list[str], world: int | None = None) -> tuple[list[str], Policy | None]:
    """`argv` with the chosen policy's flags added (unchanged without the adaptive flag)."""
    if _value(argv, MAIN) is None:
        if OPT in argv:
            raise AdaptiveError(f"{OPT} is given without {MAIN}; add {MAIN} MB (the device budget per rank)")
        return list(argv), None
    policy = choose(argv, world)
    return list(argv) + policy.flags() + ["--adaptive-policy", policy.describe()], policy
