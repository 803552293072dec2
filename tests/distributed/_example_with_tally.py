"""Run examples/pretrain_gpt.py unchanged, then write which fused-op implementations ran on
this rank to `--tally-json PATH.rank<N>` (the e2e test's proof that the C++ path ran)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))


def _tally() -> dict:
    from npuspeed.ops import _dispatch

    return {f"{op}:{impl}": n for (op, impl), n in _dispatch.calls().items()}


if __name__ == "__main__":
    from launch import run_then_dump

    run_then_dump("--tally-json", _tally)
