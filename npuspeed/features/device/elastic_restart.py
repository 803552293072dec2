"""Elastic restarts under torchrun's default launch: each restart's rendezvous keys kept apart.

`torchrun --nproc-per-node N --max-restarts K --master-port P` keeps one TCPStore (the agent's)
for every attempt, and `init_process_group` puts the default group's keys under the same
`default_pg/` prefix each time. A restarted worker's gloo `connectFullMesh` can then read the
dead attempt's addresses and fail with "Connection refused" (measured with torch 2.13 and a
ten-line script; pytorch issue 135712 describes the shared store's part), so a killed worker
never resumes. torchrun numbers its attempts in TORCHELASTIC_RESTART_COUNT, the same on every
worker of one attempt: from the first restart on, the store `init_process_group` would make from
the environment is wrapped in a PrefixStore named for the attempt, and every key of the default
group and of the groups made from it (Megatron's TP/PP/DP/EP groups) is that attempt's own. The
first attempt, and any launch that is not a torchelastic restart or that passes its own store or
a non-env `init_method`, runs torch's code untouched.
"""
from __future__ import annotations

import functools
import logging
import os

log = logging.getLogger("npuspeed")
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"


def restart_count(environ=None) -> int:
    """torchrun's attempt number (0 for the first attempt or outside torchrun)."""
    environ = os.environ if environ is None else environ
    try:
        return int(environ.get(RESTART_ENV, "0") or 0)
    except ValueError:
        return 0


def prefix(count: int) -> str:
    return f"npuspeed_restart_{count}"


def per_restart_store(fn):
    """init_process_group that, on a torchelastic restart with the env:// rendezvous, makes the
    rendezvous store itself and hands torch a PrefixStore named for the attempt."""

    @functools.wraps(fn)
    def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1,
                           store=None, *args, **kwargs):
        count = restart_count()
        if count == 0 or store is not None or init_method not in (None, "env://"):
            return fn(backend, init_method, timeout, world_size, rank, store, *args, **kwargs)
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        wait = timeout if timeout is not None else distributed_c10d.default_pg_timeout
        base, rank, world_size = next(dist.rendezvous("env://", rank, world_size, timeout=wait))
        base.set_timeout(wait)
        log.info("npuspeed: torchelastic restart %d: process-group keys under %r in the rendezvous store",
                 count, prefix(count))
        return fn(backend, None, timeout, world_size, rank, dist.PrefixStore(prefix(count), base), *args, **kwargs)

    return init_process_group


def register(registry, feature: str) -> None:
    registry.register("torch.distributed.init_process_group", wrapper=per_restart_store, feature=feature,
                      megatron=None)
