"""A random-number state for the CPU "device", separate from the host's.

On a GPU, dropout draws from the device generator while the data loader draws from the
CPU one, so restoring both from a checkpoint resumes exactly. On CPU both would share
torch's one default generator. This object keeps the device's state apart and swaps it
into the default generator only while device work runs (`scope()`, entered around
Megatron's forward-backward schedules), so host code never consumes device randomness.
"""
from __future__ import annotations

import contextlib

import torch


class DeviceRNG:
    def __init__(self, seed: int = 0):
        self._parked = torch.Generator().manual_seed(seed).get_state()
        self._host_states: list[torch.Tensor] = []

    @property
    def active(self) -> bool:
        """True while the device state is swapped into torch's default generator."""
        return bool(self._host_states)

    def get_state(self) -> torch.Tensor:
        return torch.get_rng_state() if self.active else self._parked.clone()

    def set_state(self, state: torch.Tensor) -> None:
        state = state.detach().to("cpu", torch.uint8).clone()
        if self.active:
            torch.set_rng_state(state)
        else:
            self._parked = state

    def manual_seed(self, seed: int) -> None:
        self.set_state(torch.Generator().manual_seed(int(seed)).get_state())

    @contextlib.contextmanager
    def scope(self):
        """Run device work on the device's random state; re-entrant."""
        if self.active:
            yield
            return
        self._host_states.append(torch.get_rng_state())
        torch.set_rng_state(self._parked)
        try:
            yield
        finally:
            self._parked = torch.get_rng_state()
            torch.set_rng_state(self._host_states.pop())
