"""The PP-1 schedule with forward/backward overlap, made from Megatron's own loop.

Megatron's `forward_backward_no_pipelining` runs forward_step(i) then backward_step(i) for each
micro-batch. While `session` is open, the backward of micro-batch i is held back (`backward_step`
returns at once) and runs when forward_step(i+1) is called, on a worker thread, taking turns with
that forward (pipeline/turns.py): the two do not depend on each other, so each one's compute hides the
other's all-to-alls. The first forward runs alone (warm-up), as does the last backward (cool-down:
outside Megatron's no_sync, so the gradient reduction it starts is Megatron's). A held-back
backward runs inside the schedule's no_sync context, as it would have. Megatron's loop, its
token counting and its finalize are untouched, which is why one wrapper serves 0.12-0.19.
"""
from __future__ import annotations

import contextlib
import functools
import inspect

from npuspeed import telemetry
from npuspeed.features.moe_common import a2a_clock
from npuspeed.features.pipeline import turns
from npuspeed.features.pipeline.pair_choice import trial_step
from npuspeed.features.pipeline.pairing import device_setup
from npuspeed.patching.wrappers import bound_call


class Session:
    """One call of the schedule: how many backwards are left to hold back, the one held."""

    def __init__(self, num_microbatches: int, no_sync, setup_worker):
        self.num_microbatches = num_microbatches
        self.no_sync = no_sync
        self.setup_worker = setup_worker
        self.backwards = 0
        self.held = None
        self.backward_original = None  # Megatron's backward_step, for the held one


_SESSION: list[Session] = []


def current() -> Session | None:
    return _SESSION[-1] if _SESSION else None


def _config_of(model):
    from megatron.core.utils import get_model_config

    return get_model_config(model[0] if isinstance(model, list) else model)


def training_call(signature, args, kwargs) -> dict | None:
    """A schedule call's arguments by name; None for a forward-only (evaluation) call, which the
    overlap leaves to Megatron."""
    call = bound_call(signature, args, kwargs).arguments
    return None if call.get("forward_only") else call


def no_pipelining_wrapper(note):
    def wrap(original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def run(*args, **kwargs):
            call = training_call(signature, args, kwargs)
            if call is None or current() is not None:
                return original(*args, **kwargs)
            config = _config_of(call["model"])
            if getattr(config, "overlap_moe_expert_parallel_comm", False):  # Megatron's combined 1F1B
                return original(*args, **kwargs)
            if call["num_microbatches"] < 2:
                note("--moe-fb-overlap: one micro-batch per step leaves no backward to pair a forward "
                     "with; raise --global-batch-size to at least 2 x micro-batch x data-parallel")
                telemetry.count("moe.fb_overlap.single_microbatch")
                return original(*args, **kwargs)
            n = call["num_microbatches"]

            @contextlib.contextmanager
            def session(acc):
                _SESSION.append(Session(n, config.no_sync_func or contextlib.nullcontext, device_setup(acc)))
                try:
                    yield
                finally:
                    _SESSION.pop()

            return trial_step(n, lambda: original(*args, **kwargs), note, session)

        return run

    return wrap


def forward_step_wrapper(original):
    @functools.wraps(original)
    def forward_step(*args, **kwargs):
        session = current()
        if session is None:
            return original(*args, **kwargs)
        held, session.held = session.held, None
        if held is None:
            with a2a_clock.phase("warm_up"):
                return original(*args, **kwargs)
        backward_args, backward_kwargs = held

        def backward():
            with session.no_sync():
                session.backward_original(*backward_args, **backward_kwargs)

        telemetry.count("moe.fb_overlap.pairs")
        with a2a_clock.phase("steady"):
            return turns.run_pair(lambda: original(*args, **kwargs), backward, session.setup_worker)

    return forward_step


def backward_step_wrapper(original):
    @functools.wraps(original)
    def backward_step(*args, **kwargs):
        session = current()
        if session is None:
            return original(*args, **kwargs)
        session.backwards += 1
        session.backward_original = original
        if session.backwards < session.num_microbatches:
            session.held = (args, kwargs)  # the next forward_step runs it, paired
            return None
        with a2a_clock.phase("cool_down"):
            return original(*args, **kwargs)

    return backward_step
