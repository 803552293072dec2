"""`npuspeed patch-source DIR` on a tiny fixture tree shaped like a Megatron-LM checkout."""
from __future__ import annotations

import pathlib
import shutil
import textwrap

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from npuspeed import cli
from npuspeed.features.megatron_lm import MEGATRON_LM_RANGE
from npuspeed.features.megatron_lm.source_patch import (
    IMPORT_LINE, KNOWN_VERSIONS, PatchSourceError, default_patches_dir, insert_import, patch_source,
    read_version)

GPT = textwrap.dedent('''\
    """Pretrain GPT."""
    import os

    import torch

    from megatron.core import parallel_state
    from megatron.training import pretrain

    if __name__ == "__main__":
        pretrain()
    ''')
EARLY_MEGATRON = textwrap.dedent('''\
    from megatron.training import pretrain
    import torch

    if __name__ == "__main__":
        pretrain()
    ''')
HELPER = "import torch\n\ndef build():\n    return torch.zeros(1)\n"  # not an entry script


def make_checkout(root: pathlib.Path, version=(0, 16, 1, "")) -> pathlib.Path:
    info = root / "megatron" / "core" / "package_info.py"
    info.parent.mkdir(parents=True)
    info.write_text(textwrap.dedent(f'''\
        MAJOR = {version[0]}
        MINOR = {version[1]}
        PATCH = {version[2]}
        PRE_RELEASE = {version[3]!r}
        VERSION = (MAJOR, MINOR, PATCH, PRE_RELEASE)
        __version__ = '.'.join(map(str, VERSION[:3])) + ''.join(VERSION[3:])
        '''))
    (root / "megatron" / "training").mkdir()
    (root / "megatron" / "training" / "arguments.py").write_text("DEFAULT_LR = 1.0e-4\n")
    (root / "pretrain_gpt.py").write_text(GPT)
    (root / "train_rl.py").write_text(EARLY_MEGATRON)
    (root / "pretrain_helpers.py").write_text(HELPER)
    (root / "gpt_builders.py").write_text(HELPER)
    return root


def test_inserts_the_line_after_import_torch_once(tmp_path):
    root = make_checkout(tmp_path / "mlm")
    result = patch_source(root, patches_dir=tmp_path / "none")
    assert result.version == "0.16.1" and result.tag == "core_v0.16.1"
    assert result.scripts == {"pretrain_gpt.py": "patched", "train_rl.py": "patched"}
    lines = (root / "pretrain_gpt.py").read_text().splitlines()
    assert lines[lines.index("import torch") + 1] == IMPORT_LINE
    assert lines.count(IMPORT_LINE) == 1
    compile((root / "pretrain_gpt.py").read_text(), "pretrain_gpt.py", "exec")
    # Not entry scripts: untouched.
    assert (root / "pretrain_helpers.py").read_text() == HELPER
    assert (root / "gpt_builders.py").read_text() == HELPER

    before = {p.name: p.read_text() for p in root.glob("*.py")}
    again = patch_source(root, patches_dir=tmp_path / "none")
    assert set(again.scripts.values()) == {"already patched"}
    assert {p.name: p.read_text() for p in root.glob("*.py")} == before


def test_line_goes_before_a_megatron_import_that_precedes_torch(tmp_path):
    root = make_checkout(tmp_path / "mlm")
    patch_source(root, patches_dir=tmp_path / "none")
    lines = (root / "train_rl.py").read_text().splitlines()
    assert lines[0] == IMPORT_LINE and lines[1] == "from megatron.training import pretrain"


def test_insert_import_keeps_crlf_and_skips_scripts_without_imports():
    text, what = insert_import("import torch\r\nfrom megatron.core import mpu\r\n")
    assert what == "patched" and text == f"import torch\r\n{IMPORT_LINE}\r\nfrom megatron.core import mpu\r\n"
    assert insert_import("print('hi')\n") == ("print('hi')\n", "skipped: no top-level `import torch` or megatron import")
    # An indented `import torch` is not a top-level one.
    assert insert_import("def f():\n    import torch\n")[1].startswith("skipped")


def test_dry_run_changes_nothing(tmp_path):
    root = make_checkout(tmp_path / "mlm")
    result = patch_source(root, patches_dir=tmp_path / "none", dry_run=True)
    assert result.scripts["pretrain_gpt.py"] == "would patch"
    assert (root / "pretrain_gpt.py").read_text() == GPT


@pytest.mark.parametrize("version, shown", [((0, 15, 0, ""), "0.15.0"), ((0, 20, 0, "rc0"), "0.20.0rc0"),
                                            ((0, 19, 0, ""), "0.19.0")])
