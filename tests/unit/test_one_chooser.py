"""Issue 35: one chooser in the package. Every feature that picks between its own path and
Megatron's does it through npuspeed.ops.choose.Chooser (one cache, clock, criterion, tie rule,
guard, override scheme, deterministic rule and record); no feature keeps a clock or an RNG
save/restore of its own for it; `npuspeed report` lists every chooser's records."""
from __future__ import annotations

import ast
from pathlib import Path

import torch

PKG = Path(__file__).resolve().parents[2] / "npuspeed"
#: the candidate lists: every feature's `candidates.py` (one name across features) and the fused ops'
ADAPTERS = tuple(sorted(str(p.relative_to(PKG)) for p in PKG.glob("features/*/candidates.py"))) + ("ops/fused_choice.py",)
#: what only the chooser's own modules may do: read a clock, save or restore random states
OWN = {"perf_counter", "process_time", "thread_time", "get_rng_state", "set_rng_state", "reset_peak_memory_stats"}


def chooser_classes(root: Path = PKG) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Chooser"):
                found.append(f"{path.relative_to(root)}:{node.name}")
    return found


def own_rule_calls(rel: str) -> list[str]:
    tree = ast.parse((PKG / rel).read_text())
    return [f"{rel}:{n.lineno} {n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in OWN]


def test_one_chooser_class_in_the_package():
    assert chooser_classes() == ["ops/choose/chooser.py:Chooser"]


def test_the_candidate_lists_are_found_by_their_one_name():
    assert set(ADAPTERS) >= {"features/fused_attention/candidates.py", "features/grad_accum_fusion/candidates.py",
                             "features/fused_linear_ce/candidates.py", "features/moe_alltoall_overlap/candidates.py"}


def test_no_candidate_list_keeps_a_clock_or_guard_of_its_own():
    assert [hit for rel in ADAPTERS for hit in own_rule_calls(rel)] == []


def test_the_four_features_use_it(npuspeed_runtime):
    from npuspeed.features.fused_attention.candidates import AttentionFallback
    from npuspeed.features.fused_linear_ce.candidates import LossPaths
    from npuspeed.features.grad_accum_fusion.candidates import WgradPaths
    from npuspeed.ops import fused_choice
    from npuspeed.ops.choose.chooser import Chooser

    users = [fused_choice.CHOOSER, AttentionFallback().chooser, WgradPaths(npuspeed_runtime.accelerator).chooser,
             LossPaths().chooser]
    assert all(type(c) is Chooser for c in users)
    assert len({c.name for c in users}) == 4


def test_report_lists_every_choosers_records(npuspeed_runtime):
    from npuspeed import reporting
    from npuspeed.features.fused_linear_ce.candidates import LossPaths

    paths = LossPaths()
    paths.choose(64, torch.zeros(64, 1, 8), torch.zeros(32, 8), None, npuspeed_runtime.accelerator)
    records = [c for c in reporting._path_choices() if c["chooser"] == "fused linear cross-entropy"]
    assert records and records[-1]["impl"] == paths.choices[paths.key(64, torch.zeros(64, 1, 8), torch.zeros(32, 8))]["path"]
    assert records[-1]["line"].startswith("fused_linear_ce [64x8x32 float32]")
