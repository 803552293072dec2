"""Run examples/pretrain_gpt.py unchanged, then write npuspeed's fused_linear_ce counters of this
rank to `--counters-json PATH.rank<N>` (the e2e test's proof that the chunked path ran)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))


def _counters() -> dict:
    from npuspeed import telemetry

    return telemetry.snapshot("fused_linear_ce.")


if __name__ == "__main__":
    from launch import run_then_dump

    run_then_dump("--counters-json", _counters)