def test_refuses_an_unknown_version(tmp_path, version, shown):
    root = make_checkout(tmp_path / "mlm", version)
    with pytest.raises(PatchSourceError) as err:
        patch_source(root)
    message = str(err.value)
    assert f"Megatron-LM {shown}" in message and "core_v0.16.1" in message and "checkout" in message
    assert "core_v0.19.0" in message  # the newest known tag is the one suggested
    assert (root / "pretrain_gpt.py").read_text() == GPT  # nothing touched


def test_refuses_a_tree_that_is_not_a_checkout(tmp_path, capsys):
    (tmp_path / "pretrain_gpt.py").write_text(GPT)
    assert cli.main(["patch-source", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "does not look like a Megatron-LM checkout" in err and "package_info.py" in err


def test_version_is_read_without_running_the_file(tmp_path):
    root = make_checkout(tmp_path / "mlm")
    info = root / "megatron" / "core" / "package_info.py"
    info.write_text(info.read_text() + "raise SystemExit('executed')\n")
    assert read_version(root) == "0.16.1"


PATCH = textwrap.dedent('''\
    # Why: fixture patch; changes the default LR in megatron/training/arguments.py:1.
    --- a/megatron/training/arguments.py
    +++ b/megatron/training/arguments.py
    @@ -1 +1 @@
    -DEFAULT_LR = 1.0e-4
    +DEFAULT_LR = 3.0e-4
    ''')


@pytest.mark.skipif(shutil.which("patch") is None, reason="needs the `patch` program")
def test_applies_the_tags_patches_once(tmp_path):
    root = make_checkout(tmp_path / "mlm")
    patches = tmp_path / "patches"
    (patches / "core_v0.16.1").mkdir(parents=True)
    (patches / "core_v0.16.1" / "0001-lr.patch").write_text(PATCH)
    (patches / "core_v0.15.0").mkdir()
    (patches / "core_v0.15.0" / "0001-other.patch").write_text(PATCH.replace("3.0e-4", "9.0e-4"))
    target = root / "megatron" / "training" / "arguments.py"

    assert patch_source(root, patches, dry_run=True).patches == {"0001-lr.patch": "would apply"}
    assert target.read_text() == "DEFAULT_LR = 1.0e-4\n"
    assert patch_source(root, patches).patches == {"0001-lr.patch": "applied"}
    assert target.read_text() == "DEFAULT_LR = 3.0e-4\n"  # only this tag's patch
    assert patch_source(root, patches).patches == {"0001-lr.patch": "already applied"}
    assert target.read_text() == "DEFAULT_LR = 3.0e-4\n"
    assert not list(root.rglob("*.orig")) and not list(root.rglob("*.rej"))


@pytest.mark.skipif(shutil.which("patch") is None, reason="needs the `patch` program")
def test_a_patch_that_does_not_apply_is_an_error(tmp_path):
    root = make_checkout(tmp_path / "mlm")
    (root / "megatron" / "training" / "arguments.py").write_text("DEFAULT_LR = 5.0e-4\n")
    patches = tmp_path / "patches"
    (patches / "core_v0.16.1").mkdir(parents=True)
    (patches / "core_v0.16.1" / "0001-lr.patch").write_text(PATCH)
    with pytest.raises(PatchSourceError, match="0001-lr.patch does not apply"):
        patch_source(root, patches)


def test_cli_prints_what_it_did(tmp_path, capsys):
    root = make_checkout(tmp_path / "mlm")
    assert cli.main(["patch-source", str(root)]) == 0
    out = capsys.readouterr().out
    assert "Megatron-LM 0.16.1 (core_v0.16.1)" in out and "pretrain_gpt.py: patched" in out
    assert "no source patches needed for core_v0.16.1" in out  # the repo's patches/ has none


@pytest.mark.parametrize("version, tag", [((0, 17, 0, "rc0"), "core_v0.17.0"), ((0, 18, 0, ""), "core_v0.18.0"),
                                          ((0, 19, 1, ""), "core_v0.19.0")])
def test_newer_tags_are_known_by_the_strings_they_carry(tmp_path, version, tag):
    """The tags' package_info strings are irregular (core_v0.17.0 says 0.17.0rc0, core_v0.19.0
    says 0.19.1); each maps to its tag and gets the import line."""
    root = make_checkout(tmp_path / "mlm", version)
    result = patch_source(root)
    assert result.tag == tag and result.scripts["pretrain_gpt.py"] == "patched"


def test_known_versions_are_the_ones_the_runtime_patches_cover():
    assert all(Version(v).base_version in SpecifierSet(MEGATRON_LM_RANGE) for v in KNOWN_VERSIONS)
    assert {"core_v0.16.1", "core_v0.17.0", "core_v0.18.0", "core_v0.19.0"} <= set(KNOWN_VERSIONS.values())
    assert (default_patches_dir() / "README.md").is_file()
    assert not list(default_patches_dir().glob("*/*.patch")), "a patch was added: update the README"
