"""A damaged, foreign or absent checkpoint: one `npuspeed: error:` line before any tensor is
loaded, exit status 2, and the checkpoint directory exactly as it was (nothing trains on
top of it, even with --save pointing at the same place). One source checkpoint, one fork
server (tests/forked.py), one child per damage.
"""
from __future__ import annotations

import os
import shutil

import pytest

from forked import error_lines, run_rows
from launch import TINY, run_example

TRACKER = "latest_checkpointed_iteration.txt"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("source")
    run_example(TINY + ["--train-iters", "4", "--save", str(tmp / "ckpt"), "--save-interval", "2"], tmp, name="src")
    return tmp / "ckpt"


def _truncate(ckpt):
    shard = ckpt / "iter_0000004" / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)


def _garble_common(ckpt):
    common = ckpt / "iter_0000004" / "common.pt"
    if not common.exists():  # megatron-core 0.19 keeps the common state in the .metadata index
        return None
    common.write_bytes(b"\0" * common.stat().st_size)
    return {}


def _remove_last_shard(ckpt):
    """The last shard file (0.12-0.16 write two per rank, __0_0 and __0_1; 0.19 one, __0_0)."""
    shard = sorted((ckpt / "iter_0000004").glob("*.distcp"))[-1]
    shard.unlink()
    return {"shard": shard.name}


DAMAGES = {  # id: (damage, extra argv, expected line after "npuspeed: error: " with {ckpt})
    "truncated-shard": (_truncate, [], "checkpoint {ckpt}/iter_0000004 is damaged: shard __0_0.distcp is "
                                       "truncated ("),
    "missing-shard": (_remove_last_shard, [],
                      "checkpoint {ckpt}/iter_0000004 is damaged: shard {shard} is missing; load an earlier "
                      "one with --ckpt-step 2"),
    "missing-index": (lambda c: (c / "iter_0000004" / ".metadata").unlink(), [],
                      f"--load {{ckpt}}: {TRACKER} names iteration 4, whose directory is missing or incomplete "
                      "(complete ones: 2); pick one with --ckpt-step N"),
    "garbled-common": (_garble_common, [], "checkpoint {ckpt}/iter_0000004 is damaged: common.pt cannot be read"),
    "garbled-tracker": (lambda c: (c / TRACKER).write_text("four"), [],
                        f"--load {{ckpt}}: {TRACKER} holds 'four', not an iteration number"),
    "other-model": (lambda c: None, ["--hidden-size", "128"],
                    "checkpoint {ckpt}/iter_0000004 holds a different model: --hidden-size 64 in the checkpoint, "
                    "128 in this run; --ffn-hidden-size 256 in the checkpoint, 512 in this run"),
    "other-vocab-padding": (lambda c: None, ["--make-vocab-size-divisible-by", "128"],
                            "padded vocabulary size 258 in the checkpoint, 384 in this run (the vocabulary is padded"),
    "no-such-step": (lambda c: None, ["--ckpt-step", "3"],
                     "--ckpt-step 3: no complete checkpoint of iteration 3 under {ckpt} (complete ones: 2, 4)"),
    "empty-dir": (lambda c: [shutil.rmtree(c), c.mkdir()], [], "--load {ckpt} holds no checkpoint"),
    "no-dir": (lambda c: shutil.rmtree(c), [], "--load {ckpt}: no such directory"),
}


def _snapshot(path):
    if not path.exists():
        return None
    return sorted((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*"))


@pytest.fixture(scope="module")
def outcomes(source, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("damaged")
    rows, dirs = [], {}
    for ident, (damage, extra, _msg) in DAMAGES.items():
        ckpt = tmp / ident
        shutil.copytree(source, ckpt)
        fields = damage(ckpt)
        if fields is None and damage is _garble_common:
            continue  # this release writes no such file (the test says so)
        dirs[ident] = (ckpt, _snapshot(ckpt), fields if isinstance(fields, dict) else {})
        # --save at the same place: a refused load must not let training write over it (not for an
        # empty or absent directory: --load = --save there is the auto-resume of a first run)
        save = [] if ident in ("empty-dir", "no-dir") else ["--save", str(ckpt)]
        rows.append((TINY + ["--train-iters", "6", "--load", str(ckpt), *save, *extra], {}))
    fresh = tmp / "fresh"  # Megatron-LM's auto-resume: --load = --save, nothing there yet
    rows.append((TINY + ["--train-iters", "1", "--load", str(fresh), "--save", str(fresh)], {}))
    results = run_rows("initialized", rows)
    return dict(zip(list(dirs) + ["fresh"], results)), dirs, fresh


@pytest.mark.parametrize("ident", list(DAMAGES))
def test_damaged_checkpoint_is_refused_untouched(ident, outcomes):
    results, dirs, _ = outcomes
    if ident not in dirs:
        pytest.skip("this megatron-core keeps the common state in the .metadata index (0.19): no common.pt "
                    "to garble; missing-index covers the index")
    out, (ckpt, before, fields) = results[ident], dirs[ident]
    both = out["stdout"] + out["stderr"]
    assert out["rc"] == 2 and "Traceback" not in both, both[-3000:]
    lines = error_lines(out["stderr"])
    assert len(lines) == 1 and DAMAGES[ident][2].format(ckpt=ckpt, **fields) in lines[0], (lines, both[-2000:])
    assert " iteration " not in out["stdout"]  # no training step ran
    assert _snapshot(ckpt) == before


def test_same_load_and_save_dir_starts_fresh(outcomes):
    results, _, fresh = outcomes
    out = results["fresh"]
    assert out["rc"] == 0, out["stderr"][-3000:]
    assert f"no checkpoint under {fresh} yet: starting from iteration 0" in out["stdout"]
    assert (fresh / "iter_0000001" / ".metadata").is_file() and (fresh / TRACKER).read_text() == "1"
