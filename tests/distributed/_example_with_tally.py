"""Run examples/pretrain_gpt.py unchanged, then write which fused-op implementations ran on
this rank to `--tally-json PATH.rank<N>` (the e2e test's proof that the C++ path ran)."""
import json
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "pretrain_gpt.py")

if __name__ == "__main__":
    argv = sys.argv[1:]
    i = argv.index("--tally-json")
    tally = argv[i + 1]
    del argv[i:i + 2]
    sys.argv = [EXAMPLE, *argv]
    runpy.run_path(EXAMPLE, run_name="__main__")
    from npuspeed.ops import _dispatch

    with open(f"{tally}.rank{os.environ.get('RANK', '0')}", "w") as fh:
        json.dump({f"{op}:{impl}": n for (op, impl), n in _dispatch.CALLS.items()}, fh)
