"""Context parallelism in `npuspeed plan`: per rank S/CP tokens (the planner splits the
sequence); the core attention is the CP algorithm's, its Ulysses and ring degrees as options: the
planner (plan/ops_cp.py) prices what it saves, holds in flight and sends (a feature never imports
the planner)."""
from __future__ import annotations


def effect(model, config):
    from npuspeed.features.base import PlanEffect

    size = model.layout.cp
    if size < 2:
        return None
    cp = config.layout(size)
    what = {"ring": f"K/V blocks around a ring of {cp.ring}",
            "ulysses": f"all-to-all over {cp.ulysses} ranks (heads for tokens)",
            "hybrid": f"Ulysses all-to-all in groups of {cp.ulysses}, ring of {cp.ring} across them"}[cp.short]
    return PlanEffect(
        variants={"core_attention": "cp"}, kernels={"attention": "flash"},
        options={"cp_ulysses": cp.ulysses, "cp_ring": cp.ring},
        summary=f"activations of S/{size} tokens per rank; {cp.algo}: {what}; no S x S tensors")
