"""Megatron's dataset index helper (helpers.cpp), built for the interpreter that runs.

`megatron.training.initialize._compile_dependencies` calls
`megatron.core.datasets.utils.compile_helpers`, which runs `make` in
`megatron/core/datasets`; its Makefile asks `python3 -m pybind11 --includes` and
`python3-config --extension-suffix` for flags. `python3` there is whatever PATH finds in
that directory: under pyenv, a Megatron-LM checkout's `.python-version` (3.12 at
core_v0.16.1) picks another interpreter than the venv's, the build fails or produces a
module the running Python cannot import, and training exits. The replacement runs the
same Makefile with both answers taken from the running interpreter (`make` variables
given on the command line override the Makefile's). Backend-independent.

The megatron-core wheels (0.19.x ship `megatron/training` too, so Megatron-LM's scripts run
against them) carry a prebuilt `helpers_cpp` and no Makefile: upstream's `make` then fails
("No targets specified") and training exits. There the build is skipped when the prebuilt
module matches the running Python, and refused with the reason when it does not.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import sysconfig

log = logging.getLogger("npuspeed")


class HelperBuildError(RuntimeError):
    """The dataset helper cannot be built with this interpreter."""


def make_command(directory: str) -> list[str]:
    """The `make` call that builds helpers_cpp for sys.executable."""
    try:
        import pybind11
    except ImportError as exc:
        raise HelperBuildError(
            "Megatron-LM builds its dataset helper (megatron/core/datasets/helpers.cpp) with "
            "pybind11, which is not installed: `pip install pybind11` (or npuspeed[megatron-lm])"
        ) from exc
    includes = [pybind11.get_include(), sysconfig.get_paths()["include"]]
    cppflags = " ".join(f"-I{path}" for path in dict.fromkeys(includes))
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return ["make", "-C", directory, f"CPPFLAGS={cppflags}", f"LIBEXT={suffix}"]


def compile_helpers() -> None:
    """Replacement for megatron.core.datasets.utils.compile_helpers (call on one rank)."""
    import megatron.core.datasets.utils as utils

    build_in(os.path.abspath(os.path.dirname(utils.__file__)))


def prebuilt(directory: str) -> str | None:
    """The helpers_cpp extension in `directory` built for this interpreter, if there is one."""
    path = os.path.join(directory, "helpers_cpp" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
    return path if os.path.isfile(path) else None


def build_in(directory: str) -> None:
    """Run the Makefile in `directory` for this interpreter; exit like upstream on failure."""
    if not os.path.isfile(os.path.join(directory, "Makefile")):
        if prebuilt(directory):
            return  # an installed megatron-core wheel: its helper is already built
        log.error("npuspeed: %s has neither Megatron's dataset helper built for %s nor the Makefile "
                  "to build it: reinstall megatron-core for this Python, or put a Megatron-LM "
                  "checkout first on PYTHONPATH", directory, sys.executable)
        sys.exit(1)
    try:
        command = make_command(directory)
    except HelperBuildError as exc:
        log.error("%s", exc)
        sys.exit(1)
    if subprocess.run(command).returncode != 0:
        log.error("npuspeed: failed to compile Megatron's C++ dataset helpers with %s (%s)",
                  sys.executable, " ".join(command))
        sys.exit(1)
