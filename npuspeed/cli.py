"""The `npuspeed` command: `npuspeed report [--json] [--measure-peak] [feature flags ...]`,
`npuspeed patch-source DIR [--dry-run]` (prepare a Megatron-LM checkout),
`npuspeed plan [training flags]` (predict memory and speed, search layouts),
`npuspeed compare A B` (where two dumped runs part) and
`npuspeed convert hf-to-megatron|megatron-to-hf ...` (Hugging Face checkpoints in and out)."""
from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:  # its own parser: a training run's flags pass through it
        from npuspeed.plan.cli import main as plan_main

        return plan_main(argv[1:])
    if argv[:1] == ["convert"]:  # its own parser with one sub-command per direction
        from npuspeed.convert.cli import main as convert_main

        return convert_main(argv[1:])
    if argv[:1] == ["compare"]:  # two dumped runs (--npuspeed-dump): where they part
        from npuspeed.compare.cli import main as compare_main

        return compare_main(argv[1:])
    parser = argparse.ArgumentParser(prog="npuspeed", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("plan", help="predict per-rank memory and step time of a run's flags; --search "
                   "layouts; --calibrate this machine (npuspeed plan --help)")
    sub.add_parser("convert", help="Hugging Face checkpoints to Megatron ones and back "
                   "(npuspeed convert --help)")
    sub.add_parser("compare", help="where two runs dumped with --npuspeed-dump part: losses, then the first "
                   "module forward and backward beyond the dtypes' tolerance (npuspeed compare --help)")
    rep = sub.add_parser("report", help="device, features, patches and ops that apply here")
    rep.add_argument("--json", action="store_true", help="machine-readable output")
    rep.add_argument("--patches", action="store_true", help="list every patch target (about 80 rows) "
                     "instead of one line counting them")
    rep.add_argument("--run", metavar="SUMMARY", default=None, help="the report of a finished run: the "
                     "--summary-json the example wrote (its features, paths chosen, counters, speed, memory)")
    rep.add_argument("--baseline", metavar="SUMMARY", default=None, help="with --run: a run of the same "
                     "model without the flags; prints tokens/s and peak memory against it")
    rep.add_argument("--measure-peak", action="store_true", help="time a large bf16 GEMM on the device and "
                     "report its TFLOP/s (measured_peak_tflops; a peak for the example's --device-peak-tflops)")
    src = sub.add_parser("patch-source", help="add the npuspeed import line to a Megatron-LM "
                         "checkout's entry scripts and apply its source patches (idempotent)")
    src.add_argument("dir", help="the Megatron-LM checkout (its root, holding pretrain_gpt.py)")
    src.add_argument("--dry-run", action="store_true", help="say what would change, change nothing")
    src.add_argument("--patches-dir", default=None, help="where <tag>/*.patch live (default: "
                     "the patches/ folder next to the npuspeed package)")
    args, rest = parser.parse_known_args(argv)
    if args.command == "patch-source":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return _patch_source(args)
    if args.command == "report" and (args.run or args.baseline):
        return _run_report(parser, args, rest)
    if args.command == "report":
        from npuspeed import runtime
        from npuspeed.errors import exit_on_user_error
        from npuspeed.reporting import collect, render

        with exit_on_user_error():
            from npuspeed.plan.adaptive import expand  # the policy a run with these flags would apply

            runtime.initialize(expand(rest)[0])
        data = collect(measure_peak=args.measure_peak)
        print(json.dumps(data, indent=2, default=str) if args.json else render(data, patches=args.patches))
        return 0
    return 2


def _run_report(parser, args, rest) -> int:
    """`npuspeed report --run SUMMARY [--baseline SUMMARY]`: a finished run's own report."""
    from npuspeed import run_report
    from npuspeed.errors import exit_on_user_error

    if not args.run:
        parser.error("--baseline needs --run SUMMARY (the run to compare with it)")
    if rest or args.measure_peak:
        parser.error("--run reads a finished run's summary: it takes no feature flags and no --measure-peak")
    with exit_on_user_error():
        run = run_report.load(args.run, "--run")
        base = run_report.load(args.baseline, "--baseline") if args.baseline else None
        if args.json:
            print(json.dumps({"report": run.get("npuspeed_report"), "comparison": run_report.comparison(run, base)},
                             indent=2, default=str))
        else:
            print(run_report.render(run, base, patches=args.patches))
    return 0


def _patch_source(args) -> int:
    from npuspeed.features.megatron_lm.source_patch import PatchSourceError, patch_source

    try:
        result = patch_source(args.dir, args.patches_dir, dry_run=args.dry_run)
    except PatchSourceError as exc:
        print(f"npuspeed patch-source: {exc}", file=sys.stderr)
        return 2
    print("\n".join(result.lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
