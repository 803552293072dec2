"""Fork server for tests that run many short, failing example runs: one interpreter pays for `import torch` (and, in
`initialized` mode, for `import npuspeed.megatron_adaptor` with no flags and megatron.core),
then each row runs examples/pretrain_gpt.py in a forked child exactly as `python
examples/pretrain_gpt.py ARGS` would: its stderr/stdout are files, its exit status is what
the interpreter would return (an uncaught exception prints its traceback and gives 1).

stdin: JSON list of {"argv": [...], "env": {...}}; stdout: JSON list of
{"rc", "stdout", "stderr"}. A row still running after 120 s is killed (rc "timeout").
"""
import json
import os
import runpy
import signal
import sys
import tempfile
import time
import traceback

from tiers import pinned  # this script's folder, tests/, is on sys.path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "pretrain_gpt.py")


def child(row, out_path, err_path) -> None:
    os.dup2(os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
    os.dup2(os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    os.environ.update(row.get("env", {}))
    sys.argv = [EXAMPLE] + row["argv"]
    code = 0
    try:
        runpy.run_path(EXAMPLE, run_name="__main__")
    except SystemExit as exc:
        if isinstance(exc.code, int) or exc.code is None:
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    import multiprocessing  # os._exit skips the hooks that stop a checkpoint writer's manager

    for proc in multiprocessing.active_children():
        proc.kill()
    os._exit(code)


def run(row) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out_path, err_path = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        pid = os.fork()
        if pid == 0:
            child(row, out_path, err_path)
        deadline = time.monotonic() + 120
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                rc = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                rc = "timeout"
                break
            time.sleep(0.02)
        return {"rc": rc, "stdout": open(out_path).read(), "stderr": open(err_path).read()}


def main() -> None:
    rows = json.load(sys.stdin)
    os.environ.pop("NPUSPEED_ARGS", None)
    pinned(os.environ)  # the CPU tier's backend, also where a row leaves NPUSPEED_DEVICE alone
    import torch  # noqa: F401

    if sys.argv[1] == "initialized":
        sys.argv = [EXAMPLE]
        import npuspeed.megatron_adaptor  # noqa: F401

        sys.path.insert(0, os.path.dirname(EXAMPLE))
        import gpt_example.train  # noqa: F401
        import gpt_example.validate  # noqa: F401
    print(json.dumps([run(row) for row in rows]))


if __name__ == "__main__":
    main()
