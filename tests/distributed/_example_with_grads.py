"""Run examples/pretrain_gpt.py unchanged, saving every parameter's gradient of the first step.

`--grads-out PATH`: just before the first optimizer step (Megatron's finalize_model_grads has
reduced the gradients over DP x CP by then), each rank writes {name: main_grad} with its TP
and CP rank to `PATH.rank<N>` (torch.save); after the run, the attention kernel calls and the
CP counters go to `PATH.json.rank<N>`: the parity tests compare gradients and prove the path.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "tools"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples"))


def _install(out: str) -> None:
    import torch
    from gpt_example import train

    build = train.build_optimizer

    def build_optimizer(args, model):
        optimizer, scheduler = build(args, model)
        step = optimizer.step
        state = {"saved": False}

        def first_step_saves(*a, **k):
            if not state["saved"]:
                from megatron.core import parallel_state as mpu

                grads = {}
                for i, chunk in enumerate(model):
                    for name, p in chunk.named_parameters():
                        g = getattr(p, "main_grad", None)
                        grads[f"{i}.{name}"] = (g if g is not None else p.grad).detach().float().clone()
                torch.save({"tp_rank": mpu.get_tensor_model_parallel_rank(),
                            "cp_rank": mpu.get_context_parallel_rank(), "grads": grads},
                           f"{out}.rank{os.environ.get('RANK', '0')}")
                state["saved"] = True
            return step(*a, **k)

        optimizer.step = first_step_saves
        return optimizer, scheduler

    train.build_optimizer = build_optimizer


def _collect() -> dict:
    from npuspeed import telemetry
    from npuspeed.features.fused_attention.forward import attention_calls

    return {"attention": attention_calls(), "cp": telemetry.snapshot("cp.")}


if __name__ == "__main__":
    import npuspeed.megatron_adaptor  # noqa: F401  (before megatron, as the example does)
    from launch import run_then_dump

    argv = sys.argv[1:]
    i = argv.index("--grads-out")
    out = argv[i + 1]
    del argv[i:i + 2]
    _install(out)
    sys.argv = [sys.argv[0], *argv, "--counters-out", out + ".json"]
    run_then_dump("--counters-out", _collect)
