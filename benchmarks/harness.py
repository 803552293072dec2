"""The shared benchmark harness: baseline vs feature, timed and memory-measured in one process.

API (all a bench script needs):

    from harness import Bench            # run as `python benchmarks/bench_x.py`
    bench = Bench("fused_ops", warmup=2, repeat=5)
    bench.compare("rmsnorm 4096x4096", "bf16", baseline=fn_a, feature=fn_b, extra={...})
    bench.finish()                       # CSV row per case, PNG, printed table

- `baseline` / `feature` are zero-argument callables doing one full step (e.g. fwd+bwd);
  inputs are built by the caller beforehand, so they are not counted.
- Timing: `warmup` untimed calls each, then `repeat` timed calls, baseline and feature
  interleaved so machine noise hits both alike; the median is reported, in ms, with the
  accelerator synchronized around each call.
- Memory: one extra call each, between `reset_peak_memory_stats()` and
  `max_memory_allocated()` of `get_accelerator()`; reported as the peak *above* what was
  live before the call (the working memory of one step). On CPU this needs the tracking
  allocator, which `Bench()` enables before the caller allocates anything; if it is
  unavailable the peaks are 0 and mem_ratio is empty.
- Device: the accelerator npuspeed picks (`NPUSPEED_DEVICE`, else NPU, CUDA, CPU); benches
  build tensors on `bench.device` and skip layouts needing more devices than the host has
  (`bench.ranks_fit(n)`: NCCL / HCCL cannot put two ranks on one device).
- Results are appended to `benchmarks/results/<device>.csv` (one file per device kind, so
  runs accumulate), a bar plot per bench goes to `benchmarks/results/<bench>_<device>.png`
  (git-ignored), and a table is printed. `speedup` = baseline_ms / feature_ms;
  `mem_ratio` = feature_peak / baseline_peak (lower is better).
"""
from __future__ import annotations

import csv
import datetime as _dt
import gc
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

RESULTS_DIR = Path(__file__).resolve().parent / "results"
COLUMNS = [
    "timestamp", "bench", "case", "dtype", "baseline_ms", "feature_ms", "speedup",
    "baseline_peak_bytes", "feature_peak_bytes", "mem_ratio", "device", "extra",
]


@dataclass
class Row:
    bench: str
    case: str
    dtype: str
    baseline_ms: float
    feature_ms: float
    baseline_peak_bytes: int
    feature_peak_bytes: int
    extra: dict = field(default_factory=dict)

    @property
    def speedup(self) -> float:
        return self.baseline_ms / self.feature_ms if self.feature_ms > 0 else float("nan")

    @property
    def mem_ratio(self) -> float | None:
        if self.baseline_peak_bytes <= 0:
            return None
        return self.feature_peak_bytes / self.baseline_peak_bytes


