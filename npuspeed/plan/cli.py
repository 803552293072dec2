"""`npuspeed plan`: the command line (one configuration, --search, --calibrate, --json)."""
from __future__ import annotations

import argparse
import json
import sys

from npuspeed.plan import render

USAGE = """npuspeed plan [training flags] --nproc-per-node N [--nnodes M] [--device-memory-gb G]
                     [--profile P] [--calibrate] [--search [--top K]] [--json] [--script FILE]

Predicts, per rank, the memory and step time of a training run given by its flags (Megatron-LM's
model/parallel/batch flags and npuspeed's feature flags, or --script a Megatron-LM launch script).
  --calibrate     time this model's Megatron layer, embedding, loss, optimizer step and
                  collectives in each parallel group shape on this machine (the ranks of one
                  node at once); write the profile to --profile (default plan_profile.json)
  --search        enumerate layouts and feature sets for the devices, drop those predicted not to
                  fit --device-memory-gb, rank by predicted tokens/s, print the top --top as flags
  --json          machine-readable: {"peak_mem_bytes", "step_ms", "breakdown", ...}
"""


def _own(argv: list[str]):
    p = argparse.ArgumentParser(prog="npuspeed plan", add_help=False, allow_abbrev=False)
    p.add_argument("--json", action="store_true")
    p.add_argument("--search", action="store_true")
    p.add_argument("--calibrate", action="store_true")
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="threads per rank for --calibrate")
    p.add_argument("-h", "--help", action="store_true")
    return p.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    from npuspeed.plan.flags import PlanInputError, megatron_args, parse
    from npuspeed.plan.planner import plan_spec
    from npuspeed.plan.script import expand
    from npuspeed.plan.speed import load_profile

    own, rest = _own(list(sys.argv[1:] if argv is None else argv))
    if own.help:
        print(USAGE)
        return 0
    try:
        rest = expand(rest)
        policy = None
        if any(a == "--adaptive-recompute-device-size" or a.startswith("--adaptive-recompute-device-size=")
               for a in rest):
            from npuspeed.plan.adaptive import expand

            rest, policy = expand(rest)
            if not own.json:
                print(f"npuspeed plan: adaptive memory policy: {policy.describe()}; flags: "
                      f"{' '.join(policy.flags()) or '(none)'}")
        spec, ns, _ = parse(rest)
        if own.calibrate:
            from npuspeed.plan.calibrate import calibrate, write

            path = ns.profile or "plan_profile.json"
            write(calibrate(spec, rest, threads=own.threads), path)
            print(f"npuspeed plan: profile written to {path} (use --profile {path})")
            return 0
        profile = load_profile(ns.profile) if ns.profile else None
    except (PlanInputError, OSError, ValueError) as exc:
        print(f"npuspeed plan: error: {exc}", file=sys.stderr)
        return 2
    if own.search:
        from npuspeed.plan.search import search

        ranked, rejected = search(spec, rest, profile)
        out = render.search_json(ranked, rejected, own.top) if own.json else render.search_text(
            spec, ranked, rejected, own.top, profile is not None)
        print(json.dumps(out, indent=2) if own.json else out)
        return 0 if ranked else 1
    result = plan_spec(spec, rest, profile, megatron=megatron_args(ns))
    if own.json:
        out = render.as_json(result)
        if policy is not None:
            out["adaptive_policy"] = {"full_recompute_layers": policy.full, "activation_recompute_layers": policy.activation,
                                      "norm_recompute_layers": policy.norm, "layers_per_stage": policy.layers,
                                      "budget_bytes": policy.budget, "flags": policy.flags(), "text": policy.describe()}
        print(json.dumps(out, indent=2))
    else:
        print(render.text(result))
    return 0 if result.ok else 1
