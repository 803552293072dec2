"""What every device-tier test shares: the accelerator present, one small Llama-style model,
training runs of the example on that device (one rank, cached per argument list for the
session, so a flag-off run serves every test that compares with it) and the comparisons.

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

from launch import max_abs_diff, run_example  # tools/ is on sys.path (tests/conftest.py)

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


# -- checks ------------------------------------------------------------------------------------
def assert_on_device(*runs: dict) -> None:
    """Each run trained on the accelerator: its backend, where every parameter of the model
    lives and where the batches the forward step handed the model lived (the summary's own
    record of the tensors, not the backend name the test chose)."""
    acc = accelerator()
    for run in runs:
        assert run["device"] == acc, (run["device"], acc)
        assert run["param_devices"] == [acc], f"parameters on {run['param_devices']}, not only on {acc}"
        assert run["batch_devices"] == [acc], f"batches on {run['batch_devices']}, not only on {acc}"
        assert len(run["losses"]) == run["iterations"] - run["first_iteration"] + 1


def assert_deterministic(*runs: dict) -> None:
    """--deterministic-mode was in force in each run (the summary's own record of it)."""
    for run in runs:
        assert run["deterministic_mode"] is True, "--deterministic-mode was not in force"


def assert_parity(base: dict, run: dict, tol: float = BF16_TOL) -> float:
    """Every iteration's loss within `tol` of the flag-off run's, and the run learns; returns the gap."""
    assert len(run["losses"]) == len(base["losses"]) == ITERS, (len(run["losses"]), len(base["losses"]))
    gap = max_abs_diff(run["losses"], base["losses"])
    assert gap <= tol, f"loss gap {gap:.3e} > {tol:.0e}: {run['losses']} vs {base['losses']}"
    assert run["losses"][-1] < run["losses"][0], f"loss did not fall: {run['losses']}"
    return gap


#: set by `make device-report`, which runs the tier in several processes on one device (their
#: memory is per process, their step times are not): the time comparisons are left to the
#: report's own sequential runs
SHARED_ENV = "NPUSPEED_DEVICE_TIER_SHARED"


def assert_not_slower(base: dict, run: dict, slack: float = TIME_SLACK) -> None:
    """The median step (first step excluded) with the flag is not above the one without it."""
    if not device_only("step time (a shared CPU host's wall time is noise)"):
        return
    if os.environ.get(SHARED_ENV) == "1":  # `make device-report` times each flag in runs of its own
        warnings.warn(f"{SHARED_ENV}=1: step time not compared (the tier shares the device with its other "
                      "workers; the device report measures it in runs of its own)", stacklevel=2)
        return
    ratio = run["median_step_ms"] / base["median_step_ms"]
    assert ratio <= 1 + slack, (f"the flag made a step slower: {run['median_step_ms']:.1f} ms vs "
                                f"{base['median_step_ms']:.1f} ms (x{ratio:.2f})")


#: bytes of the bf16 attention probabilities [b, heads, S, S] of every layer of one micro-batch
SXS_BYTES = LAYERS * MICRO * HEADS * SEQ * SEQ * 2


def assert_sxs_saved(base: dict, run: dict) -> None:
    """README: no S x S tensor. Megatron's unfused path keeps at least the bf16 probabilities of
    every layer for backward, so the fused run's forward/backward peak is lower by at least half."""
    before, after = base["forward_backward_peak_bytes"], run["forward_backward_peak_bytes"]
    assert before - after >= SXS_BYTES / 2, (f"fused attention saved {(before - after) / 2**20:.1f} MiB of the "
                                             f"forward/backward peak ({before} -> {after} bytes), expected >= "
                                             f"{SXS_BYTES / 2 / 2**20:.1f} MiB")


def counters(run: dict, prefix: str) -> dict[str, int]:
    return {k: v for k, v in run["npuspeed_counters"].items() if k.startswith(prefix)}


#: ops whose calls may be counted under another name: with Triton present, RoPE rotates an
#: attention's query and key together (features/fused_ops/rope_qk.py) as `rotary_pos_emb_qk`,
#: whichever candidate the rule picks there (Megatron's included)
COUNTED_AS = {"rotary_pos_emb": ("rotary_pos_emb", "rotary_pos_emb_qk")}


def op_impls(run: dict, op: str) -> dict[str, int]:
    """implementation -> calls of npuspeed op `op` (counters `ops.<op>.<impl>`, and those of
    the names it is also counted under, COUNTED_AS)."""
    found: dict[str, int] = {}
    for name in COUNTED_AS.get(op, (op,)):
        prefix = f"ops.{name}."
        for key, calls in counters(run, prefix).items():
            found[key[len(prefix):]] = found.get(key[len(prefix):], 0) + calls
    return found


def assert_device_impl(run: dict, op: str, only: str | None = None) -> dict[str, int]:
    """The flag's path of `op` ran (counted by the implementation the fused-op rule picked:
    npuspeed's kernel, the native op or Megatron's path), never npuspeed's CPU kernel on the
    device; `only`: every call ran that implementation."""
    impls = op_impls(run, op)
    assert impls and all(n > 0 for n in impls.values()), f"{op} never ran: {run['npuspeed_counters']}"
    if device_only(f"{op} never on npuspeed's CPU kernel"):
        assert "cpp" not in impls, f"{op} ran npuspeed's CPU kernel on {accelerator()}: {impls}"
    if only is not None:
        assert set(impls) == {only}, f"{op}: expected every call on {only}, got {impls}"
    return impls


def attention_calls(run: dict) -> dict[str, int]:
    return dict(run["attention_calls"]["calls"])


def layer_calls() -> int:
    """Forwards of each per-layer module in one run: every layer, micro-batch and iteration."""
    return LAYERS * MICRO_BATCHES * ITERS
