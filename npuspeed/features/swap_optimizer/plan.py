"""--swap-optimizer in `npuspeed plan`: Adam's states (and the fp32 masters unless
--reuse-fp32-param keeps them inside the bf16 parameters) live in host memory between steps; the
step holds a window of chunks. Where the host is the device nothing is freed."""
from __future__ import annotations


def effect(model, config):
    """None with Megatron's own --optimizer-cpu-offload (npuspeed moves nothing); the planned device:
    `model.device`; the masters move unless --reuse-fp32-param keeps them in the parameters."""
    from npuspeed.accelerator.devices import for_device
    from npuspeed.accelerator.host_link import host_link_bytes_per_s
    from npuspeed.features.base import PlanEffect
    from npuspeed.features.swap_optimizer.policy import ENV, FLAG, WINDOW_CHUNKS, chunk_bytes, host_is_device, moves

    if not config.swap_optimizer:
        return None
    name, masters = model.device, not config.reuse_fp32_param
    accelerator = for_device(name)
    what = "Adam states" + (" and fp32 masters" if masters and model.batch.dtype != "fp32" else "")
    mb = config.swap_optimizer_chunk_mb
    if host_is_device(accelerator) and not moves(accelerator):
        return PlanEffect(summary=f"{FLAG}: the host is the device on the {name} backend: {what} stay in "
                                  f"place; it frees nothing and costs nothing ({ENV}=run would copy them)")
    if host_is_device(accelerator):
        return PlanEffect(
            swap_optimizer={"frees": False, "masters": masters, "window_bytes": WINDOW_CHUNKS * chunk_bytes(config),
                            "link_bytes_per_s": host_link_bytes_per_s(name), "overlapped": False},
            summary=f"{FLAG}: {what} copied to host memory between steps; the host is the device on the "
                    f"{name} backend, so it frees nothing; the step's peak gains the chunks in flight (about "
                    f"{WINDOW_CHUNKS} of {mb:g} MiB) and the copies cost step time")
    return PlanEffect(
        swap_optimizer={"frees": True, "masters": masters, "window_bytes": WINDOW_CHUNKS * chunk_bytes(config),
                        "link_bytes_per_s": host_link_bytes_per_s(name), "overlapped": True},
        summary=f"{FLAG}: {what} in pinned host memory between steps; the step holds about {WINDOW_CHUNKS} "
                f"chunks of {mb:g} MiB (copies overlapped with the update)")
