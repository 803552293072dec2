"""--deterministic-mode's set-up: torch's deterministic algorithms, cuBLAS's workspace and the
collective library's reduction order, the user's own environment values kept."""
from __future__ import annotations

import os
import types

import pytest
import torch

from npuspeed.features.device import determinism


@pytest.fixture
def clean_state(monkeypatch):
    for key in ("CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO", "HCCL_DETERMINISTIC"):
        monkeypatch.delenv(key, raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1], before[2]


def _ctx(on: bool, backend: str):
    notes = []
    return types.SimpleNamespace(megatron=types.SimpleNamespace(deterministic_mode=True if on else None),
                                 accelerator=types.SimpleNamespace(dist_backend=backend), note=notes.append,
                                 notes=notes)


def test_off_changes_nothing(clean_state):
    ctx = _ctx(False, "nccl")
    determinism.apply(ctx)
    assert not torch.are_deterministic_algorithms_enabled() and "NCCL_ALGO" not in os.environ and not ctx.notes


@pytest.mark.parametrize("backend,env", [("nccl", {"NCCL_ALGO": "Ring"}), ("hccl", {"HCCL_DETERMINISTIC": "true"}),
                                         ("gloo", {})])
def test_on_sets_algorithms_and_environment(clean_state, backend, env):
    ctx = _ctx(True, backend)
    determinism.apply(ctx)
    assert torch.are_deterministic_algorithms_enabled() and determinism.enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    for key, value in env.items():
        assert os.environ[key] == value
    assert len(ctx.notes) == 1 and ctx.notes[0].startswith("--deterministic-mode: deterministic algorithms")


def test_users_own_values_are_kept_and_said(clean_state, monkeypatch):
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    ctx = _ctx(True, "nccl")
    determinism.apply(ctx)
    assert os.environ["NCCL_ALGO"] == "Tree"
    assert "kept the environment's NCCL_ALGO" in ctx.notes[0]
