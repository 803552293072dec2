"""Optimizer state off the device between steps (`--swap-optimizer`, MindSpeed-LLM's name).

Adam's states and the fp32 masters are 12 of the 16 bytes a mixed-precision parameter keeps on
the device. With this flag they live in pinned host memory between optimizer steps; the step
streams them in and out by chunks on a side stream, overlapped with the update of the previous
chunk (swapper.py), through Megatron's own optimizers (patches.py): losses are bitwise those of
the run without the flag. `--swap-optimizer-mode hidden` (default) moves only the chunks whose
copies the measured host link hides behind the measured updates (the others stay resident),
decided after the first steps; `whole` moves all and states the cost (sizer.py,
npuspeed/offload/sizing.py). Where `--reuse-fp32-param` already keeps the masters as a residual
inside the bf16 parameters only the states move.

Megatron-Core's own `--optimizer-cpu-offload [--optimizer-offload-fraction F]` (a hybrid
optimizer that updates a share of the parameters on the host) needs Transformer Engine: without
it npuspeed refuses the flag and points here. On the CPU backend the host is the device: the
states already live in host memory, and copying them to another place in it would only cost
time and the window's memory (measured: CPU time x1.02-1.07 per step, peak up by the chunks in
flight), so they stay in place and the log and report say so; `NPUSPEED_SWAP_OPTIMIZER=run`
runs the mechanics there anyway (the tests prove them on CPU that way).
"""
from __future__ import annotations

from dataclasses import dataclass

from npuspeed.features.base import Feature, FeatureError
from npuspeed.features.config import FeatureConfig, flag
from npuspeed.features.swap_optimizer import patches as _patches, plan as _plan
from npuspeed.features.swap_optimizer.policy import (  # noqa: F401 (re-exported)
    CHUNK, ENV, FLAG, FRACTION, MODE, OFFLOAD, WINDOW_CHUNKS, chunk_bytes, host_is_device, moves, parse_mode,
    te_installed,
)
from npuspeed.patching.versions import megatron_version


@dataclass(frozen=True)
class Config(FeatureConfig):
    swap_optimizer: bool = flag(FLAG, False)
    """Keep Adam's states and the fp32 masters in pinned host memory between optimizer steps; the
    step brings them in and out by chunks on a side stream, overlapped with the update
    (bitwise-equal training)."""
    swap_optimizer_chunk_mb: float = flag(CHUNK, 128.0, type=float, metavar="MB")
    """With --swap-optimizer: MiB of states and masters per chunk (default 128); the device holds
    about 3 chunks during the step."""
    swap_optimizer_mode: str | None = flag(MODE, None, type=str, metavar="MODE")
    """With --swap-optimizer: hidden (default) moves only the chunks whose copies the measured
    host link carries behind the measured update (the rest stay on the device; decided after
    the first steps); whole moves every chunk, whatever it costs, and states the cost in one
    line."""
    optimizer_cpu_offload: bool | None = flag(OFFLOAD, None, action="store_true")
    """Megatron-Core's hybrid host/device optimizer (needs Transformer Engine; without it use
    --swap-optimizer)."""
    optimizer_offload_fraction: float | None = flag(FRACTION, None, type=float, metavar="F")
    """With --optimizer-cpu-offload: the share (0, 1] of optimizer state Megatron updates on the
    host."""
    # reuse_fp32_param's flag (it owns it: no --help here): the masters then stay in the parameters
    reuse_fp32_param: bool = False


