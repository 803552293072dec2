"""The one line a training script adds: `import npuspeed.megatron_adaptor`.

Importing it reads npuspeed's flags (command line and NPUSPEED_ARGS), picks the
accelerator, validates the requested features, and applies their patches to Megatron,
once. Put it right after `import torch`, before anything from megatron is imported.
A bad flag or an unusable device ends the script here with one line,
`npuspeed: error: ...`, and exit status 2 (npuspeed/errors.py; NPUSPEED_DEBUG=1 for the
traceback).

With `--adaptive-recompute-device-size MB` the planner first chooses the recompute policy
(npuspeed/plan/adaptive.py) and its flags are added to the command line, so that the script's
own parser (Megatron's recompute flags) and npuspeed's features both apply it.
"""
import os
import sys

from npuspeed.errors import exit_on_user_error
from npuspeed.runtime import initialize


def _adaptive() -> None:
    from npuspeed import arguments
    from npuspeed.plan import adaptive

    argv = arguments.argv_with_env(None)
    expanded, policy = adaptive.expand(argv, int(os.environ.get("WORLD_SIZE", "1")))
    if policy is not None:
        sys.argv += expanded[len(argv):]
        if os.environ.get("RANK", "0") == "0":
            print(f"npuspeed: adaptive memory policy: {policy.describe()}; flags: {' '.join(policy.flags()) or '(none)'}",
                  flush=True)


with exit_on_user_error():
    _adaptive()
    initialize()
