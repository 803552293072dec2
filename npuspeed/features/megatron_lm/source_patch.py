"""`npuspeed patch-source DIR`: prepare a Megatron-LM checkout for npuspeed.

It (1) inserts `import npuspeed.megatron_adaptor` after `import torch` in the checkout's
entry scripts (top-level `pretrain_*.py` / `train_*.py` with a `__main__` block), and
(2) applies the source patches that monkey-patching cannot reach, from
`patches/<tag>/*.patch` (none are needed for core_v0.16.x to core_v0.19.0: everything there
is reached by the megatron_lm feature's runtime patches). Entry scripts differ per tag
(0.17: pretrain_bert/t5; 0.18+: pretrain_hybrid; all: pretrain_gpt/mamba/vlm, train_rl);
0.18+'s `gpt_builders.py` / `model_provider.py` are modules the scripts import, not entry
scripts, and are left alone. Both steps are idempotent: a script that has
the line, or a patch already applied, is left alone. A checkout whose version (read from
its `megatron/core/package_info.py`, without running it) is not one npuspeed knows is
refused: the runtime patches were checked against those versions only.
"""
from __future__ import annotations

import ast
import pathlib
import re
import shutil
import subprocess
from dataclasses import dataclass, field

#: Megatron-LM versions (package_info.py) -> git tag, checked against the runtime patches.
#: The tags' strings are irregular: core_v0.17.0 says 0.17.0rc0, core_v0.19.0 says 0.19.1.
KNOWN_VERSIONS = {"0.16.0": "core_v0.16.0", "0.16.1": "core_v0.16.1", "0.17.0rc0": "core_v0.17.0",
                  "0.17.1": "core_v0.17.1", "0.18.0": "core_v0.18.0", "0.18.2": "core_v0.18.2",
                  "0.19.1": "core_v0.19.0"}
IMPORT_LINE = "import npuspeed.megatron_adaptor"
_TORCH = re.compile(r"^import torch\s*(#.*)?$")
_MEGATRON = re.compile(r"^(from megatron[.\s]|import megatron\b)")
_ADAPTOR = re.compile(r"^\s*import npuspeed\.megatron_adaptor\b")
_ENTRY_GLOBS = ("pretrain_*.py", "train_*.py")


class PatchSourceError(RuntimeError):
    """The checkout cannot be prepared; the message says why and what to do."""


@dataclass
class Result:
    version: str
    tag: str
    scripts: dict = field(default_factory=dict)  # name -> patched | already patched | skipped: why
    patches: dict = field(default_factory=dict)  # name -> applied | already applied

    def lines(self) -> list[str]:
        out = [f"Megatron-LM {self.version} ({self.tag})"]
        out += [f"  {name}: {what}" for name, what in sorted(self.scripts.items())]
        out += [f"  patch {name}: {what}" for name, what in sorted(self.patches.items())]
        if not self.patches:
            out.append(f"  no source patches needed for {self.tag}")
        return out


def default_patches_dir() -> pathlib.Path:
    return pathlib.Path(__file__).resolve().parents[3] / "patches"


def read_version(root: pathlib.Path) -> str:
    """The version in ROOT/megatron/core/package_info.py, read from its syntax tree."""
    info = root / "megatron" / "core" / "package_info.py"
    if not info.is_file():
        raise PatchSourceError(
            f"{root} does not look like a Megatron-LM checkout: {info.relative_to(root)} is missing")
    values = {}
    for node in ast.parse(info.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                values[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    try:
        return f"{values['MAJOR']}.{values['MINOR']}.{values['PATCH']}{values.get('PRE_RELEASE', '')}"
    except KeyError as exc:
        raise PatchSourceError(f"{info}: no {exc.args[0]} in it; cannot tell the Megatron-LM version") from None


def known_tag(version: str, root: pathlib.Path) -> str:
    if version not in KNOWN_VERSIONS:
        known = ", ".join(f"{v} ({t})" for v, t in KNOWN_VERSIONS.items())
        raise PatchSourceError(
            f"Megatron-LM {version} at {root} is not a version npuspeed knows (known: {known}). "
            f"Check out one of those tags, e.g. `git -C {root} checkout {list(KNOWN_VERSIONS.values())[-1]}`; "
            "npuspeed's runtime patches of megatron.training were checked against them only.")
    return KNOWN_VERSIONS[version]


def entry_scripts(root: pathlib.Path) -> list[pathlib.Path]:
    found = {p for pattern in _ENTRY_GLOBS for p in root.glob(pattern) if p.is_file()}
    return sorted(p for p in found if "__main__" in p.read_text())


def insert_import(text: str) -> tuple[str, str]:
    """(new text, what happened). The line goes after the first top-level `import torch`, or
    before the first top-level megatron import if one comes earlier (the adaptor must precede
    megatron)."""
    lines = text.splitlines(keepends=True)
    if any(_ADAPTOR.match(line) for line in lines):
        return text, "already patched"
    torch_at = next((i for i, line in enumerate(lines) if _TORCH.match(line)), None)
    megatron_at = next((i for i, line in enumerate(lines) if _MEGATRON.match(line)), None)
    if torch_at is None and megatron_at is None:
        return text, "skipped: no top-level `import torch` or megatron import"
    at = torch_at + 1 if torch_at is not None else megatron_at
    if megatron_at is not None and megatron_at < at:
        at = megatron_at
    newline = "\r\n" if lines and lines[0].endswith("\r\n") else "\n"
    lines.insert(at, IMPORT_LINE + newline)
    return "".join(lines), "patched"


def _patch_tool() -> str:
    tool = shutil.which("patch")
    if tool is None:
        raise PatchSourceError("applying source patches needs the `patch` program (apt-get install patch)")
    return tool


def _run_patch(root: pathlib.Path, patch: pathlib.Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([_patch_tool(), "-p1", "-d", str(root), "-i", str(patch), "--batch",
                           "--no-backup-if-mismatch", "-r", "-", *flags],
                          capture_output=True, text=True)


def apply_patch(root: pathlib.Path, patch: pathlib.Path, dry_run: bool = False) -> str:
    if _run_patch(root, patch, "--dry-run", "-R", "--force").returncode == 0:
        return "already applied"
    check = _run_patch(root, patch, "--dry-run", "--forward")
    if check.returncode != 0:
        raise PatchSourceError(f"{patch.name} does not apply to {root}:\n{check.stdout}{check.stderr}")
    if dry_run:
        return "would apply"
    done = _run_patch(root, patch, "--forward")
    if done.returncode != 0:
        raise PatchSourceError(f"{patch.name} failed on {root}:\n{done.stdout}{done.stderr}")
    return "applied"


def patch_source(root, patches_dir=None, dry_run: bool = False) -> Result:
    """Prepare the checkout at `root`; raises PatchSourceError with the reason and the fix."""
    root = pathlib.Path(root).resolve()
    if not root.is_dir():
        raise PatchSourceError(f"{root} is not a directory")
    version = read_version(root)
    result = Result(version, known_tag(version, root))
    scripts = entry_scripts(root)
    if not scripts:
        raise PatchSourceError(f"{root}: no entry scripts (pretrain_*.py, train_*.py) found")
    for script in scripts:
        text = script.read_text()
        new, what = insert_import(text)
        if new != text and not dry_run:
            script.write_text(new)
        result.scripts[script.name] = what if not dry_run or what != "patched" else "would patch"
    tag_dir = pathlib.Path(patches_dir or default_patches_dir()) / result.tag
    for patch in sorted(tag_dir.glob("*.patch")) if tag_dir.is_dir() else []:
        result.patches[patch.name] = apply_patch(root, patch, dry_run)
    return result
