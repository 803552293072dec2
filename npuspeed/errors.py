"""One line for a mistake the user can fix, instead of a traceback.

A bad flag, an impossible combination or a device that cannot be had is the user's to fix,
and a 40-line traceback hides the one sentence that says how. Whatever raises a `UserError`
(npuspeed's `FeatureError`, `AcceleratorError`, `UnsupportedMegatronError`, the example's
argument checks) under `exit_on_user_error()` ends the process with

    npuspeed: error: <what is wrong, the flag, the fix>

on stderr, printed by rank 0 only (every rank sees the same command line, so one copy is
enough), and exit status 2, argparse's status for bad usage. `NPUSPEED_DEBUG=1` re-raises
instead, so the traceback is there when a developer wants it.

This module sits at the bottom of the dependency graph: it imports nothing of npuspeed.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time

EXIT_USAGE = 2
PREFIX = "npuspeed: error: "
DEBUG_ENV = "NPUSPEED_DEBUG"
#: Seconds a rank other than 0 waits before it exits on a UserError: under torchrun the first
#: rank to exit gets the others terminated, and rank 0 must have printed the line by then.
PEER_GRACE_S = 2.0


class UserError(Exception):
    """Input the user can fix; the message names the flag (or variable) and the fix."""


def debug() -> bool:
    """True when NPUSPEED_DEBUG asks for tracebacks."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def rank() -> int:
    """This process's global rank: torch.distributed's once it is up, else the launcher's RANK."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # a broken group must not hide the message
        pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def one_line(message: object) -> str:
    """The message on one line (argparse and some upstream errors span several)."""
    return " ".join(str(message).split())


def print_error(message: object, *, all_ranks: bool = False) -> None:
    """`npuspeed: error: ...` on stderr, by rank 0 only unless `all_ranks`."""
    if all_ranks or rank() == 0:
        sys.stdout.flush()
        print(PREFIX + one_line(message), file=sys.stderr, flush=True)


def record_for_launcher(message: object) -> None:
    """Give torchrun the line for its failure summary (it shows the error file's message
    instead of "To enable traceback see ...")."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": PREFIX + one_line(message), "timestamp": int(time.time())}, f)
    except OSError:
        pass


@contextlib.contextmanager
def exit_on_user_error():
    """Turn a UserError raised inside into the one-line message and exit status 2."""
    try:
        yield
    except UserError as exc:
        if debug():
            raise
        record_for_launcher(exc)
        if rank() == 0:
            print_error(exc)
        else:
            time.sleep(PEER_GRACE_S)
        raise SystemExit(EXIT_USAGE) from None


__all__ = ["DEBUG_ENV", "EXIT_USAGE", "PREFIX", "UserError", "debug", "exit_on_user_error",
           "one_line", "print_error", "rank", "record_for_launcher"]
