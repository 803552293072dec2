"""Two gloo ranks as threads of this process (for the emulated MC2 collectives): no spawn, no port."""
from __future__ import annotations

import threading

import torch.distributed as dist


def two_ranks(fn, prefix: str = "contract"):
    """fn(rank, group) on two threads, each with its own gloo group of 2: {rank: result}."""
    store, out, errors = dist.HashStore(), {}, []

    def body(rank):
        try:
            out[rank] = fn(rank, dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, 2))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    if errors:
        raise errors[0]
    return out
