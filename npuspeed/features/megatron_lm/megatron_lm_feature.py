"""Megatron-LM integration (on whenever `megatron.training` is importable).

With `import npuspeed.megatron_adaptor` after `import torch`, Megatron-LM's own entry
scripts (`pretrain_gpt.py` ...) run unchanged on CPU (gloo) and NPU:
- its parser learns npuspeed's flags, sharing the ones Megatron-LM already defines
  (`--use-flash-attn`), so a MindSpeed-style launch script keeps working;
- modules megatron.training imports at load time whose optional dependency is absent get a
  stand-in (load_stubs.py: batch_invariant_kernels without triton);
- `validate_args` picks the portable choice for what this machine lacks (validate.py);
- megatron.training's own CUDA calls go to the accelerator (device_fixes.py,
  the shared room cuda_mapping/), the dataset helper is built for the running Python (build_helpers.py);
- three upstream DistributedOptimizer bugs on the path without apex/TE, which `--load`
  meets, are fixed by the device feature (device/distopt_fixes.py), since megatron.core
  alone meets them too.
The training patches (patches.py) are verified against Megatron-LM core_v0.16.x to
core_v0.19.x, each where upstream put it in that release (targets.py); for another release
they are skipped and the report says so (MEGATRON_LM_RANGE).
"""
from __future__ import annotations

from dataclasses import dataclass

from npuspeed.features.base import Feature, FeatureError
from npuspeed.features.config import FeatureConfig
from npuspeed.features.megatron_lm import patches as _patches
from npuspeed.features.megatron_lm import load_stubs, targets
from npuspeed.patching.versions import importable, in_range

#: Megatron-LM versions (read from the checkout's megatron/core/package_info.py) whose
#: megatron.training these patches were checked against.
MEGATRON_LM_RANGE = targets.ALL
#: Modules megatron.training imports at load (import name -> pip name, releases): the megatron-lm extra.
LOAD_TIME_IMPORTS = targets.LOAD_TIME_IMPORTS

_importable = importable  # a name of its own: tests replace it


def megatron_lm_present() -> bool:
    return importable("megatron.training")


@dataclass(frozen=True)
class Config(FeatureConfig):
    """No flag of its own: the feature is on whenever megatron.training imports, and its parser
    patch hands Megatron-LM the other features' flags."""

    # dualpipev's flag (it owns it: no --help here): under the V the loss is on pipeline rank 0
    schedules_method: str | None = None


class MegatronLMFeature(Feature, name="megatron_lm", Config=Config, patches=_patches,
                        # no plan effect: Megatron-LM plumbing (the parser, validation, its CUDA calls on
                        # the accelerator); a run's memory and time are megatron.core's, which the planner models
                        plan=None, always_on=True):
    def enabled(self, args) -> bool:
        return megatron_lm_present()

    def validate(self, ctx) -> None:
        missing = [pip for module, (pip, releases) in LOAD_TIME_IMPORTS.items()
                   if in_range(releases) and not _importable(module)]
        if missing:
            raise FeatureError(
                f"megatron.training (Megatron-LM) is on the path but imports {', '.join(missing)} at "
                f"load, which {'is' if len(missing) == 1 else 'are'} not installed: "
                "`pip install 'npuspeed[megatron-lm]'` (or `pip install " + " ".join(missing) + "`)")

    def prepare(self, ctx) -> None:
        load_stubs.install()

    def running(self, ctx) -> str:
        accelerator = ctx.accelerator
        stubs = load_stubs.installed()
        extra = f"; stand-ins: {', '.join(stubs)}" if stubs else ""
        return (f"megatron.training found: its parser learns npuspeed's flags, validation and "
                f"its CUDA calls mapped to {accelerator.name}{extra}")
