"""--npuspeed-dump on the accelerator: the dump reads the device's tensors (statistics on the
device, tensors copied to the host one at a time) and leaves the run as it was. README: under
--deterministic-mode the losses are bitwise those of the run without the flag; the same
configuration dumped twice compares as "no divergence" (`npuspeed compare`); `--dump-level
tensors` adds at most its largest tensor to the device peak (the dump streams to disk)."""
from __future__ import annotations

import pytest

from device_checks import assert_deterministic, assert_on_device
from device_runs import DETERMINISTIC, MODEL, NO_DROPOUT, device_only, train

pytestmark = pytest.mark.device
COVERS = ("--npuspeed-dump", "--dump-steps", "--dump-modules", "--dump-level")

ARGS = MODEL + NO_DROPOUT + DETERMINISTIC


def _dump(tmp_path_factory, name: str, extra: list[str]):
    folder = tmp_path_factory.mktemp(name)
    return folder, train(tmp_path_factory, ARGS + ["--npuspeed-dump", str(folder), "--dump-steps", "1-2",
                                                   "--dump-modules", "*layers.1*"] + extra)


def test_dump(tmp_path_factory):
    from npuspeed.compare import cli

    base = train(tmp_path_factory, ARGS)
    a_dir, a = _dump(tmp_path_factory, "dump_a", [])
    b_dir, b = _dump(tmp_path_factory, "dump_b", [])
    t_dir, t = _dump(tmp_path_factory, "dump_t", ["--dump-level", "tensors"])
    assert_on_device(base, a, b, t)
    assert_deterministic(base, a, b, t)
    assert a["losses"] == base["losses"] == b["losses"] == t["losses"]
    assert a["npuspeed_counters"].get("dump.records", 0) > 0, a["npuspeed_counters"]
    same = cli.run(cli.parser().parse_args([str(a_dir), str(b_dir), "--no-plot"]))
    assert same["divergence"] is None and same["steps_compared"] == [1, 2], same
    against = cli.run(cli.parser().parse_args([str(a_dir), str(t_dir), "--no-plot"]))
    assert against["divergence"] is None, against
    if not device_only("the device peak (the host is the device)"):
        return
    largest = max(p.stat().st_size for p in t_dir.rglob("*.pt"))
    grown = t["peak_mem_bytes"] - base["peak_mem_bytes"]
    assert grown <= largest * 1.05 + 2**20, f"device peak {grown} bytes above the run without the dump, largest tensor {largest}"
