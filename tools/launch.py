"""Run examples/pretrain_gpt.py as a user would (torchrun) and read its summary: the one
launcher that the tests and the benchmarks share (both put tools/ on sys.path)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "pretrain_gpt.py"

# Small, deterministic, and identical padded vocab for every TP size.
TINY = ["--use-cpu-initialization", "--make-vocab-size-divisible-by", "1",
        "--global-batch-size", "4", "--micro-batch-size", "2", "--log-interval", "1"]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
         "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_example(args: list[str], tmp_path: Path, nproc: int = 1, name: str = "run",
                env: dict | None = None, timeout: int = 600, script: Path | str | None = None,
                torchrun_args: list[str] | None = None) -> dict:
    """Train; return the summary JSON (with the combined output under 'log'). `script`: the
    example itself (default: `EXAMPLE`, read at call time so a test may point it at a runner),
    or a runner that runs it unchanged and dumps more (see `run_then_dump`); `torchrun_args`:
    more of torchrun's own options (e.g. `--max-restarts 1`)."""
    script = EXAMPLE if script is None else script
    summary = Path(tmp_path) / f"{name}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *(torchrun_args or []),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script)]
    cmd += list(args) + ["--summary-json", str(summary)]
    run_env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    run_env.update(env or {})
    if torchrun_args:  # a restarting launch: leftovers of a killed attempt must not hold the output
        returncode, log = _run_in_own_session(cmd, run_env, timeout)
    else:
        proc = subprocess.run(cmd, cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=timeout)
        returncode, log = proc.returncode, proc.stdout + proc.stderr
    if returncode != 0 or not summary.exists():
        raise AssertionError(f"example failed ({returncode}): {' '.join(cmd)}\n{log[-6000:]}")
    result = json.loads(summary.read_text())
    result["log"] = log
    return result


def _run_in_own_session(cmd: list[str], env: dict, timeout: int) -> tuple[int, str]:
    """torchrun with its output in a file, and every process it left behind killed after it exits.
    A worker killed mid-run (an elastic restart's first attempt) leaves its multiprocessing children
    orphaned but alive (torchelastic starts each worker in a session of its own, so they are in no
    group of ours); through pipes, reading torchrun's output then waits for them until the timeout
    (seen here: 10 minutes for a 1-minute run). They carry this launch's mark in their environment."""
    import signal
    import tempfile
    import uuid

    mark = f"NPUSPEED_LAUNCH_MARK={uuid.uuid4().hex}"
    env = dict(env, NPUSPEED_LAUNCH_MARK=mark.partition("=")[2])
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        try:
            returncode = proc.wait(timeout=timeout)
        finally:
            proc.kill()
            for pid in _marked(mark.encode()):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        out.seek(0)
        return returncode, out.read()


def _marked(mark: bytes) -> list[int]:
    """Processes whose environment holds `mark` (Linux /proc; none found elsewhere)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if mark in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def run_then_dump(option: str, collect) -> None:
    """Body of a runner script: run the example unchanged with this process's argv minus
    `option PATH`, then write `collect()` as JSON to `PATH.rank<RANK>` (counters that prove a
    feature's path ran, read by the test that launched it through `run_example`)."""
    import runpy

    argv = sys.argv[1:]
    i = argv.index(option)
    out = argv[i + 1]
    del argv[i:i + 2]
    sys.argv = [str(EXAMPLE), *argv]
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    with open(f"{out}.rank{os.environ.get('RANK', '0')}", "w") as fh:
        json.dump(collect(), fh)


def max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))
