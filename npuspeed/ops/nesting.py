"""A region that may nest, and whether code runs inside one: `with REGION():` enters it (calls
inside calls just deepen it), `REGION.inside` asks. The dispatch's quiet region (no call is
counted) and the chooser's trial region (a failing candidate must raise) are two."""
from __future__ import annotations

import contextlib


class Nesting:
    def __init__(self):
        self._depth = 0

    @property
    def inside(self) -> bool:
        return self._depth > 0

    @contextlib.contextmanager
    def __call__(self):
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
