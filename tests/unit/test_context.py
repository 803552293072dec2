"""The one context every feature hook gets, and the one counter registry.

The argv given to `runtime.initialize(argv)` is the one every feature reads: before the
context existed, features re-read `sys.argv` and validated `npuspeed report <flags>` (and
tests passing flags) against the wrong command line.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from npuspeed import telemetry


def test_counters_count_snapshot_since_and_reset():
    telemetry.reset("test.ctx.")
    before = telemetry.snapshot("test.ctx.")
    telemetry.count("test.ctx.a")
    telemetry.count("test.ctx.a", 2)
    telemetry.count("test.ctx.b")
    assert telemetry.get("test.ctx.a") == 3
    assert telemetry.since(before, "test.ctx.") == {"test.ctx.a": 3, "test.ctx.b": 1}
    telemetry.record("test.ctx.call", kernel="k", n=1)
    assert telemetry.last("test.ctx.call") == {"kernel": "k", "n": 1}
    telemetry.reset("test.ctx.")
    assert telemetry.snapshot("test.ctx.") == {} and telemetry.last("test.ctx.call") == {}


def test_once_is_true_the_first_time_only():
    key = ("test.ctx.once", object())  # never seen before
    assert telemetry.once(key) is True
    assert telemetry.once(key) is False
    assert key in telemetry.seen_once("test.ctx.once")


_PROBE = r"""
import json, sys
sys.argv = ["train.py", "--fp16", "--tensor-model-parallel-size", "1"]  # not what initialize gets
from npuspeed import runtime
state = runtime.initialize(["--reuse-fp32-param", "--bf16", "--use-coc", "--coc-parallel-num", "2",
                            "--tensor-model-parallel-size", "2"])
ctx = state.context
print(json.dumps({"bf16": ctx.megatron.bf16, "fp16": ctx.megatron.fp16,
                  "tp": ctx.megatron.tensor_model_parallel_size, "argv": list(ctx.argv),
                  "active": [f.name for f, on in state.features if on]}))
"""


def test_initialize_reads_the_argv_it_is_given_not_sys_argv():
    """With sys.argv's --fp16 and TP1, reuse-fp32-param and CoC would refuse to start."""
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "NPUSPEED_ARGS": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (got["bf16"], got["fp16"], got["tp"]) == (True, None, 2)
    assert {"reuse_fp32_param", "coc_overlap"} <= set(got["active"])


def test_megatron_flags_not_given_are_none():
    from npuspeed import megatron_flags

    ns = megatron_flags.parse(["--bf16", "--normalization", "RMSNorm", "--lr", "1"])
    assert ns.bf16 is True and ns.normalization == "RMSNorm"
    assert ns.fp16 is None and ns.swiglu is None and ns.tensor_model_parallel_size is None


def test_context_note_records_once():
    from npuspeed.context import Context

    ctx = Context(args=None, megatron=None, accelerator=None)
    ctx.note("a fallback")
    ctx.note("a fallback")
    assert ctx.notes == ["a fallback"]


@pytest.mark.parametrize("argv, needle", [
    (["--use-fused-rmsnorm", "--normalization", "LayerNorm"], "--normalization is LayerNorm"),
    (["--use-fused-rotary-pos-emb", "--position-embedding-type", "learned_absolute"],
     "--position-embedding-type is learned_absolute"),
])
def test_flags_the_command_line_contradicts_refuse_at_start_up(npuspeed_runtime, argv, needle):
    from feature_ctx import ctx_for

    from npuspeed.features import FeatureError, all_features

    ctx = ctx_for(argv)
    with pytest.raises(FeatureError, match=needle):
        for feature in all_features():
            if not feature.always_on and feature.enabled(ctx.args):
                feature.validate(ctx)
