"""npuspeed packaging.

The C++ op library (csrc/) is compiled here when torch and a C++ compiler are present
at install time (`pip install --no-build-isolation -e .`, after torch); otherwise it is
JIT-built at first use, and failing that the pure-PyTorch references run (see
npuspeed/ops/_extension.py). NPUSPEED_DISABLE_CPP=1 skips the build. The SIMD level is
the build machine's unless NPUSPEED_CPU_CAPABILITY says otherwise (npuspeed/ops/build_flags.py):
set it to `default` when building a wheel for other machines.
"""
import os
import sys

from setuptools import find_packages, setup

EXTRAS = {
    "npu": ["torch_npu>=2.6.0"],
    # pybind11: the tests build a Megatron-LM-style dataset helper for this interpreter.
    # triton: the Triton kernels' numerics (npuspeed/ops/triton/) are tested on CPU through
    # its interpreter (TRITON_INTERPRET=1). A range, so the triton a CUDA build of torch pins
    # (2.13: 3.7.1, 2.14: 3.8.0) is kept; CI tests 3.6.0 (.venv), 3.8.0 (.venv312) and the
    # newest, 3.9.0 (make test-triton). Linux x86_64 only, where its wheels are; elsewhere
    # those tests skip and say why.
    # transformers, safetensors: npuspeed convert's tests make tiny Hugging Face models locally.
    "test": ["pytest>=7", "hypothesis>=6", "pytest-timeout", "pybind11", "transformers", "safetensors",
             'triton>=3.6,<3.10; platform_system == "Linux" and platform_machine == "x86_64"'],
    "bench": ["matplotlib"],
    # Liger-Kernel's Triton RMSNorm, SwiGLU and RoPE join the fused-op chooser's candidates where
    # it imports (a GPU); never required: npuspeed imports it lazily, on first use.
    "liger": ["liger-kernel>=0.5"],
    # What megatron.training (Megatron-LM core_v0.16) imports at load, plus pybind11 for the
    # dataset helper it builds at start-up. Not triton: a GPU compiler that npuspeed stands in
    # for where absent (megatron_lm/load_stubs.py). Tokenizer packages (sentencepiece,
    # tiktoken) only as the chosen --tokenizer-type needs them. core_v0.19.0's pretrain_gpt.py
    # path imports no third-party package at load beyond torch and numpy (regex, pydantic,
    # ... are imported lazily there), so nothing is added for 0.17-0.19; megatron-core 0.19
    # itself imports triton at load (schedules -> moe/ops/paged_stash.py).
    "megatron-lm": ["regex", "pydantic", "six", "pyyaml", "psutil", "pybind11"],
}


def _extensions():
    """The op library as a torch CppExtension, or nothing when it cannot be built here."""
    if os.environ.get("NPUSPEED_DISABLE_CPP", "0") not in ("", "0"):
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except Exception as exc:  # no torch in this build environment: JIT at first use
        print(f"npuspeed: not building the C++ op library at install ({exc}); it will be JIT-built",
              file=sys.stderr)
        return [], {}
    import importlib.util

    spec = importlib.util.spec_from_file_location("_npuspeed_build_flags", "npuspeed/ops/build_flags.py")
    flags = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(flags)
    sources = flags.source_files("csrc")  # csrc/cpu everywhere, csrc/x86 on x86_64 only
    ext = CppExtension("npuspeed._C", sources, extra_compile_args=flags.compile_args(),
                       extra_link_args=flags.link_args(), depends=flags.header_files("csrc"))
    # The file carries the interpreter's ABI suffix (_C.cpython-311-...so): a 3.11 and a 3.12 venv
    # installing from one checkout keep one library each (npuspeed/ops/_extension.py picks).
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = _extensions()

setup(
    name="npuspeed",
    version="0.1.0",
    description="Non-invasive acceleration plugin for Megatron-Core on Ascend NPUs, CUDA GPUs and CPUs",
    long_description=open("README.md").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["npuspeed", "npuspeed.*"]),
    python_requires=">=3.11",
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.12,<0.20",  # an installed supported release is never replaced
        "numpy",
        "packaging",
        "einops",
        "tqdm",
        "psutil",  # megatron.core dist_checkpointing saves need it
    ],
    extras_require=EXTRAS,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={"console_scripts": ["npuspeed=npuspeed.cli:main"]},
)
