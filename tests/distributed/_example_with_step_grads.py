"""Run examples/pretrain_gpt.py unchanged, saving every step's gradients and the final weights.

`--step-grads-out PATH`: before each optimizer step each rank appends {name: main_grad} (after
Megatron's finalize_model_grads) and, after the run, writes {"grads": [per step], "params":
{name: weight}, "counters": npuspeed's counters, "global_names": {name: layout-independent
name}, "eval": the lm losses of one more forward-only schedule call} to `PATH.rank<N>` (torch.save). The forward/backward overlap tests compare runs step by
step with these (across pipeline layouts by the global names).
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


def _global_names(model) -> dict:
    """{dump key: the layout-independent name} (global layer and expert numbers), so runs of
    different pipeline layouts compare parameter by parameter."""
    from megatron.core import parallel_state as mpu

    from npuspeed.convert.layout import global_name

    experts = getattr(seen_args, "num_experts", None) or 0
    local = experts // max(mpu.get_expert_model_parallel_world_size(), 1)
    out = {}
    for i, chunk in enumerate(model):
        inner = chunk
        while hasattr(inner, "module"):
            inner = inner.module
        prefix = chunk_prefix(chunk, inner)
        for name, _ in chunk.named_parameters():
            bare = name[len(prefix):]
            out[f"{i}.{name}"] = global_name(bare, inner, local, mpu.get_expert_model_parallel_rank())
    return out


def chunk_prefix(chunk, inner) -> str:
    for name, module in chunk.named_modules():
        if module is inner:
            return f"{name}." if name else ""
    return ""


seen_args = None


def _evaluate(seen) -> list[float]:
    """The schedule once more with forward_only=True (as Megatron-LM's evaluation calls it) on the
    next micro-batches of the same data: the 'lm loss' values this rank's schedule returned (the
    rank whose chunk computes the loss has them; the others none)."""
    import torch

    call = dict(seen["call"], forward_only=True)
    with torch.no_grad():
        store = seen["func"](**call)
    return [float(x["lm loss"]) for x in store or []]


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
        global seen_args
        seen_args = args
        optimizer, scheduler = build(args, model)
        step = optimizer.step
        seen["model"] = model

        def step_saves(*a, **k):
            seen["grads"].append(_named(model, "main_grad"))
            return step(*a, **k)

        optimizer.step = step_saves
        return optimizer, scheduler

    train.build_optimizer = build_optimizer
    get_func = train.get_forward_backward_func

    def get_forward_backward_func(*a, **k):
        func = get_func(*a, **k)

        def forward_backward(**kwargs):
            seen["call"] = kwargs  # the last training call: evaluated again, forward only, after the run
            return func(**kwargs)

        seen["func"] = func
        return forward_backward

    train.get_forward_backward_func = get_forward_backward_func
    destroy = train.mpu.destroy_model_parallel

    def evaluate_then_destroy(*a, **k):  # the example tears the groups down at its end
        seen["counters"] = telemetry.snapshot()  # the training run's (the evaluation counts too)
        seen["eval"] = _evaluate(seen)
        return destroy(*a, **k)

    train.mpu.destroy_model_parallel = evaluate_then_destroy
    example = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "pretrain_gpt.py")
    sys.argv = [example, *argv]
    runpy.run_path(example, run_name="__main__")
    torch.save({"grads": seen["grads"], "params": _named(seen["model"]), "counters": seen.get("counters") or telemetry.snapshot(),
                "global_names": _global_names(seen["model"]), "eval": seen.get("eval")},
               f"{out}.rank{os.environ.get('RANK', '0')}")


if __name__ == "__main__":
    main()
