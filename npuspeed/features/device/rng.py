"""Megatron's model-parallel RNG tracker on an accelerator without `torch.cuda`.

Megatron reads and writes "the CUDA generator" through `_get_cuda_rng_state` /
`_set_cuda_rng_state` (whose CPU-build path silently queues the call in `_lazy_call`)
and forks it for dropout in tensor-parallel regions. Here both go to the accelerator,
and `fork` is re-implemented without upstream's check that the CPU generator did not
move: on the CPU backend the device generator IS swapped into the CPU one, so that
check would fire on every dropout.
"""
from __future__ import annotations

import contextlib

from npuspeed.accelerator import get_accelerator
from npuspeed.patching.wrappers import within

_RANDOM = "megatron.core.tensor_parallel.random"
_DEFAULT = "default-rng"


def get_rng_state(*_args, **_kwargs):
    return get_accelerator().get_rng_state()


def set_rng_state(new_state, *_args, **_kwargs) -> None:
    get_accelerator().set_rng_state(new_state)


@contextlib.contextmanager
def fork(self, name=None):
    """Run the body on the tracked state `name`, then put the outer state back."""
    if name is None:
        from megatron.core.tensor_parallel import random as mrandom

        name = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME
    if name not in self.states_:
        raise Exception(f"cuda rng state {name} is not added")
    acc = get_accelerator()
    # The device scope makes the body draw from the device generator even when fork is
    # entered outside a schedule (a direct forward call); inside one it is a no-op.
    with acc.device_rng_scope():
        outer_name = getattr(self, "_current_state_name", _DEFAULT)
        outer_state = acc.get_rng_state()
        if outer_name != _DEFAULT:
            self.states_[outer_name] = outer_state
        acc.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = acc.get_rng_state()
            if outer_name != _DEFAULT:
                outer_state = self.states_[outer_name]
            acc.set_rng_state(outer_state)
            self._current_state_name = outer_name


#: Wrapper: run a schedule with the device's own random state swapped in.
in_device_rng_scope = within(lambda: get_accelerator().device_rng_scope())


def register(registry, feature: str) -> None:
    registry.register(f"{_RANDOM}._get_cuda_rng_state", get_rng_state, feature=feature)
    registry.register(f"{_RANDOM}._set_cuda_rng_state", set_rng_state, feature=feature)
    registry.register(f"{_RANDOM}.CudaRNGStatesTracker.fork", fork, feature=feature)
