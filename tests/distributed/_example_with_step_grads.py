"""Run examples/pretrain_gpt.py unchanged, saving every step's gradients and the final weights.

`--step-grads-out PATH`: before each optimizer step each rank appends {name: main_grad} (after
Megatron's finalize_model_grads) and, after the run, writes {"grads": [per step], "params":
{name: weight}, "counters": npuspeed's counters} to `PATH.rank<N>` (torch.save). The
forward/backward overlap tests compare runs step by step with these.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "tools"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples"))


def _named(model, attr=None):
    out = {}
    for i, chunk in enumerate(model):
        for name, p in chunk.named_parameters():
            t = p if attr is None else (getattr(p, attr, None) if getattr(p, attr, None) is not None else p.grad)
            out[f"{i}.{name}"] = t.detach().float().clone()
    return out


def main() -> None:
    import runpy

    import torch

    import npuspeed.megatron_adaptor  # noqa: F401  (before megatron, as the example does)
    from gpt_example import train

    from npuspeed import telemetry

    argv = sys.argv[1:]
    i = argv.index("--step-grads-out")
    out = argv[i + 1]
    del argv[i:i + 2]
    seen = {"grads": [], "model": None}
    build = train.build_optimizer

    def build_optimizer(args, model):
        optimizer, scheduler = build(args, model)
        step = optimizer.step
        seen["model"] = model

        def step_saves(*a, **k):
            seen["grads"].append(_named(model, "main_grad"))
            return step(*a, **k)

        optimizer.step = step_saves
        return optimizer, scheduler

    train.build_optimizer = build_optimizer
    example = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "pretrain_gpt.py")
    sys.argv = [example, *argv]
    runpy.run_path(example, run_name="__main__")
    torch.save({"grads": seen["grads"], "params": _named(seen["model"]), "counters": telemetry.snapshot()},
               f"{out}.rank{os.environ.get('RANK', '0')}")


if __name__ == "__main__":
    main()
