"""Megatron's interleaved schedule function, called by the training script with the two V
chunks, runs DualPipeV's step instead (run.py); with the forward/backward overlap on, the step
trial (pipeline/pair_choice.py, the one --moe-fb-overlap's schedules use) decides per step count whether its pairs take turns or run
one after the other, as it does for the other schedules."""
from __future__ import annotations

import contextlib
import functools
import inspect

from npuspeed.features.base import FeatureError
from npuspeed.patching.wrappers import bound_call

FLAG = "--schedules-method dualpipev"


def batch_message(microbatches: int, pp: int) -> str:
    return (f"{FLAG} at --pipeline-model-parallel-size {pp} needs at least 2 x {pp} = {2 * pp} micro-batches a "
            f"step (got {microbatches}): raise --global-batch-size to at least {2 * pp} x data-parallel x "
            "--micro-batch-size")


def wrapper(note, overlap: bool, measure: bool):
    def wrap(original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def schedule(*args, **kwargs):
            from megatron.core import parallel_state

            from npuspeed.features.dualpipev.run import Step
            from npuspeed.features.pipeline.bubble import measure as bubble

            call = bound_call(signature, args, kwargs).arguments
            pp = parallel_state.get_pipeline_model_parallel_world_size()
            n = call["num_microbatches"]
            if not call["forward_only"] and n < 2 * pp:
                raise FeatureError(batch_message(n, pp))
            state = {"pair": None}
            if measure:
                bubble.note_schedule("dualpipev")

            def step(**_):
                return Step(call, state["pair"], measure).run()

            run = (lambda: bubble.schedule_wrapper(step)(**call)) if measure else step
            if call["forward_only"] or not overlap:
                return run()
            from npuspeed.features.pipeline import pairing, turns
            from npuspeed.features.pipeline.pair_choice import trial_step

            @contextlib.contextmanager
            def paired(acc):
                with pairing.pairing_scope(acc):
                    state["pair"] = lambda f, b: turns.run_pair(f, b, pairing.worker_setup())
                    try:
                        yield
                    finally:
                        state["pair"] = None

            return trial_step(n, run, note, paired)

        return schedule

    return wrap
