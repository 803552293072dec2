"""The one list of Megatron optimizer methods that touch masters/states outside a step
(features/optimizer_state_access.py) against the running megatron-core: every method the list
declares for this release exists (an upstream rename would otherwise leave masters or states
swapped out or released when Megatron reads them), and none it declares absent does."""
from __future__ import annotations

import importlib

from npuspeed.features.optimizer_state_access import MASTER_ACCESS, OPT, SINCE, STATE_ONLY_ACCESS
from npuspeed.patching.versions import in_range


def test_each_listed_method_exists_exactly_on_the_releases_it_is_declared_for():
    wrong = []
    for cls_path, methods in {**MASTER_ACCESS, **STATE_ONLY_ACCESS}.items():
        module, cls_name = cls_path.rsplit(".", 1)
        cls = getattr(importlib.import_module(f"{OPT}.{module}"), cls_name)
        for name in methods:
            declared = in_range(SINCE.get(name, ">=0.12"))
            if declared != callable(getattr(cls, name, None)):
                wrong.append(f"{cls_name}.{name}: declared {'present' if declared else 'absent'}")
    assert not wrong, wrong
