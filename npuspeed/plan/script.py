"""A Megatron-LM launch script's argument list, for `npuspeed plan --script FILE`.

Megatron-LM's examples (examples/gpt3/train_gpt3_175b_distributed.sh and the like) set
shell variables and arrays (`GPT_MODEL_ARGS=( --num-layers 96 ... )`, `GPUS_PER_NODE=8`)
and end with `torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py ${GPT_MODEL_ARGS[@]} ...`.
This reads that shape without running anything: comments and line continuations go,
simple assignments are remembered, `$VAR`, `${VAR}` and `${VAR[@]}` are expanded, and the
launch line's tokens (torchrun's own `--nproc_per_node`/`--nnodes` included) are returned.
Anything dynamic (command substitution, arithmetic) is left as written.
"""
from __future__ import annotations

import re
import shlex

from npuspeed.plan.flags import PlanInputError

_ASSIGN = re.compile(r"^(?:export\s+|declare\s+-a\s+|local\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:\[@\]|\[\*\])?(?::-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def _logical_lines(text: str) -> list[str]:
    lines, buf, depth = [], "", 0
    for raw in text.replace("\\\n", " ").splitlines():
        line = raw.split(" #")[0] if not raw.lstrip().startswith("#") else ""
        line = line.strip()
        if not line:
            continue
        buf = f"{buf} {line}" if buf else line
        depth += line.count("(") - line.count(")")
        if depth <= 0:
            lines.append(buf)
            buf, depth = "", 0
    if buf:
        lines.append(buf)
    return lines


def _expand(text: str, env: dict) -> str:
    def sub(m):
        name = m.group(1) or m.group(3)
        if name in env:
            return env[name]
        return m.group(2) if m.group(2) is not None else ""
    for _ in range(5):  # variables defined through other variables
        new = _VAR.sub(sub, text)
        if new == text:
            break
        text = new
    return text


def script_argv(path: str) -> list[str]:
    try:
        with open(path) as fh:
            text = fh.read()
    except OSError as exc:
        raise PlanInputError(f"--script {path}: {exc.strerror}") from None
    env: dict[str, str] = {}
    launch = None
    for line in _logical_lines(text):
        m = _ASSIGN.match(line)
        if m and not line.startswith(("torchrun", "python")):
            value = m.group(2).strip()
            if value.startswith("(") and value.endswith(")"):
                value = value[1:-1]
            value = _expand(value, env)
            try:
                env[m.group(1)] = " ".join(shlex.split(value))
            except ValueError:
                env[m.group(1)] = value.strip("\"'")
            continue
        if re.search(r"(^|\s)(torchrun|python[0-9.]*|torch\.distributed\.(run|launch))(\s|$)", line) and ".py" in line:
            launch = line
    if launch is None:
        raise PlanInputError(f"--script {path}: no launch line (torchrun/python ... pretrain_*.py ...) found")
    tokens = shlex.split(_expand(launch, env))
    script = next(i for i, t in enumerate(tokens) if t.endswith(".py"))
    before = tokens[:script]
    world = []
    for i, t in enumerate(before):
        key = t.split("=", 1)[0]
        if key in ("--nproc_per_node", "--nproc-per-node", "--nnodes"):
            value = t.split("=", 1)[1] if "=" in t else (before[i + 1] if i + 1 < len(before) else "")
            world += ["--nproc-per-node" if "nproc" in key else "--nnodes", value.split(":")[-1]]
    return world + tokens[script + 1:]


def expand(argv: list[str]) -> list[str]:
    """`--script FILE` replaced by the launch script's arguments (flags given here win, later)."""
    if "--script" not in argv:
        return list(argv)
    i = argv.index("--script")
    if i + 1 >= len(argv):
        raise PlanInputError("--script needs a path to a Megatron-LM launch script")
    return script_argv(argv[i + 1]) + argv[:i] + argv[i + 2:]
