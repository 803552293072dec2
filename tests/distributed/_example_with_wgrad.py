"""Run examples/pretrain_gpt.py unchanged, then write the gradient-accumulation-fusion
counters and per-shape path choices of this rank to `--wgrad-json PATH.rank<N>`."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))


def _collect() -> dict:
    from npuspeed import runtime, telemetry

    choices = {}
    for feature, _on in runtime.state().features:
        chooser = getattr(feature, "chooser", None)
        if feature.name == "grad_accum_fusion" and chooser is not None:
            choices = {"|".join(map(str, key)): record["path"] for key, record in chooser.choices.items()}
    return {"counters": telemetry.snapshot("grad_accum_fusion."), "choices": choices}


if __name__ == "__main__":
    from launch import run_then_dump

    run_then_dump("--wgrad-json", _collect)
