"""`--deterministic-mode` (Megatron-LM's flag): the same run twice gives the same bits, on
every backend, so a run can be reproduced and a save/resume continues bit for bit.

Set before any device work (the adaptor runs before the model exists): deterministic torch
algorithms, cuDNN without autotuning, cuBLAS's fixed workspace (`CUBLAS_WORKSPACE_CONFIG`,
read when its handle is created), and the collective library's deterministic reduction order
(`NCCL_ALGO=Ring` as Megatron-LM asks for; `HCCL_DETERMINISTIC=true` on Ascend). An
environment value the user set is kept. npuspeed's own kernels ask `enabled()`: attention on
CUDA is restricted to kernels with a deterministic backward (flash, math), and a block kernel
without one is refused with the fix.
"""
from __future__ import annotations

import os

import torch

ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
COLLECTIVE_ENV = {"nccl": {"NCCL_ALGO": "Ring"}, "hccl": {"HCCL_DETERMINISTIC": "true"}}


def apply(ctx) -> None:
    """Turn determinism on when the command line says `--deterministic-mode`."""
    if not getattr(ctx.megatron, "deterministic_mode", None):
        return
    env = {**ENV, **COLLECTIVE_ENV.get(ctx.accelerator.dist_backend, {})}
    kept = {k: os.environ[k] for k in env if k in os.environ and os.environ[k] != env[k]}
    for key, value in env.items():
        os.environ.setdefault(key, value)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    settings = ", ".join(f"{k}={os.environ[k]}" for k in env)
    ctx.note(f"--deterministic-mode: deterministic algorithms, {settings}"
             + (f" (kept the environment's {', '.join(kept)})" if kept else ""))


def enabled() -> bool:
    return torch.are_deterministic_algorithms_enabled()