class SwapOptimizerFeature(Feature, name="swap_optimizer", Config=Config, patches=_patches, plan=_plan):
    def enabled(self, args) -> bool:
        config = self.config(args)
        return bool(config.swap_optimizer or config.optimizer_cpu_offload
                    or config.optimizer_offload_fraction is not None or config.swap_optimizer_mode is not None)

    def swapping(self, args) -> bool:
        return bool(self.config(args).swap_optimizer)

    def validate(self, ctx) -> None:
        config = self.config(ctx.args)
        fraction, offload = config.optimizer_offload_fraction, config.optimizer_cpu_offload
        if fraction is not None and not 0.0 < fraction <= 1.0:
            raise FeatureError(f"{FRACTION} {fraction:g} is outside (0, 1]: give the share of optimizer state to "
                               f"update on the host, e.g. {FRACTION} 0.5 (or drop it)")
        if fraction is not None and not offload:
            raise FeatureError(f"{FRACTION} is a setting of {OFFLOAD}, which is not given; add {OFFLOAD} or drop "
                               f"{FRACTION} ({FLAG} moves all of the state)")
        if config.swap_optimizer_mode is not None and not config.swap_optimizer:
            raise FeatureError(f"{MODE} is given without {FLAG}; add {FLAG} (or drop {MODE})")
        parse_mode(config.swap_optimizer_mode)
        if config.swap_optimizer and offload:
            raise FeatureError(f"{FLAG} with {OFFLOAD}: both move optimizer state to the host; pick one "
                               f"(drop {OFFLOAD} to keep {FLAG})")
        if offload and not te_installed():
            raise FeatureError(f"{OFFLOAD}: megatron-core {megatron_version()} runs its hybrid optimizer only on the "
                               f"--use-precision-aware-optimizer path (Megatron-LM asserts it), written for Transformer "
                               f"Engine, which is not installed here; the optimizer drives torch.cuda streams itself "
                               f"(on the CPU backend its step fails); use npuspeed's {FLAG} instead")
        if offload:
            ctx.note(f"{OFFLOAD}: Megatron-Core's own HybridDeviceOptimizer runs (Transformer Engine is installed); "
                     "npuspeed leaves it alone")
            return
        if config.swap_optimizer_chunk_mb <= 0:
            raise FeatureError(f"{CHUNK} must be a positive number of MiB, got {config.swap_optimizer_chunk_mb:g}")
        if "--use-precision-aware-optimizer" in ctx.argv:
            raise FeatureError(f"{FLAG} with --use-precision-aware-optimizer: Transformer Engine's fused Adam keeps "
                               "masters and states in its own layout, which the swap does not move; drop one of them")
        if "--use-megatron-fsdp" in ctx.argv or "--use-torch-fsdp2" in ctx.argv:
            raise FeatureError(f"{FLAG} with FSDP: its buffers own the optimizer's masters and states; drop one of them")
        acc = ctx.accelerator
        moves(acc)  # a bad NPUSPEED_SWAP_OPTIMIZER value is a start-up error on every backend
        if host_is_device(acc) and moves(acc):
            ctx.note(f"{FLAG}: the host is the device on the {acc.name} backend: optimizer states and masters are "
                     f"copied to another place in the same memory and nothing is freed ({ENV}=run: the mechanics "
                     "run); the gain is measured on an accelerator")
        elif host_is_device(acc):
            ctx.note(f"{FLAG}: the host is the device on the {acc.name} backend: optimizer states and masters "
                     "already live in host memory, so they stay in place (copies would cost step time and the "
                     f"window's memory and free nothing); {ENV}=run runs the mechanics anyway")
        elif not getattr(acc, "has_pinned_memory", lambda: True)():
            raise FeatureError(f"{FLAG} needs page-locked host memory for overlapped copies, which the {acc.name} "
                               f"backend does not offer here; drop {FLAG}")

    def idle_reason(self, ctx) -> str | None:
        """No patch where Megatron's own offload runs or the host is the device (both noted at
        validation); otherwise the swap's patches must apply."""
        if not self.swapping(ctx.args):
            return f"{OFFLOAD} is Megatron-Core's own optimizer: npuspeed leaves it alone"
        if not moves(ctx.accelerator):
            return f"{FLAG}: the host is the device, the states stay in place (noted)"
        return None

    def chunk_bytes(self, args) -> int:
        return chunk_bytes(self.config(args))

    def running(self, ctx) -> str:
        config = self.config(ctx.args)
        if config.optimizer_cpu_offload:
            return "Megatron-Core's HybridDeviceOptimizer (--optimizer-cpu-offload)"
        if not config.swap_optimizer:
            return "off"
        from npuspeed import telemetry
        from npuspeed.features.swap_optimizer.swapper import PREFIX

        acc = ctx.accelerator
        if not moves(acc):
            return (f"host is the device ({acc.name} backend): states and masters stay in place, nothing copied "
                    f"({ENV}=run runs the mechanics)")
        where = ("host is the device (CPU backend): copies run, nothing is freed" if host_is_device(acc)
                 else f"pinned host memory, side stream on {acc.name}")
        moved = "states" + (" + fp32 masters" if not config.reuse_fp32_param else
                            " (masters stay with --reuse-fp32-param)")
        counts = ", ".join(f"{k} {telemetry.get(PREFIX + k)}" for k in
                           ("steps", "chunks_in", "chunks_out", "bytes_in", "bytes_out", "materialize"))
        from npuspeed.features.swap_optimizer.sizer import FEATURE
        from npuspeed.offload import decisions

        sized = [d["line"] for d in decisions.all_dicts() if d["feature"] == FEATURE]
        return (f"{moved} by chunks of {config.swap_optimizer_chunk_mb:g} MiB; {where}; {counts}; mode "
                f"{parse_mode(config.swap_optimizer_mode)}: "
                + ("; ".join(sized) if sized else "every chunk moves until the first steps are measured"))
