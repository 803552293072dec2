"""Run-time failures of a multi-rank run, each said in one line with what to do next.

- A peer that died (SIGKILL, OOM killer, a lost node) or stopped answering: the next
  collective raises on every other rank, at once when the peer's sockets closed, after
  `--distributed-timeout-minutes` (default: torch.distributed's) when it hangs. Each
  surviving rank prints which iteration failed and which checkpoint a restart resumes
  from, then leaves with os._exit(1): interpreter shutdown could wait on a collective,
  a DataLoader worker or a checkpoint writer of the broken group, and must not.
- A non-finite loss or gradient with --check-for-nan-in-loss-and-grad (Megatron-LM's flag,
  on by default, off for fp16 where the loss scaler skips the step instead): megatron.core
  refuses the bucket before the data-parallel reduction, the example refuses the loss, and
  the run stops before the bad step reaches the weights or a checkpoint.
NPUSPEED_DEBUG=1 re-raises instead, for the traceback.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys

from npuspeed.errors import UserError, debug, one_line, print_error, rank

EXIT_FAILED = 1
#: Transport errors of gloo / NCCL / HCCL / the TCP store when a peer is gone or silent.
_PEER_SIGNS = ("connection reset by peer", "connection closed by peer", "connection refused",
               "timed out", "timeout", "broken pipe", "socket", "gloo/transport", "nccl", "hccl",
               "remote worker", "watchdog", "peer")


class NonFiniteError(RuntimeError):
    """A loss or gradient that is NaN or infinite under --check-for-nan-in-loss-and-grad."""


class Progress:
    """Where the run is, for the message: iterations done, and whether it is saving."""

    def __init__(self, args):
        self.args = args
        self.iteration = 0
        self.saving = False

    def where(self) -> str:
        doing = (f"while saving the checkpoint of iteration {self.iteration}" if self.saving
                 else f"iteration {self.iteration + 1}")
        return f"rank {rank()}: {doing}"


def check_for_nan(args) -> bool:
    """Megatron-LM's --check-for-nan-in-loss-and-grad; off under fp16's dynamic loss scaling."""
    return bool(args.check_for_nan_in_loss_and_grad and not args.fp16)


def report_nonfinite(it: int, loss: float, grad_norm, ok: bool, optimizer) -> bool:
    """One line per iteration whose loss or gradient is not finite; True when there was one."""
    problems = []
    if not math.isfinite(loss):
        problems.append(f"lm loss is {loss}")
    if grad_norm is not None and not math.isfinite(grad_norm):
        problems.append(f"grad norm is {grad_norm}")
    if not ok:
        problems.append("gradients are not finite: step skipped, loss scale now "
                        f"{float(optimizer.get_loss_scale()):g}")
    if problems and rank() == 0:
        print(f"WARNING: iteration {it}: " + "; ".join(problems), flush=True)
    return bool(problems)


def is_peer_failure(exc: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(sign in text for sign in _PEER_SIGNS)


def _is_nonfinite(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, NonFiniteError) or (
        isinstance(exc, RuntimeError) and "Unexpected result" in text and ("found NaN" in text or "found Inf" in text))


def resume_hint(args) -> str:
    if not args.save:
        return "no --save directory was given, so nothing can be resumed (add --save DIR --save-interval N)"
    from gpt_example import ckpt_verify

    try:
        done = ckpt_verify.complete_iterations(args.save)
    except OSError:
        done = []
    if not done:
        return f"no checkpoint was completed in {args.save}"
    return f"the last complete checkpoint is iteration {done[-1]} in {args.save}: restart with --load {args.save}"


def _timeout(args) -> str:
    minutes = getattr(args, "distributed_timeout_minutes", None)
    return "torch.distributed's default" if minutes is None else f"{minutes * 60:g} s"


def end_children() -> None:
    """Stop this process's multiprocessing children (dist_checkpointing's spawned result-queue
    manager, DataLoader workers): os._exit skips the atexit hooks that would, and a manager
    outlives its parent."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=5)


def _leave(message: str) -> None:
    print_error(message, all_ranks=True)
    sys.stderr.flush()
    end_children()
    os._exit(EXIT_FAILED)


@contextlib.contextmanager
def stop_cleanly(progress: Progress):
    """Around the training loop: a lost peer or a refused non-finite value ends the process."""
    try:
        yield
    except UserError:
        raise
    except Exception as exc:
        if debug():
            raise
        where = progress.where()
        cause = one_line(exc)[:300]
        if _is_nonfinite(exc):
            if "message='" in cause:  # megatron.core's "Rank r, node n, device d, iteration 0: ... (message='...')"
                cause = cause.split("message='", 1)[1].rsplit("'", 1)[0]
            _leave(f"{where}: {cause}; the step was not applied (--check-for-nan-in-loss-and-grad). Lower --lr "
                   f"or check the data; {resume_hint(progress.args)}")
        if progress.saving and not is_peer_failure(exc):  # a full disk, a vanished directory, ...
            _leave(f"{where}: the save failed [{cause}]; nothing was renamed into place, so "
                   f"{resume_hint(progress.args)}")
        if is_peer_failure(exc):
            _leave(f"{where}: a collective failed because another rank died or did not answer within the "
                   f"timeout ({_timeout(progress.args)}, --distributed-timeout-minutes) [{cause}]; "
                   f"{resume_hint(progress.args)}")
        raise
