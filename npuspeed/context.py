"""What every feature hook is given: one context, built once by `runtime.initialize`.

Features used to import `runtime` (for notes) and `arguments` (to re-read `sys.argv`), which
made a loop (arguments imported the features) and read the wrong command line when
`initialize(argv)` was given one. Now the runtime hands each hook this object, and no feature
imports anything above itself (tests/unit/test_import_graph.py checks it).
"""
from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field
from typing import Callable

from npuspeed import telemetry

log = logging.getLogger("npuspeed")


@dataclass
class Context:
    #: npuspeed's own flags (the feature group)
    args: argparse.Namespace
    #: Megatron's flags that npuspeed reads (npuspeed/megatron_flags.py); None = not given
    megatron: argparse.Namespace
    #: the accelerator chosen for this process
    accelerator: object
    #: the argv the run was initialised with (command line + NPUSPEED_ARGS)
    argv: tuple[str, ...] = ()
    #: fallbacks and notices, in order; each is logged once when added
    notes: list[str] = field(default_factory=list)
    #: adds npuspeed's flag group to another parser (Megatron-LM's), skipping shared flags
    extend_parser: Callable | None = None
    #: the one counter registry (npuspeed/telemetry.py)
    counters = telemetry

    def note(self, message: str) -> None:
        """Record a fallback or notice for `npuspeed report` and log it, once."""
        if message not in self.notes:
            self.notes.append(message)
            log.warning(message)

