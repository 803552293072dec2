"""What the three fused-op features share: one flag each, the implementation they report,
the notice when the fast kernel is absent (the reference then runs; training goes on), and
the refusal when the model never builds what the flag fuses (a flag never silently idles)."""
from __future__ import annotations

import argparse

from npuspeed.features.base import Feature


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
        self.patches.register(registry, self.name)

    @property
    def dest(self) -> str:
        return self.flags[0].lstrip("-").replace("-", "_")

    def add_arguments(self, group) -> None:
        group.add_argument(self.flags[0], action="store_true",
                           help=f"Run {self.replaces} as npuspeed's fused {self.op} "
                                f"(CPU: C++ {self.source}; NPU: torch_npu.{self.npu_kernel}).")

    def enabled(self, args: argparse.Namespace) -> bool:
        return bool(getattr(args, self.dest, False))

    def prepare(self, ctx) -> None:
        path = self.path(ctx)
        if "reference" in path:
            ctx.note(f"{self.flags[0]}: {path}")

    def check_built(self, block, ctx) -> str | None:
        acts_in = getattr(self.patches, "acts_in", None)  # None: not knowable from a block
        if acts_in is None or acts_in(block):
            return None
        return f"{self.flags[0]}: {self.patches.NEEDS} (this block has none: {self.patches.found_in(block)})"

    def path(self, ctx) -> str:
        if not self.enabled(ctx.args):
            return "off"
        accelerator = ctx.accelerator
        if accelerator.name == "npu":
            if hasattr(accelerator.torch_npu, self.npu_kernel):
                return f"torch_npu.{self.npu_kernel}"
            return f"pure-PyTorch reference (this torch_npu has no {self.npu_kernel})"
        if accelerator.name == "cuda":
            return "pure-PyTorch reference (no npuspeed CUDA kernel; CPU tensors use the C++ op)"
        from npuspeed.ops._extension import has_op, load_library

        lib = load_library()
        if has_op(self.op):
            return f"npuspeed::{self.op} (C++ {self.source}, {lib['source']}, {lib.get('cpu_capability')})"
        return f"pure-PyTorch reference (C++ op library unavailable: {lib['error'] or 'op missing'})"
