"""Run examples/pretrain_gpt.py unchanged with one fault injected, chosen by NPUSPEED_TEST_FAULT:

- `kill-in-step:R:C`  rank R SIGKILLs itself at the start of its C-th forward micro-batch;
- `kill-in-first-attempt:R:C`  the same in torchrun's first attempt only (TORCHELASTIC_RESTART_COUNT
  0): the restarted workers run clean;
- `stop-in-step:R:C`  rank R SIGSTOPs itself there (a hung peer, alive but silent);
- `kill-in-save:R:I`  rank R dies while writing the checkpoint of iteration I: its shard
  writer (a forked child of the rank) writes the first item, flushes, then SIGKILLs the rank
  and itself, leaving a truncated shard and no index;
- `nan-at:C`          every rank's C-th forward micro-batch has a NaN loss;
- `nangrad-at:C`      ... a finite loss whose gradient is NaN (a backward hook).
"""
import functools
import os
import runpy
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "pretrain_gpt.py")
sys.path.insert(0, os.path.dirname(EXAMPLE))

kind, *params = os.environ["NPUSPEED_TEST_FAULT"].split(":")
params = [int(p) for p in params]
if kind == "kill-in-first-attempt":
    kind = "kill-in-step" if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" else "none"
rank = int(os.environ.get("RANK", "0"))
RANK_PID = os.getpid()  # the rank itself: megatron-core 0.19 writes shards in this process, not a fork
calls = 0

import torch  # noqa: E402,F401

import npuspeed.megatron_adaptor  # noqa: E402,F401
from gpt_example import checkpoint, train  # noqa: E402

if kind in ("kill-in-step", "stop-in-step", "nan-at", "nangrad-at"):
    forward_step = train.forward_step

    def faulty_forward_step(data_iterator, model, **kwargs):
        global calls
        calls += 1
        if kind in ("nan-at", "nangrad-at"):
            output, loss_fn = forward_step(data_iterator, model, **kwargs)
            if calls == params[0] and kind == "nan-at":
                output = output * float("nan")
            elif calls == params[0]:
                output.register_hook(lambda grad: grad * float("nan"))
            return output, loss_fn
        if rank == params[0] and calls == params[1]:
            os.kill(os.getpid(), signal.SIGKILL if kind == "kill-in-step" else signal.SIGSTOP)
        return forward_step(data_iterator, model, **kwargs)

    train.forward_step = faulty_forward_step

if kind == "kill-in-save":
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    armed = False
    save, write_item = checkpoint.save, filesystem_async._write_item

    def faulty_save(root, iteration, *args, **kwargs):
        global armed
        armed = rank == params[0] and iteration == params[1]  # inherited by the forked writers
        return save(root, iteration, *args, **kwargs)

    @functools.wraps(write_item)  # megatron inspects its signature
    def faulty_write_item(*args, **kwargs):
        result = write_item(*args, **kwargs)
        if armed:
            for arg in args:
                if hasattr(arg, "flush"):
                    arg.flush()
            if os.getpid() != RANK_PID:  # a writer forked by the rank (0.12-0.16): the rank first
                os.kill(RANK_PID, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    checkpoint.save = faulty_save
    filesystem_async._write_item = faulty_write_item

sys.argv = [EXAMPLE, *sys.argv[1:]]
runpy.run_path(EXAMPLE, run_name="__main__")
