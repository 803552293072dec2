"""Every torch_npu call in npuspeed's source binds to each release's real schema (read from the
wheel), and the checker catches the three kinds of wrong call. A contract check, not an NPU run."""
from __future__ import annotations

import re

import pytest
import torch

from npu_contract import callsites, standin, wheel
from npuspeed.accelerator import npu_ops

#: ops a release lacks, and the branch npuspeed takes there (tested in test_npu_paths.py)
ABSENT = {
    "2.6.0": {"npu_moe_token_permute_with_routing_map", "npu_moe_token_unpermute_with_routing_map"},
    "2.9.0": set(),
    "2.14.0": set(),
}


def _schemas(release):
    return standin.contract(release)[0]


def _all_op_names():
    return {name for release in wheel.RELEASES for name in _schemas(release) if callsites.is_npu_op(name)}


@pytest.mark.parametrize("release", wheel.RELEASES)
def test_every_call_site_binds(release):
    schemas = _schemas(release)
    sites = callsites.source_sites(_all_op_names())
    # 13 since the SBH attention and SwiGLU calls are one front end each (npuspeed/ops/npu/); every
    # op npuspeed calls has a site there, and only there
    assert len(sites) >= 13, [s.where for s in sites]
    assert {s.op for s in sites} >= set(npu_ops.USED_BY) - {npu_ops.MATMUL_ADD_FP32}, sorted({s.op for s in sites})
    assert all(s.where.startswith("npuspeed/ops/npu/") for s in sites), [s.where for s in sites]
    problems, absent = [], set()
    for site in sites:
        if site.op not in schemas:
            absent.add(site.op)
            continue
        problems += callsites.problems(site, schemas[site.op], release)
    assert problems == []
    assert absent == ABSENT[release]


WRONG = {
    "unknown keyword": ("out = torch_npu.npu_rms_norm(x, w, eps=1e-5)[0]", "unknown keyword argument 'eps'"),
    "positional past *": ("g = npu.npu_fusion_attention_grad(q, k, v, dy, 4, 'SBH', None)",
                          "7 positional arguments, the schema takes 6 (the next, 'pse', is keyword-only)"),
    "output arity": ("dq, dk, dv, dpse = npu.npu_fusion_attention_grad(q, k, v, dy, 4, 'SBH')",
                     "result unpacked into 4 names, the op returns 5"),
}


@pytest.mark.parametrize("kind", WRONG)
def test_a_wrong_call_is_caught_with_op_and_argument_named(kind):
    source, message = WRONG[kind]
    (site,) = callsites.find(_all_op_names(), source, "wrong.py")
    op = site.op
    found = callsites.problems(site, _schemas("2.14.0")[op], "2.14.0")
    assert any(message in p and op in p and p.startswith("wrong.py:1") for p in found), found


def test_the_dispatcher_refuses_the_same_wrong_calls_at_run_time():
    """The stand-in's ops bind like torch_npu's: the dispatcher names the op and argument."""
    npu = standin.module("2.14.0")
    x, w = torch.randn(2, 8), torch.ones(8)
    with pytest.raises(RuntimeError, match=r"Unknown keyword argument 'eps' for operator '\w+::npu_rms_norm'"):
        npu.npu_rms_norm(x, w, eps=1e-5)
    q = torch.randn(3, 1, 16)
    with pytest.raises(RuntimeError, match=r"npu_fusion_attention_grad\(\) takes 6 positional argument"):
        npu.npu_fusion_attention_grad(q, q, q, q, 2, "SBH", None)


def test_an_emulator_output_the_meta_function_disagrees_with_is_caught(monkeypatch):
    rel = standin.release("2.14.0")
    kernel = standin._Kernel("2.14.0", "npu_rms_norm", lambda self, gamma, epsilon: (self, self),
                             standin.contract("2.14.0")[1]["npu_rms_norm"], {})
    monkeypatch.setattr(standin._Kernel, "schema", property(lambda k: rel.ops["npu_rms_norm"].default._schema))
    with pytest.raises(standin.ContractError, match=r"npu_rms_norm output 1: emulator \(2, 8\) torch.float32, "
                                                     r"meta function \(2, 1\)"):
        kernel(torch.randn(2, 8), torch.ones(8))


def _referenced_op_names() -> set[str]:
    """Every torch_npu op name npuspeed's source mentions (calls, strings, hasattr probes)."""
    names = _all_op_names()
    found = set()
    for path in callsites.PACKAGE.rglob("*.py"):
        found |= set(re.findall(r"\b_?npu_[a-z0-9_]+\b", path.read_text())) & names
    return found


def test_every_op_npuspeed_references_has_a_schema_and_an_emulator():
    from npu_contract.emulators import all_emulators

    referenced = _referenced_op_names()
    assert "_npu_matmul_add_fp32" in referenced and "npu_fusion_attention_grad" in referenced
    missing = sorted(referenced - set(all_emulators()))
    assert missing == [], f"torch_npu ops npuspeed references without an emulator in the contract tier: {missing}"
    for op in referenced:
        assert any(op in _schemas(r) for r in wheel.RELEASES), op
