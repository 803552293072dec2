"""What the three fused-op features (fused_rmsnorm, fused_swiglu, fused_rotary_pos_emb) share:
the implementation they report, the notice when npuspeed's kernel is absent (Megatron's path then
runs; training goes on), the measured choice per shape (npuspeed.ops.fused_choice) in the report,
the refusal when the model never builds what the flag fuses (a flag never silently idles), and
the plan effect's form (one fused kernel in one op-graph slot)."""
from __future__ import annotations

from dataclasses import dataclass

from npuspeed.accelerator.devices import for_device
from npuspeed.features.base import Feature, PlanEffect
from npuspeed.ops import npu


@dataclass(frozen=True)
class Fused:
    """What a fused-op flag fuses, stated once in its plan.py for the plan and the report."""
    #: the `npuspeed::` op (and npuspeed.ops module) the flag routes to
    op: str
    #: what it replaces
    replaces: str
    #: the op-graph slot (npuspeed/plan/ops.py) that runs one fused kernel instead
    slot: str
    #: what the fused kernel saves for backward, against the unfused one
    saves: str

    def effect(self, applies: bool) -> PlanEffect | None:
        """The plan effect where the model builds what the flag fuses (`applies`), else None."""
        if not applies:
            return None
        return PlanEffect(variants={self.slot: "fused"}, kernels={self.slot: "fused"},
                          summary=f"{self.replaces}: one fused kernel ({self.op}); {self.saves}")


class FusedOpFeature(Feature):
    #: what the flag fuses (its plan module's `FUSED`)
    fused: Fused | None = None
    #: the torch_npu kernel used on an NPU
    npu_kernel: str = ""
    #: the C++ source, for the report
    source: str = ""
    #: npuspeed.ops.triton.<module> holding this op's Triton kernel
    triton_module: str = ""
    #: what runs with the flag off, for the report
    megatron_path: str = ""

    #: the implementation module with `acts_in(block)`, `found_in(block)` and `NEEDS`, or None
    #: where a built block cannot tell whether the flag acts
    built_module = None

    def prepare(self, ctx) -> None:
        """One notice where a kernel this accelerator would offer is absent (Megatron's path and the
        others still run)."""
        if any(not runs for _, runs in self.candidate_states(ctx.accelerator)):
            ctx.note(f"{self.flags[0]}: {self.path(ctx)}")

    def check_built(self, block, ctx) -> str | None:
        impl = self.built_module
        if impl is None or impl.acts_in(block):
            return None
        return f"{self.flags[0]}: {impl.NEEDS} (this block has none: {impl.found_in(block)})"

    def running(self, ctx) -> str:
        """The candidates here, then each measured choice so far ("rms_norm [..]: cpp (1.4x ...)")."""
        from npuspeed.ops import fused_choice

        rule = f"fastest of {', '.join(self.candidates(ctx.accelerator))}, measured once per shape (fwd+bwd)"
        force = fused_choice.forced()
        if force:
            rule += f"; {fused_choice.FORCE_ENV}={force}"
        made = [c.line() for c in fused_choice.choices() if c.op in (self.fused.op, f"{self.fused.op}_qk")]
        return rule + ("; " + "; ".join(made) if made else "")

    def candidates(self, accelerator) -> list[str]:
        """What this flag chooses among on this accelerator, with why a kernel is absent."""
        return [what for what, _ in self.candidate_states(accelerator)]

    def candidate_states(self, accelerator) -> list[tuple[str, bool]]:
        """(what, whether it runs here) for each candidate this accelerator would offer."""
        found = []
        traits = for_device(accelerator.name)
        if traits.has_vendor_kernels():
            native = npu.has(accelerator, self.npu_kernel)
            found.append((f"torch_npu.{self.npu_kernel}" if native
                          else f"no native op (this torch_npu has no {self.npu_kernel})", native))
        if not traits.host_is_device():
            found.append(_triton_state(self.triton_module))
        else:
            from npuspeed.ops._extension import has_op, load_library

            lib, ours = load_library(), has_op(self.fused.op)
            found.append((f"npuspeed::{self.fused.op} (C++ {self.source}, {lib['source']}, {lib.get('cpu_capability')})"
                          if ours else
                          f"no npuspeed kernel (C++ op library unavailable: {lib['error'] or 'op missing'})", ours))
        found.append((f"Megatron's path ({self.megatron_path})", True))
        return found


def _triton_state(module: str) -> tuple[str, bool]:
    try:
        import importlib

        kernels = importlib.import_module(f"npuspeed.ops.triton.{module}")
    except ImportError as exc:
        return f"no npuspeed Triton kernel ({exc})", False
    if kernels.available():
        return f"npuspeed Triton kernel (npuspeed.ops.triton.{module})", True
    return f"no npuspeed Triton kernel (npuspeed.ops.triton.{module}.available() is False)", False
