"""What --swap-optimizer moves and how (its flag names, the chunk size, whether the copies run
here): shared by the feature, its patches and its plan effect."""
from __future__ import annotations

import os

from npuspeed.accelerator.devices import for_device
from npuspeed.features.base import FeatureError
from npuspeed.patching.versions import importable

FLAG, CHUNK, MODE = "--swap-optimizer", "--swap-optimizer-chunk-mb", "--swap-optimizer-mode"
OFFLOAD, FRACTION = "--optimizer-cpu-offload", "--optimizer-offload-fraction"
#: chunks the device holds at once in a step: one coming in, one updating, one going out
WINDOW_CHUNKS = 3
#: `run`: move the states even where the host is the device (tests); unset or `auto`: move them
#: only off a device
ENV = "NPUSPEED_SWAP_OPTIMIZER"


def host_is_device(acc) -> bool:
    """The accelerator's answer; a planned device (`npuspeed plan --npuspeed-device cuda`) is
    an accelerator with its own memory unless it is the CPU."""
    ask = getattr(acc, "host_is_device", None)
    return ask() if ask is not None else for_device(getattr(acc, "name", "cpu")).host_is_device()


def moves(acc) -> bool:
    """Whether the swap's copies run: always on a device; where the host is the device only when
    NPUSPEED_SWAP_OPTIMIZER=run asks for the mechanics (they would cost time and free nothing)."""
    value = (os.environ.get(ENV) or "auto").strip().lower()
    if value not in ("auto", "run"):
        raise FeatureError(f"{ENV}={value!r} is not understood: use 'run' (copy the states even where the host is "
                           f"the device) or leave it unset")
    return value == "run" or not host_is_device(acc)


def parse_mode(raw: str | None) -> str:
    """--swap-optimizer-mode: hidden (default: move only the chunks whose copies the host link
    hides behind the update) or whole (every chunk, whatever it costs; the cost is stated)."""
    from npuspeed.offload.sizing import MODES

    mode = (raw or "hidden").strip().lower()
    if mode not in MODES:
        raise FeatureError(f"{MODE} {raw!r}: give hidden (move only the chunks whose copies the host link hides "
                           "behind the optimizer step; the default) or whole (move every chunk, at the cost the log "
                           "states)")
    return mode


def chunk_bytes(config) -> int:
    """Bytes of one chunk (--swap-optimizer-chunk-mb)."""
    return int(float(config.swap_optimizer_chunk_mb) * 2**20)


def te_installed() -> bool:
    return importable("transformer_engine")
