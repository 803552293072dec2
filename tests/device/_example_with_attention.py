"""Run examples/pretrain_gpt.py unchanged, then write the latest fused-attention call's details
(kernel, mask, causal, dropout_p, dtype) to `--attention-json PATH.rank<N>`: the device tier's
proof that the call ran causal and with dropout on the device kernel (the summary has the counts)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))


def _collect() -> dict:
    from npuspeed import telemetry
    from npuspeed.features.fused_attention.forward import LAST

    plain = (bool, int, float, str, list, tuple, type(None))
    return {"last": {k: v if isinstance(v, plain) else str(v) for k, v in telemetry.last(LAST).items()}}


if __name__ == "__main__":
    from launch import run_then_dump

    run_then_dump("--attention-json", _collect)
