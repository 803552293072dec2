"""`--npuspeed-dump DIR [--dump-steps S] [--dump-modules GLOB,...] [--dump-level stats|tensors]`.

Each rank writes, for the selected iterations, every selected module's forward outputs and, in
the backward, the gradients with respect to its outputs and inputs (statistics or the tensors),
then every parameter and its gradient once the step's backward is done, and every iteration's
loss; with its parallel layout, so that `npuspeed compare` can put sharded tensors back together.
Nothing in the run's arithmetic changes (hooks only read), so the losses are bitwise the same.
"""
from __future__ import annotations

from dataclasses import dataclass

from npuspeed.features.base import Feature, FeatureError
from npuspeed.features.config import FeatureConfig, flag
from npuspeed.features.dump import patches as _patches
from npuspeed.features.dump.selection import MAIN, MODULES, parse_modules, parse_steps



@dataclass(frozen=True)
class Config(FeatureConfig):
    npuspeed_dump: str | None = flag(MAIN, None, metavar="DIR")
    """Dump this run into DIR (one folder per rank and dumped step) for `npuspeed compare`:
    module outputs and gradients, parameters and their gradients, every iteration's loss."""
    dump_steps: str | None = flag("--dump-steps", None, metavar="LIST")
    """With --npuspeed-dump: the training iterations to dump (1-based, e.g. 1,3-5); default all.
    The loss is recorded at every iteration."""
    dump_modules: str | None = flag(MODULES, None, metavar="GLOBS")
    """With --npuspeed-dump: comma-separated globs on module names (e.g. 'decoder.layers.1.*');
    default every module. Layers are named by their global number, whatever the pipeline stage."""
    dump_level: str | None = flag("--dump-level", None, choices=["stats", "tensors"])
    """With --npuspeed-dump: 'stats' (default: shape, dtype, min, max, mean, norm, NaN and Inf
    counts) or 'tensors' (each tensor in its own file, written as it is produced)."""


#: plan=None: it changes neither memory nor time the planner models
class DumpFeature(Feature, name="dump", Config=Config, patches=_patches, plan=None, switch="npuspeed_dump",
                  requires={"dump_steps": "npuspeed_dump", "dump_modules": "npuspeed_dump",
                            "dump_level": "npuspeed_dump"}):

    def validate(self, ctx) -> None:
        config = self.config(ctx.args)
        self.check_requires(config)
        parse_steps(config.dump_steps)
        parse_modules(config.dump_modules)
        if not config.npuspeed_dump.strip():
            raise FeatureError(f"{MAIN} is empty; give the folder to dump into, e.g. {MAIN} dumps/run_a")

    def running(self, ctx) -> str:
        config = self.config(ctx.args)
        from npuspeed import telemetry
        from npuspeed.features.dump.writer import RECORDS

        return (f"{config.dump_level or 'stats'} of modules {','.join(parse_modules(config.dump_modules))} at "
                f"iterations {config.dump_steps or 'all'} into {config.npuspeed_dump} (forward/backward hooks, "
                f"parameters after the step's backward, every loss); records written in this process: "
                f"{telemetry.get(RECORDS)}")
