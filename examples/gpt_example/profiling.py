"""Megatron-LM's `--profile --profile-step-start N --profile-step-end M`: torch.profiler over
the iterations whose 0-based count lies in [N, M), and the summary's `profile` key, the step's
time by category from npuspeed.step_profile (GEMM, attention, norm, elementwise, copies,
optimizer, communication, idle) with the 15 most expensive kernels.

As in Megatron-LM with `--use-pytorch-profiler`, the profiler starts one iteration early to warm
up (CUPTI's start-up is not in the profiled step); those iterations are left out of the
summary's step times (mean_step_ms, median_step_ms, tokens_per_s), as the first iteration is.
The example has no Nsight path: `--profile` always means torch.profiler, and
`--use-pytorch-profiler` is accepted for Megatron-LM's command lines. `--profile-dir` keeps the
Chrome trace (trace_rank<R>.json, for Perfetto); without it the trace is read and deleted.
"""
from __future__ import annotations

import json
import os
import tempfile

import torch

from npuspeed import get_accelerator, step_profile
from npuspeed.errors import UserError


def add_arguments(group) -> None:
    group.add_argument("--profile", action="store_true",
                       help="as Megatron-LM: profile iterations [--profile-step-start, --profile-step-end) "
                            "(torch.profiler); the summary gains `profile`, the step's time by category")
    group.add_argument("--use-pytorch-profiler", action="store_true",
                       help="Megatron-LM's flag; the example always profiles with torch.profiler")
    group.add_argument("--profile-step-start", type=int, default=10)
    group.add_argument("--profile-step-end", type=int, default=12)
    group.add_argument("--profile-ranks", type=int, nargs="+", default=[0])
    group.add_argument("--profile-dir", default=None, help="keep the Chrome trace here (trace_rank<R>.json)")


def check(args) -> None:
    """One line naming the flag for a window that profiles nothing."""
    if not getattr(args, "profile", False):
        return
    start, end = args.profile_step_start, args.profile_step_end
    if start < 0 or end <= start:
        raise UserError(f"--profile-step-start {start} / --profile-step-end {end}: profiled iterations are "
                        "[start, end) counted from 0; give 0 <= start < end")
    if start >= args.train_iters:
        raise UserError(f"--profile-step-start {start} is not below --train-iters {args.train_iters}: nothing "
                        f"would be profiled; e.g. --profile-step-start {args.train_iters - 1} "
                        f"--profile-step-end {args.train_iters} profiles the last iteration")


class StepProfiler:
    """Opens and closes the profiler and the step/optimizer annotations around the loop's
    iterations; does nothing without --profile or on a rank not in --profile-ranks."""

    def __init__(self, args, rank: int):
        self.on = bool(getattr(args, "profile", False)) and rank in args.profile_ranks
        self.start, self.end = getattr(args, "profile_step_start", 0), getattr(args, "profile_step_end", 0)
        self.first = max(0, self.start - 1)  # the warm-up iteration, as Megatron-LM's schedule
        self.dir, self.rank = getattr(args, "profile_dir", None), rank
        self.prof, self.span, self.result = None, None, None

    def perturbed(self, counter: int) -> bool:
        """The iteration (0-based count) ran under the profiler: its time is not a step time."""
        return self.on and self.first <= counter < self.end

    def begin(self, counter: int) -> None:
        if not self.perturbed(counter):
            return
        if self.prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if get_accelerator().name == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            warmup = self.start - self.first
            self.prof = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=0, warmup=warmup, active=self.end - self.start, repeat=1),
                on_trace_ready=self._ready)
            self.prof.start()
        self.span = torch.autograd.profiler.record_function(step_profile.STEP)
        self.span.__enter__()

    def optimizer(self):
        """The optimizer's annotation (a no-op context outside a profiled iteration)."""
        if self.span is None:
            import contextlib
            return contextlib.nullcontext()
        return torch.autograd.profiler.record_function(step_profile.OPTIMIZER)

    def end_step(self, counter: int, last: bool) -> None:
        if self.span is not None:
            self.span.__exit__(None, None, None)
            self.span = None
        if self.prof is None:
            return
        self.prof.step()
        if counter + 1 >= self.end or last:
            self.prof.stop()
            self.prof = None

    def _ready(self, prof) -> None:
        keep = self.dir is not None
        folder = self.dir or tempfile.mkdtemp(prefix="npuspeed-profile-")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"trace_rank{self.rank}.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = step_profile.trace_events(json.load(fh))
        if not keep:
            os.remove(path)
            os.rmdir(folder)
        self.result = {**step_profile.breakdown(events), "iterations": [self.start + 1, self.end],
                       "rank": self.rank, "trace": path if keep else None}

    def summary(self) -> dict | None:
        """The `profile` summary key: the breakdown, the 1-based iterations it covers, the trace."""
        return self.result
