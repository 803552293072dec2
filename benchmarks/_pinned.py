"""Runs the example with this rank pinned to one core (LOCAL_RANK modulo the cores): no
migration between cores mid-step, which on a small host adds jitter to each op's time.

    torchrun ... benchmarks/_pinned.py <example args>
"""
import os
import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[int(os.environ.get("LOCAL_RANK", "0")) % len(cores)]})
    example = Path(__file__).resolve().parents[1] / "examples" / "pretrain_gpt.py"
    sys.argv[0] = str(example)
    runpy.run_path(str(example), run_name="__main__")
