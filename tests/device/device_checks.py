"""The device tier's checks on a run's summary: where it trained, what ran (path counters by
name), parity, and the memory or time effect a flag claims. The runs themselves: device_runs.py."""
from __future__ import annotations

import os
import warnings

from launch import max_abs_diff  # tools/ is on sys.path (tests/conftest.py)

from device_runs import BF16_TOL, HEADS, ITERS, LAYERS, MICRO, MICRO_BATCHES, SEQ, TIME_SLACK, accelerator, device_only


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
#: attention's query and key together (features/fused_rotary_pos_emb/rope_qk.py) as `rotary_pos_emb_qk`,
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
