"""Run examples/pretrain_gpt.py unchanged, then write which attention kernels ran on this rank
(and why) to `--attention-json PATH.rank<N>`: the e2e tests' proof of path."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))


def _collect() -> dict:
    from npuspeed.features.fused_attention.forward import attention_calls

    return attention_calls()


if __name__ == "__main__":
    from launch import run_then_dump

    run_then_dump("--attention-json", _collect)
