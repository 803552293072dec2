"""--use-fused-linear-cross-entropy on the accelerator with a 64k vocabulary (NullTokenizer): the
output layer and the cross-entropy run in tiles, no [s, b, V] logits. README: losses agree (bf16
tolerance), the chunked path ran every micro-batch (its counters), the forward/backward peak
drops by at least half the bf16 logits' bytes; --fused-linear-cross-entropy-chunk-size bounds a
tile (more tiles a call); --fused-linear-cross-entropy-fallback never always tiles, auto takes
per shape the tiles or Megatron's path (each call counted under one of them)."""
from __future__ import annotations

import math

import pytest

from device_checks import assert_on_device, assert_parity, counters
from device_runs import ITERS, MICRO, MICRO_BATCHES, MODEL, NO_DROPOUT, SEQ, train

pytestmark = pytest.mark.device
COVERS = ("--use-fused-linear-cross-entropy", "--fused-linear-cross-entropy-chunk-size",
          "--fused-linear-cross-entropy-fallback")

#: NullTokenizer: vocabulary 65535 + its end-of-document token, a multiple of 128 already
VOCAB = 65536
ARGS = MODEL + NO_DROPOUT + ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1)]
FLAG = ["--use-fused-linear-cross-entropy"]
NEVER = ["--fused-linear-cross-entropy-fallback", "never"]
LOGITS = MICRO * SEQ * VOCAB  # entries of one micro-batch's [s, b, V] logits
#: 32 tiles a call at least (the defaults: 8 on the device model, 16 on the host's)
CHUNK = LOGITS // 32
CALLS = MICRO_BATCHES * ITERS


def _tiled(run: dict) -> dict:
    c = counters(run, "fused_linear_ce.")
    assert c.get("fused_linear_ce.calls") == CALLS and c.get("fused_linear_ce.chunks", 0) >= 2 * CALLS, c
    assert not any(k.startswith("fused_linear_ce.fallback.") for k in c), c
    return c


def test_no_logits(tmp_path_factory):
    base = train(tmp_path_factory, ARGS)
    run = train(tmp_path_factory, ARGS + FLAG + NEVER)
    assert_on_device(base, run)
    assert not counters(base, "fused_linear_ce."), base["npuspeed_counters"]
    _tiled(run)
    assert_parity(base, run)
    saved = base["forward_backward_peak_bytes"] - run["forward_backward_peak_bytes"]
    assert saved >= LOGITS * 2 / 2, f"peak {saved / 2**20:.0f} MiB lower, bf16 logits {LOGITS * 2 / 2**20:.0f} MiB"


def test_chunk_size(tmp_path_factory):
    default = train(tmp_path_factory, ARGS + FLAG + NEVER)
    run = train(tmp_path_factory, ARGS + FLAG + NEVER + ["--fused-linear-cross-entropy-chunk-size", str(CHUNK)])
    assert_on_device(run)
    small, c = _tiled(run), _tiled(default)
    # each forward issues at least LOGITS / CHUNK tiles (backward as many again)
    assert small["fused_linear_ce.chunks"] >= CALLS * math.ceil(LOGITS / CHUNK), small
    assert small["fused_linear_ce.chunks"] > c["fused_linear_ce.chunks"], (small, c)
    assert_parity(default, run)


def test_fallback_auto(tmp_path_factory):
    base = train(tmp_path_factory, ARGS)
    run = train(tmp_path_factory, ARGS + FLAG)
    assert_on_device(run)
    c = counters(run, "fused_linear_ce.")
    # every call ran the tiles or, measured slower here, Megatron's path: never neither
    tiles, megatron = c.get("fused_linear_ce.calls", 0), c.get("fused_linear_ce.fallback.measured_slower", 0)
    assert tiles + megatron == CALLS and (tiles == 0 or megatron == 0), c
    assert_parity(base, run)
