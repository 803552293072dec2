"""What the three fused-op features share: one flag each, the implementation they report,
the notice when npuspeed's kernel is absent (Megatron's path then runs; training goes on), the measured
choice per shape (npuspeed.ops.fused_choice) in the report, and the refusal when the model never builds
what the flag fuses (a flag never silently idles)."""
from __future__ import annotations

import argparse

from npuspeed.accelerator.devices import for_device
from npuspeed.features.base import Feature
from npuspeed.ops import npu


class FusedOpFeature(Feature):
    #: the `npuspeed::` op (and npuspeed.ops module) this feature routes to
    op: str = ""
    #: the torch_npu kernel used on an NPU
    npu_kernel: str = ""
    #: the C++ source, for the report
    source: str = ""
    #: what the flag replaces, for --help and the report
    replaces: str = ""
    #: the module whose `register(registry, feature)` installs this feature's patches
    patches = None

    def register_patches(self, registry, ctx) -> None:
        from npuspeed.features.fused_ops.measure import configure

        configure(ctx)
        self.patches.register(registry, self.name)

    @property
    def dest(self) -> str:
        return self.flags[0].lstrip("-").replace("-", "_")

    def add_arguments(self, group) -> None:
        group.add_argument(self.flags[0], action="store_true",
                           help=f"Run {self.replaces} on the fastest correct {self.op} here, measured "
                                f"once per shape (fwd+bwd) among npuspeed's kernel (CPU: C++ {self.source}; "
                                f"CUDA/NPU: Triton), the device's native op (NPU: torch_npu.{self.npu_kernel}) "
                                f"and Megatron's own path (never slower than the flag off). "
                                f"NPUSPEED_FUSED_OP_PATH=cpp|triton|npu|native|megatron forces one.")

    def enabled(self, args: argparse.Namespace) -> bool:
        return bool(getattr(args, self.dest, False))

    def prepare(self, ctx) -> None:
        path = self.path(ctx)
        if "unavailable" in path or "no npuspeed" in path or "has no" in path:
            ctx.note(f"{self.flags[0]}: {path}")

    #: the op-graph slot the fused kernel replaces (npuspeed/plan/ops.py) and when it applies
    plan_slot: str = ""

    def plan_applies(self, model) -> bool:
        return True

    def plan_effect(self, model, ctx):
        from npuspeed.features.base import PlanEffect

        if not self.plan_applies(model.model):
            return None
        return PlanEffect(variants={self.plan_slot: "fused"}, kernels={self.plan_slot: "fused"},
                          summary=f"{self.replaces}: one fused kernel ({self.op}); {self.plan_saves}")

    #: what the fused kernel keeps for backward, for the plan
    plan_saves: str = ""

    def check_built(self, block, ctx) -> str | None:
        acts_in = getattr(self.patches, "acts_in", None)  # None: not knowable from a block
        if acts_in is None or acts_in(block):
            return None
        return f"{self.flags[0]}: {self.patches.NEEDS} (this block has none: {self.patches.found_in(block)})"

    def path(self, ctx) -> str:
        """The candidates here, then each measured choice so far ("rms_norm [..]: cpp (1.4x ...)")."""
        if not self.enabled(ctx.args):
            return "off"
        from npuspeed.ops import fused_choice

        rule = f"fastest of {', '.join(self.candidates(ctx.accelerator))}, measured once per shape (fwd+bwd)"
        force = fused_choice.forced()
        if force:
            rule += f"; {fused_choice.FORCE_ENV}={force}"
        made = [c.line() for c in fused_choice.choices() if c.op in (self.op, f"{self.op}_qk")]
        return rule + ("; " + "; ".join(made) if made else "")

    def candidates(self, accelerator) -> list[str]:
        """What this flag chooses among on this accelerator, with why a kernel is absent."""
        found = []
        traits = for_device(accelerator.name)
        if traits.has_vendor_kernels():
            found.append(f"torch_npu.{self.npu_kernel}" if npu.has(accelerator, self.npu_kernel)
                         else f"no native op (this torch_npu has no {self.npu_kernel})")
        if not traits.host_is_device():
            found.append(_triton_state(self.triton_module))
        else:
            from npuspeed.ops._extension import has_op, load_library

            lib = load_library()
            found.append(f"npuspeed::{self.op} (C++ {self.source}, {lib['source']}, {lib.get('cpu_capability')})"
                         if has_op(self.op) else
                         f"no npuspeed kernel (C++ op library unavailable: {lib['error'] or 'op missing'})")
        found.append(f"Megatron's path ({self.megatron_path})")
        return found

    #: npuspeed.ops.triton.<module> holding this op's Triton kernel
    triton_module: str = ""
    #: what runs with the flag off, for the report
    megatron_path: str = ""


def _triton_state(module: str) -> str:
    try:
        import importlib

        kernels = importlib.import_module(f"npuspeed.ops.triton.{module}")
    except ImportError as exc:
        return f"no npuspeed Triton kernel ({exc})"
    return (f"npuspeed Triton kernel (npuspeed.ops.triton.{module})" if kernels.available()
            else f"no npuspeed Triton kernel (npuspeed.ops.triton.{module}.available() is False)")
