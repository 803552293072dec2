"""--swap-attention in `npuspeed plan`: the chosen modules' saved activations live in host memory
between forward and backward; where the host is the device that frees nothing, so no slot moves."""
from __future__ import annotations


def effect(model, config):
    from npuspeed.accelerator.devices import for_device
    from npuspeed.features.base import PlanEffect
    from npuspeed.features.swap_attention.modules import MAIN, parse_modules

    names = parse_modules(config.swap_modules)
    if for_device(model.device).host_is_device():
        return PlanEffect(summary=f"{MAIN}: saved activations of {', '.join(names)} copied to host memory; the "
                                  "host is the device here: nothing leaves it")
    return PlanEffect(swap_modules=tuple(names),
                      summary=f"{MAIN}: saved activations of {', '.join(names)} kept in host memory between "
                              "forward and backward; on the device: the layer in backward and the one fetched "
                              "ahead" + ("" if config.swap_attention_mode == "whole" else
                                         " (counted for every layer; mode hidden swaps only the layers whose copies "
                                         "the measured link hides, decided in the run's first passes)"))
