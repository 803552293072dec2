"""Does `npuspeed plan` rank layouts as the machine does? For each model size: calibrate
(`npuspeed plan --calibrate`, once per size), plan every 2-rank layout, run each for real,
compare the top 3 by predicted and by measured tokens/s.

Measured = the fastest step after the first of `--iters`, the fastest over `--passes` runs of
each layout, the layouts taking turns (A B C D E A B C D E): on a shared host a burst of other
work then lands on one run of one layout, not on all runs of it, and the calibration keeps
its fastest repeats too. The strict comparison (the same three in the same order) is the exit
status; beside it, a comparison that counts as tied two layouts whose measured times differ
less than either layout's passes differ from each other (DP2 with and without the distributed
optimizer are within a percent of each other on 2 ranks), the spread measured, not assumed.

    python benchmarks/plan_rank.py            # three sizes, five layouts (about 20 min here)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_validate import ROOT, calibrate, predict, run_example  # noqa: E402

SIZES = {
    "small (h128 s128)": ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
                          "--seq-length", "128"],
    "medium (h256 s256)": ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
                           "--seq-length", "256"],
    "large (h512 s512)": ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8",
                          "--seq-length", "512"],
}
COMMON = ["--use-cpu-initialization", "--log-interval", "1", "--micro-batch-size", "1", "--global-batch-size", "4",
          "--bf16"]
LAYOUTS = {
    "TP2": ["--tensor-model-parallel-size", "2"],
    "TP2+SP": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "PP2": ["--pipeline-model-parallel-size", "2"],
    "DP2": [],
    "DP2 distopt": ["--use-distributed-optimizer"],
}


def _inversions(rows: list, top_p: list, noise: dict) -> list:
    """Pairs (a, b) with a in the predicted top 3 and predicted faster than b, that the
    measurement orders the other way by more than the two layouts' passes differ from each
    other (a difference within that spread is a tie this measurement cannot order)."""
    by = {r["layout"]: r for r in rows}
    order = [r["layout"] for r in sorted(rows, key=lambda r: -r["predicted_tokens_s"])]
    out = []
    for i, a in enumerate(order):
        for b in order[i + 1:]:
            if a not in top_p:
                continue
            ta, tb = by[a]["measured_step_ms"], by[b]["measured_step_ms"]
            if tb < ta and ta / tb - 1.0 > max(noise[a], noise[b]):
                out.append([a, b])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--only", nargs="*", default=None, help="model sizes whose name contains these")
    args = p.parse_args()
    results = {}
    agree = agree_noise = 0
    sizes = {k: v for k, v in SIZES.items() if not args.only or any(o in k for o in args.only)}
    for size, model in sizes.items():
        with tempfile.TemporaryDirectory() as tmp:
            profile = calibrate(model + COMMON, 2, Path(tmp) / "profile.json")
        passes = {name: [] for name in LAYOUTS}  # each pass's fastest step
        for _ in range(args.passes):
            for name, flags in LAYOUTS.items():
                measured = run_example(model + COMMON + flags, 2, args.iters)
                if measured.get("failed"):
                    print(f"{size} {name}: run failed\n{measured['log']}", file=sys.stderr)
                    continue
                passes[name].append(min(measured["step_ms"][1:]))
        fastest = {name: min(v, default=float("inf")) for name, v in passes.items()}
        # the measurement's own noise: how far one layout's passes differ from each other
        noise = {name: (max(v) / min(v) - 1.0) if len(v) > 1 else 0.0 for name, v in passes.items()}
        tokens = 4 * int(model[model.index("--seq-length") + 1])
        rows = []
        for name, flags in LAYOUTS.items():
            planned = predict(model + COMMON + flags, 2, profile)
            # the same profile read at its median repeats (speed.py: the fastest are the default)
            alt = predict(model + COMMON + flags, 2, {**profile, "estimate": "median"})
            ms = fastest[name]
            rows.append({"layout": name, "predicted_tokens_s": planned.speed.tokens_per_s,
                         "measured_tokens_s": tokens / (ms / 1e3), "predicted_step_ms": planned.speed.step_ms,
                         "measured_step_ms": ms, "error": planned.speed.step_ms / ms - 1.0,
                         "measured_passes_ms": passes[name], "measured_noise": noise[name],
                         "predicted_median_step_ms": alt.speed.step_ms,
                         "predicted_median_tokens_s": alt.speed.tokens_per_s, "load_avg_1m": os.getloadavg()[0],
                         "breakdown": planned.speed.as_dict()})
            r = rows[-1]
            print(f"{size:20s} {name:12s} predicted {r['predicted_tokens_s']:8.0f} tokens/s "
                  f"({r['predicted_step_ms']:7.1f} ms)  measured {r['measured_tokens_s']:8.0f} tokens/s "
                  f"({r['measured_step_ms']:7.1f} ms, passes differ {r['measured_noise']:5.1%})  "
                  f"{r['error']:+6.1%}  [median-repeat estimate {r['predicted_median_step_ms']:7.1f} ms "
                  f"{r['predicted_median_step_ms'] / ms - 1.0:+6.1%}]  load {r['load_avg_1m']:.2f}", flush=True)
        top_p = [r["layout"] for r in sorted(rows, key=lambda r: -r["predicted_tokens_s"])][:3]
        top_m = [r["layout"] for r in sorted(rows, key=lambda r: -r["measured_tokens_s"])][:3]
        top_alt = [r["layout"] for r in sorted(rows, key=lambda r: -r["predicted_median_tokens_s"])][:3]
        same = top_p == top_m
        agree += same
        inversions = _inversions(rows, top_p, noise)
        agree_noise += not inversions
        print(f"{size}: top 3 predicted {top_p}, measured {top_m}: {'same' if same else 'different'}; "
              f"inversions beyond the passes' spread: {inversions or 'none'}; "
              f"calibration {profile['seconds']:.0f} s; median-repeat estimate's top 3 {top_alt}: "
              f"{'same' if top_alt == top_m else 'different'}\n", flush=True)
        results[size] = {"rows": rows, "top_predicted": top_p, "top_measured": top_m, "same": same,
                         "inversions_beyond_noise": inversions, "calibration_s": profile["seconds"]}
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_rank.json").write_text(json.dumps(results, indent=2))
    within = [abs(r["error"]) <= 0.25 for res in results.values() for r in res["rows"]]
    print(f"top-3 ranking matches in {agree} of {len(sizes)} model sizes (in {agree_noise} when layouts whose "
          f"measured times differ less than their passes do count as tied); step time within 25% in "
          f"{sum(within)} of {len(within)} layouts")
    return 0 if agree >= 2 else 1


if __name__ == "__main__":
    sys.exit(main())