def init_single_rank_megatron(npuspeed_flags: list[str]):
    """npuspeed with `npuspeed_flags` (before megatron.core, as the adaptor does), then a 1-rank
    group of the accelerator's collective library (gloo on CPU, nccl / hccl on device 0) with
    Megatron's model-parallel state (TP=PP=1) and its RNG tracker."""
    import socket

    from npuspeed import runtime

    state = runtime.initialize(list(npuspeed_flags))
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    acc = state.accelerator
    if acc.name != "cpu":
        acc.set_device(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(acc.dist_backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    return state


def _accelerator():
    from npuspeed.accelerator import get_accelerator

    return get_accelerator()


def ranks_fit(nproc: int, what: str) -> bool:
    """Whether `nproc` ranks can run here: any number on CPU (gloo processes), one per device on
    an accelerator (NCCL / HCCL refuse two ranks on one device). Says so when not."""
    acc = _accelerator()
    if acc.name == "cpu" or acc.device_count() >= nproc:
        return True
    print(f"[{what}] skipped: {nproc} ranks need {nproc} {acc.name} devices, this host has "
          f"{acc.device_count()}", flush=True)
    return False


class Bench:
    def __init__(self, name: str, *, warmup: int = 2, repeat: int = 5, results_dir: Path | str | None = None):
        self.name = name
        self.warmup = int(os.environ.get("NPUSPEED_BENCH_WARMUP", warmup))
        self.repeat = int(os.environ.get("NPUSPEED_BENCH_REPEAT", repeat))
        self.results_dir = Path(results_dir) if results_dir else RESULTS_DIR
        self.acc = _accelerator()
        # CPU: count storages from here on, with the block cache training runs have; a device's
        # own allocator counts already (no-ops there)
        self.acc.enable_memory_tracking()
        self.acc.configure_host_cache()
        self.rows: list[Row] = []

    @property
    def device(self):
        """Where a bench builds its tensors and modules: the accelerator's current device."""
        return self.acc.device()

    def ranks_fit(self, nproc: int) -> bool:
        """`ranks_fit` for this bench's layouts."""
        return ranks_fit(nproc, self.name)

    # -- measuring -----------------------------------------------------------------------------
    def _timed(self, fn: Callable[[], object]) -> float:
        self.acc.synchronize()
        start = time.perf_counter()
        fn()
        self.acc.synchronize()
        return (time.perf_counter() - start) * 1e3

    def _peak(self, fn: Callable[[], object]) -> int:
        gc.collect()
        self.acc.synchronize()
        before = self.acc.memory_allocated()
        self.acc.reset_peak_memory_stats()
        fn()
        self.acc.synchronize()
        return max(0, int(self.acc.max_memory_allocated()) - int(before))

    def compare(self, case: str, dtype: str, *, baseline: Callable[[], object],
                feature: Callable[[], object], extra: dict | None = None) -> Row:
        """Measure both callables and record one row (also returned)."""
        for _ in range(self.warmup):
            baseline()
            feature()
        base_t, feat_t = [], []
        for _ in range(self.repeat):
            base_t.append(self._timed(baseline))
            feat_t.append(self._timed(feature))
        row = Row(self.name, case, dtype, statistics.median(base_t), statistics.median(feat_t),
                  self._peak(baseline), self._peak(feature), dict(extra or {}))
        row.extra.setdefault("repeat", self.repeat)
        self.rows.append(row)
        print(f"[{self.name}] {case} {dtype}: baseline {row.baseline_ms:.2f} ms, "
              f"feature {row.feature_ms:.2f} ms, x{row.speedup:.2f}", flush=True)
        return row

    def add(self, case: str, dtype: str, *, baseline_ms: float, feature_ms: float,
            baseline_peak_bytes: int = 0, feature_peak_bytes: int = 0, extra: dict | None = None) -> Row:
        """Record a row measured elsewhere (e.g. whole training runs in subprocesses)."""
        row = Row(self.name, case, dtype, baseline_ms, feature_ms, baseline_peak_bytes,
                  feature_peak_bytes, dict(extra or {}))
        self.rows.append(row)
        return row

    # -- output --------------------------------------------------------------------------------
    def finish(self) -> Path:
        """Append the rows to the device CSV, draw the PNG, print the table; return the CSV."""
        self.results_dir.mkdir(parents=True, exist_ok=True)
        device = self.acc.name
        path = self.results_dir / f"{device}.csv"
        fresh = not path.exists()
        stamp = _dt.datetime.now().isoformat(timespec="seconds")
        with open(path, "a", newline="") as fh:
            writer = csv.writer(fh)
            if fresh:
                writer.writerow(COLUMNS)
            for r in self.rows:
                ratio = r.mem_ratio
                writer.writerow([
                    stamp, r.bench, r.case, r.dtype, f"{r.baseline_ms:.4f}", f"{r.feature_ms:.4f}",
                    f"{r.speedup:.3f}", r.baseline_peak_bytes, r.feature_peak_bytes,
                    "" if ratio is None else f"{ratio:.3f}", device, json.dumps(r.extra, sort_keys=True),
                ])
        print(self.table())
        try:
            png = self.plot(self.results_dir / f"{self.name}_{device}.png")
            print(f"wrote {path} and {png}")
        except ImportError as exc:  # matplotlib is the `bench` extra
            print(f"wrote {path} (no plot: {exc})")
        return path

    def table(self) -> str:
        head = f"{'case':<32} {'dtype':<6} {'base ms':>10} {'feat ms':>10} {'speedup':>8} {'base MiB':>9} {'feat MiB':>9} {'mem':>6}"
        lines = [head, "-" * len(head)]
        for r in self.rows:
            ratio = "" if r.mem_ratio is None else f"{r.mem_ratio:.2f}"
            lines.append(
                f"{r.case:<32} {r.dtype:<6} {r.baseline_ms:>10.2f} {r.feature_ms:>10.2f} "
                f"{r.speedup:>7.2f}x {r.baseline_peak_bytes / 2**20:>9.1f} "
                f"{r.feature_peak_bytes / 2**20:>9.1f} {ratio:>6}"
            )
        return "\n".join(lines)

    def plot(self, path: Path) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        labels = [f"{r.case}\n{r.dtype}" for r in self.rows]
        xs = range(len(self.rows))
        width = 0.4
        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(max(10, 2.2 * len(self.rows)), 4.5))
        ax_t.bar([x - width / 2 for x in xs], [r.baseline_ms for r in self.rows], width, label="baseline")
        ax_t.bar([x + width / 2 for x in xs], [r.feature_ms for r in self.rows], width, label="feature")
        for x, r in zip(xs, self.rows):
            ax_t.annotate(f"x{r.speedup:.2f}", (x, max(r.baseline_ms, r.feature_ms)), ha="center", va="bottom", fontsize=8)
        ax_t.set_ylabel("median ms per step")
        ax_t.set_title(f"{self.name}: time ({self.acc.name})")
        ax_m.bar([x - width / 2 for x in xs], [r.baseline_peak_bytes / 2**20 for r in self.rows], width, label="baseline")
        ax_m.bar([x + width / 2 for x in xs], [r.feature_peak_bytes / 2**20 for r in self.rows], width, label="feature")
        ax_m.set_ylabel("peak MiB above inputs")
        ax_m.set_title(f"{self.name}: memory ({self.acc.name})")
        for ax in (ax_t, ax_m):
            ax.set_xticks(list(xs))
            ax.set_xticklabels(labels, fontsize=7)
            ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path
