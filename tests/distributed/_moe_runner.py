"""Run examples/pretrain_gpt.py unchanged, then save what the MoE tests compare to
`--moe-dump PATH.rank<N>` (torch.save): this rank's telemetry counters (`counters`), and the
gradients of the expert weights that the first optimizer step applies (`grads`: global name of the
SequentialMLP weight -> (expert-TP rank, gradient in SequentialMLP's orientation)), so runs
with SequentialMLP and GroupedMLP, and different layouts, compare weight by weight."""
from __future__ import annotations

import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
EXAMPLE = os.path.join(ROOT, "examples", "pretrain_gpt.py")


def _expert_grads(chunks, info) -> dict:
    from npuspeed.convert.layout import global_name as _global_name

    local, ep_rank, etp_rank = info["num_local"], info["ep_rank"], info["etp_rank"]
    grads = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            grad = getattr(param, "main_grad", None)
            if grad is None:
                continue
            gname = _global_name(name, chunk, local, ep_rank)
            if ".local_experts." in gname:
                grads[gname] = (etp_rank, grad.detach().float().clone())
            elif gname.endswith((".experts.weight1", ".experts.weight2")):
                fc1 = gname.endswith("weight1")
                hidden = grad.shape[0] if fc1 else grad.shape[1]
                view = grad.view(local, hidden, -1) if fc1 else grad.view(local, -1, hidden)
                for i in range(local):
                    key = gname.replace(".experts.weight1" if fc1 else ".experts.weight2",
                                        f".experts.local_experts.{ep_rank * local + i}.linear_fc{1 if fc1 else 2}.weight")
                    grads[key] = (etp_rank, view[i].t().float().clone())
    return grads


def main() -> None:
    argv = sys.argv[1:]
    i = argv.index("--moe-dump")
    out = argv[i + 1]
    del argv[i:i + 2]
    sys.argv = [EXAMPLE, *argv]
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import torch
    import npuspeed.megatron_adaptor  # noqa: F401  (the example's first import, with its argv)

    from gpt_example import train

    from npuspeed import telemetry

    captured = {}
    original = train.initialize_by_global_name

    def capture(chunks, args, config):
        from megatron.core import parallel_state as mpu

        original(chunks, args, config)
        captured.update(chunks=chunks, info=dict(
            num_local=(args.num_experts or 0) // mpu.get_expert_model_parallel_world_size(),
            ep_rank=mpu.get_expert_model_parallel_rank(), etp_rank=mpu.get_expert_tensor_parallel_rank(),
            ep_size=mpu.get_expert_model_parallel_world_size(),
            etp_size=mpu.get_expert_tensor_parallel_world_size()))

    build_optimizer = train.build_optimizer

    def first_step_grads(args, model):
        optimizer, scheduler = build_optimizer(args, model)
        step = optimizer.step

        def step_once_recorded(*a, **kw):  # the gradients the first step applies
            if "grads" not in captured:
                captured["grads"] = _expert_grads(captured["chunks"], captured["info"])
            return step(*a, **kw)

        optimizer.step = step_once_recorded
        return optimizer, scheduler

    train.initialize_by_global_name = capture
    train.build_optimizer = first_step_grads
    runpy.run_path(EXAMPLE, run_name="__main__")
    torch.save({"counters": telemetry.snapshot(), "info": captured.get("info"), "grads": captured.get("grads", {})},
               f"{out}.rank{os.environ.get('RANK', '0')}")


if __name__ == "__main__":
    main()
