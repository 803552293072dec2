"""Start N ranks as separate processes with RANK/WORLD_SIZE/MASTER_* set, as srun or mpirun do.

Unlike torchrun there is no agent that stops the other ranks when one dies: what a
surviving rank does about a dead or silent peer is then the program's own behaviour.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from launch import ROOT, free_port
from tiers import pinned


@dataclass
class Rank:
    proc: subprocess.Popen
    files: tuple = ()
    out: str = ""
    err: str = ""

    @property
    def rc(self):
        return self.proc.returncode


def start(script, args: list[str], nproc: int, env: dict | None = None) -> list[Rank]:
    port = str(free_port())
    ranks = []
    for r in range(nproc):
        run_env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=port, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc))
        for key in ("NPUSPEED_ARGS", "NPUSPEED_DEBUG", "TORCHELASTIC_ERROR_FILE"):
            run_env.pop(key, None)
        pinned(run_env)  # the CPU tier's backend
        run_env.update(env or {})
        files = (tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+"))  # no pipe to fill up
        proc = subprocess.Popen([sys.executable, str(script), *args], cwd=ROOT, env=run_env,
                                stdout=files[0], stderr=files[1], text=True, start_new_session=True)
        ranks.append(Rank(proc, files))
    return ranks


def wait(ranks: list[Rank], timeout: float, stopped_ok: bool = True) -> list[Rank]:
    """Collect every rank; a rank still alive after `timeout` s (a hang) fails the caller.
    Stopped (SIGSTOP) ranks are killed once the others are done."""
    deadline = time.monotonic() + timeout
    pending = list(ranks)
    while pending and time.monotonic() < deadline:
        for rank in list(pending):
            if rank.proc.poll() is not None:
                pending.remove(rank)
        if pending and stopped_ok and all(_stopped(r.proc.pid) for r in pending):
            for rank in pending:
                rank.proc.send_signal(signal.SIGKILL)
        time.sleep(0.05)
    hung = [r for r in ranks if r.proc.poll() is None]
    for rank in hung:
        rank.proc.kill()
    for rank in ranks:
        rank.proc.wait()
        try:  # what a SIGKILLed rank leaves behind (a checkpoint writer's spawned manager)
            os.killpg(rank.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for f in rank.files:
            f.seek(0)
        rank.out, rank.err = rank.files[0].read(), rank.files[1].read()
    assert not hung, f"ranks still running after {timeout} s: " + " | ".join(r.err[-2000:] for r in hung)
    return ranks


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False
