"""Output written beside --save and renamed into place only when complete, so a failed or
killed conversion leaves --save as it was (absent), never half-written."""
from __future__ import annotations

import contextlib
import os
import shutil

from npuspeed.errors import UserError


def check_target(save: str) -> str:
    save = os.path.abspath(save)
    if os.path.exists(save) and not (os.path.isdir(save) and not os.listdir(save)):
        raise UserError(f"--save {save} exists and is not empty; pick a new directory (nothing is overwritten)")
    parent = os.path.dirname(save)
    if not os.path.isdir(parent):
        raise UserError(f"--save {save}: its parent directory {parent} does not exist; create it first")
    return save


@contextlib.contextmanager
def staged(save: str):
    """Yield a temporary directory next to `save`; on success rename it to `save`."""
    save = check_target(save)
    tmp = os.path.join(os.path.dirname(save), f".{os.path.basename(save)}.converting-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.isdir(save):
        os.rmdir(save)  # empty (check_target)
    os.rename(tmp, save)
