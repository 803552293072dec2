"""Every single-rank flag has a device test (issue 34): the flags `--npuspeed-help` prints (the
parser it prints, built from the feature registry), less those that need several ranks (named
below with why), plus Megatron-LM's two flags whose claims the tier checks, must each appear in
the `COVERS` tuple of a tests/device/test_*.py module that has a test marked `device`. Read with
`ast`: no device module is imported."""
from __future__ import annotations

import ast
from pathlib import Path

DEVICE_TESTS = Path(__file__).resolve().parents[1] / "device"

#: flag -> why it cannot be checked on one device (NCCL refuses two ranks on one GPU)
MULTI_RANK = {
    "--context-parallel-size": "context parallelism splits the sequence over CP > 1 ranks",
    "--context-parallel-algo": "a context-parallel algorithm: CP > 1 ranks",
    "--ulysses-degree-in-cp": "Ulysses groups inside context parallelism: CP > 1 ranks",
    "--use-coc": "overlaps tensor-parallel communication: TP > 1",
    "--coc-parallel-num": "CoC's row chunks: TP > 1",
    "--use-ascend-mc2": "torch_npu's fused MC2 collectives: TP > 1",
    "--moe-tp-extend-ep": "tensor-parallel ranks as expert-parallel ranks: TP x EP > 1",
    "--moe-alltoall-overlap-comm": "overlaps the all-to-all dispatcher's communication: EP > 1",
    "--moe-alltoall-chunks": "chunks of the all-to-all overlap: EP > 1",
    "--moe-fb-overlap": "hides the expert-parallel all-to-all behind another micro-batch: EP > 1",
    "--overlap-moe-expert-parallel-comm": "Megatron's name for --moe-fb-overlap: EP > 1",
    "--schedules-method": "DualPipeV's V places two chunks on each of PP > 1 ranks",
}
#: Megatron-LM's flags whose README claims the tier checks (TFLOP/s, bitwise runs)
MEGATRON_FLAGS = ("--log-throughput", "--deterministic-mode")


def help_flags() -> set[str]:
    """The long options of the parser `--npuspeed-help` prints, less --npuspeed-help itself."""
    from npuspeed import arguments
    from npuspeed.features import all_features

    parser = arguments.build_parser(all_features())
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--")} - {"--npuspeed-help"}


def _covers(tree: ast.Module, path: Path) -> tuple[str, ...]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "COVERS" for t in node.targets):
            value = ast.literal_eval(node.value)
            assert isinstance(value, tuple) and all(isinstance(f, str) for f in value), f"{path.name}: COVERS {value!r}"
            return value
    raise AssertionError(f"{path.name}: no module-level COVERS = (...) naming the flags it tests")


def _marked_device(tree: ast.Module) -> bool:
    """`pytestmark = pytest.mark.device` (alone or in a list), or a test decorated with it."""
    def is_device(node) -> bool:
        return any(isinstance(n, ast.Attribute) and n.attr == "device" for n in ast.walk(node))

    tests = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
    module = any(isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)
                 and is_device(n.value) for n in tree.body)
    return bool(tests) and (module or any(is_device(d) for t in tests for d in t.decorator_list))


def covered() -> dict[str, list[str]]:
    """flag -> the device modules that cover it."""
    found: dict[str, list[str]] = {}
    for path in sorted(DEVICE_TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        assert _marked_device(tree), f"{path.name}: no test marked `device` (pytestmark = pytest.mark.device)"
        for flag in _covers(tree, path):
            found.setdefault(flag, []).append(path.name)
    return found


def test_multi_rank_entries_are_still_flags():
    gone = sorted(set(MULTI_RANK) - help_flags())
    assert not gone, f"no longer in --npuspeed-help, drop from MULTI_RANK: {gone}"


def test_every_single_rank_flag_has_a_device_test():
    single = (help_flags() - set(MULTI_RANK)) | set(MEGATRON_FLAGS)
    found = covered()
    missing = sorted(single - set(found))
    assert not missing, "single-rank flags with no device test (add one to tests/device/ and name the flag " \
                        f"in its COVERS): {', '.join(missing)}"
    unknown = sorted(set(found) - single)
    assert not unknown, f"COVERS names what is not a single-rank flag: {unknown} ({found})"
