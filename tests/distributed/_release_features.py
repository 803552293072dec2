"""Every opt-in feature, enabled alone through the real start-up path (`runtime.initialize`,
as `npuspeed report FLAGS` does), on the megatron-core this interpreter imports: applied (how
many of its patches) or refused (the one line). Prints one JSON object {feature: {...}}.
Run by tests/distributed/test_megatron_versions.py with a release's directory on PYTHONPATH."""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/

from feature_argv import FEATURES  # noqa: E402


def one(name, enable) -> dict:
    from npuspeed import runtime
    from npuspeed.errors import UserError, one_line
    from npuspeed.patching import registry
    from npuspeed.plan.adaptive import expand

    saved = dict(os.environ)
    os.environ.update(enable.env, WORLD_SIZE=str(enable.ranks))
    runtime.reset()
    try:
        runtime.initialize(expand(enable.argv)[0])
        mine = registry.patches(name)
        applied = [p for p in mine if p.status == "applied"]
        return {"status": "applied", "patches": len(applied), "of": len(mine)}
    except UserError as exc:
        return {"status": "refused", "reason": one_line(exc)}
    except Exception as exc:  # not a user's mistake: the test fails on it
        return {"status": "error", "reason": one_line(f"{type(exc).__name__}: {exc}")}
    finally:
        runtime.reset()
        os.environ.clear()
        os.environ.update(saved)


def main() -> None:
    import torch  # noqa: F401

    from npuspeed.patching.versions import megatron_version

    out = {"megatron_core_version": str(megatron_version()), "python": sys.version.split()[0],
           "features": {name: one(name, enable) for name, enable in FEATURES.items()}}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
