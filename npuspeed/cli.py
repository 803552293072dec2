"""The `npuspeed` command: `npuspeed report [--json] [feature flags ...]`."""
from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="npuspeed", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="device, features, patches and ops that apply here")
    rep.add_argument("--json", action="store_true", help="machine-readable output")
    args, rest = parser.parse_known_args(argv)
    if args.command == "report":
        from npuspeed import runtime
        from npuspeed.report import collect, render

        runtime.initialize(rest)
        data = collect()
        print(json.dumps(data, indent=2, default=str) if args.json else render(data))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
