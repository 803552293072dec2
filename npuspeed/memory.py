"""Memory accounting shared by the example and the benchmarks."""
from __future__ import annotations



def _optimizers(optimizer):
    chained = getattr(optimizer, "chained_optimizers", None)
    return list(chained) if chained is not None else [optimizer]


def weight_bytes(model_chunks, optimizer) -> int:
    """Bytes of model parameters plus fp32 master weights, each storage counted once.

    Counts what is allocated now: masters shared with bf16 parameters by
    `--reuse-fp32-param` count as their residual buffers only.
    """
    storages = {}

    def add(storage):
        if storage.nbytes():
            storages[storage.data_ptr()] = storage.nbytes()

    for chunk in model_chunks:
        for param in chunk.parameters():
            add(param.untyped_storage())
    for opt in _optimizers(optimizer):
        for group in getattr(opt, "param_groups", []):
            for param in group["params"]:
                add(param.untyped_storage())
        shared = getattr(opt, "_npuspeed_shared_masters", None)
        if shared is not None:
            for storage in shared.storages():
                add(storage)
    return sum(storages.values())


__all__ = ["weight_bytes"]
