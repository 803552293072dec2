"""What every device-tier test shares: the accelerator present, one small Llama-style model,
training runs of the example on that device (one rank, cached per argument list for the
session, so a flag-off run serves every test that compares with it); the comparisons are in
device_checks.py.

A test trains the example with one feature and without it on the same device and checks
(1) the feature's own path ran there (npuspeed's counters in the summary, never the CPU
kernels), (2) the losses agree within bf16 tolerance, or bitwise under `--deterministic-mode`
where the CPU tier promises bitwise, (3) the memory (or speed) effect the README claims, from
the device allocator, and (4) the summary's "device" is the accelerator's.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import time
import warnings
from pathlib import Path

from launch import run_example  # tools/ is on sys.path (tests/conftest.py)

REASON = "no CUDA or NPU device: the device tier needs an accelerator"
RUNNER = Path(__file__).with_name("_example_with_attention.py")

#: per-iteration |loss difference| between two kernels in bf16 (the CPU tier's bf16 tolerance,
#: tests/distributed/test_feature_combinations.py)
BF16_TOL = 2e-2
#: a flag may not make a step slower ("never slower than the flag off"); this much is noise
TIME_SLACK = 0.10

#: NPUSPEED_DEVICE_TIER_HOST=cpu runs the tier's own code on the CPU with a tiny model: a check
#: of the tests themselves (summary keys, counter names, runs that start) for the day a device is
#: lent; checks that cannot hold where the host is the device are skipped there (`device_only`)
HOST_ENV = "NPUSPEED_DEVICE_TIER_HOST"
ON_HOST = os.environ.get(HOST_ENV, "") == "cpu"
if os.environ.get(HOST_ENV, "") not in ("", "cpu"):
    raise RuntimeError(f"{HOST_ENV}={os.environ[HOST_ENV]!r}: set it to 'cpu' (the harness check) or unset it")

if ON_HOST:
    LAYERS, HIDDEN, HEADS, GROUPS, FFN, SEQ = 2, 64, 4, 2, 176, 128
    MICRO, GLOBAL, ITERS = 2, 4, 4
else:
    LAYERS, HIDDEN, HEADS, GROUPS, FFN, SEQ = 4, 1024, 16, 4, 2816, 2048
    MICRO, GLOBAL, ITERS = 2, 4, 8
MICRO_BATCHES = GLOBAL // MICRO  # one rank: DP 1
#: the example's byte tokenizer: 256 bytes and 2 specials (padded to a multiple of 128: 384)
VOCAB = 258
#: Llama-style (RMSNorm, SwiGLU, RoPE, GQA 16/4, no biases, untied output), bf16. Weights are
#: initialized on the host by global name (--use-cpu-initialization), so two runs whose modules
#: differ (GroupedMLP vs SequentialMLP) start from the same numbers.
MODEL = [
    "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
    "--group-query-attention", "--num-query-groups", str(GROUPS), "--ffn-hidden-size", str(FFN),
    "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
    "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--bf16", "--use-cpu-initialization",
    "--micro-batch-size", str(MICRO), "--global-batch-size", str(GLOBAL), "--train-iters", str(ITERS),
    "--log-interval", "1",
]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
#: Megatron-LM's flag: deterministic kernels and workspace, so two runs are bitwise equal
DETERMINISTIC = ["--deterministic-mode"]
#: packed documents of S/4 tokens (512 on the device model), each attending only inside itself
DOCUMENTS = ["--reset-attention-mask", "--reset-position-ids", "--mock-document-length", str(SEQ // 4)]

#: the kernel name each accelerator's fused attention counts (summary "attention_calls")
ATTENTION_KERNEL = {"cuda": "sdpa", "npu": "npu_fusion_attention"}
#: ... and for packed documents (the CP-1 path: "<block kernel>+documents")
DOCUMENT_KERNEL = {"cuda": "aten_flash_cuda+documents", "npu": "npu_fusion_attention+documents"}
if ON_HOST:  # npuspeed's bf16 CPU kernel where the CPU has AVX512-BF16, else its fp32 one on copies
    from npuspeed.ops import flash_attention as _cpu_flash

    _CPU_KERNEL = "npuspeed_flash_bf16" if _cpu_flash.machine_reason() is None else "npuspeed_flash_fp32"
    ATTENTION_KERNEL["cpu"], DOCUMENT_KERNEL["cpu"] = _CPU_KERNEL, _CPU_KERNEL + "+documents"


@functools.cache
def accelerator() -> str | None:
    """"cuda" or "npu" as npuspeed detects it with NPUSPEED_DEVICE unset (the CPU tier's pin
    and a user's choice ignored); None on a host with neither; "cpu" in the harness check."""
    from npuspeed.accelerator import select_device_name

    if ON_HOST:
        return "cpu"
    saved = os.environ.pop("NPUSPEED_DEVICE", None)
    try:
        name = select_device_name()
    finally:
        if saved is not None:
            os.environ["NPUSPEED_DEVICE"] = saved
    return None if name == "cpu" else name


def _env() -> dict:
    threads = str(min(8, os.cpu_count() or 1))  # host-side work: initialization by name, data
    env = {"NPUSPEED_DEVICE": accelerator(), "NPUSPEED_ARGS": "", "OMP_NUM_THREADS": threads}
    if ON_HOST:  # the host is the device: run --swap-optimizer's copies anyway (its CPU tests do)
        env.update(NPUSPEED_SWAP_OPTIMIZER="run", OMP_NUM_THREADS="1")
    return env


def device_only(reason: str) -> bool:
    """True on an accelerator; in the harness check (the host is the device) False, with a
    warning naming the check skipped there and why."""
    if ON_HOST:
        warnings.warn(f"{HOST_ENV}=cpu: not checked where the host is the device: {reason}", stacklevel=2)
        return False
    return True


#: the fused-op rule (npuspeed/ops/fused_choice.py) forced onto npuspeed's kernels, so a test
#: can prove they train on the device (unforced, the rule may measure Megatron's path faster)
FORCE_NPUSPEED = {"NPUSPEED_FUSED_OP_PATH": "npuspeed"}
#: npuspeed's kernel for the fused ops on each accelerator
FUSED_KERNEL = {"cuda": "triton", "npu": "npu", "cpu": "cpp"}

_RUNS: dict[tuple, dict] = {}


def train(tmp_path_factory, args: list[str], env: dict | None = None) -> dict:
    """One run of the example on the accelerator (1 rank): its summary, the log under "log" and
    the latest fused-attention call under "attention_last". Cached per argument list and env."""
    key = (tuple(args), tuple(sorted((env or {}).items())))
    if key not in _RUNS:
        out = tmp_path_factory.mktemp("device_run")
        details = out / "attention.json"
        start = time.perf_counter()
        run = run_example(list(args) + ["--attention-json", str(details)], out, nproc=1, env={**_env(), **(env or {})},
                          timeout=900, script=RUNNER)
        run["attention_last"] = json.loads(Path(f"{details}.rank0").read_text())["last"]
        run["wall_s"] = time.perf_counter() - start  # the whole run: start-up, training, exit
        _RUNS[key] = run
    return _RUNS[key]


def runs_done() -> tuple[int, float]:
    """Example runs this session (each argument list once) and their wall seconds in all."""
    return len(_RUNS), sum(run["wall_s"] for run in _RUNS.values())


def refused(tmp_path_factory, args: list[str]) -> str:
    """A run the adaptor must refuse at start-up on this device: its `npuspeed: error:` line."""
    out = tmp_path_factory.mktemp("device_refused")
    try:
        run_example(list(args), out, nproc=1, env=_env(), timeout=300)
    except AssertionError as exc:
        log = str(exc)
    else:
        raise AssertionError(f"the run was not refused: {' '.join(args)}")
    lines = [line for line in log.splitlines() if "npuspeed: error:" in line]
    assert lines, log[-3000:]
    return lines[0]


def plan_peak(args: list[str]) -> int:
    """`npuspeed plan --json`'s predicted peak for the run's flags on this device (1 rank)."""
    import subprocess

    from launch import ROOT

    cmd = [sys.executable, "-m", "npuspeed.cli", "plan", *args, "--nproc-per-node", "1", "--json"]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, **_env()), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"npuspeed plan: rc {proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    return int(json.loads(proc.stdout)["peak_mem_bytes"])
