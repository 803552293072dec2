"""The experts' weight gradient split from their input gradient (moe_fb_overlap/wgrad.py,
moe_common/deferred_wgrad.py): owed by the backward, run between the dispatch gradient's
all-to-all launch and its wait, bit for bit the joined gradient, landed through the weights'
own AccumulateGrad (a DDP-style hook fires once per weight, at the owed time)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from npuspeed import telemetry
from npuspeed.features.moe_common import a2a_clock, deferred_wgrad
from npuspeed.features.moe_fb_overlap import exchange, wgrad
from npuspeed.features.moe_grouped_gemm import grouped_gemm

COUNTS = [3, 0, 5]


def _weights():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6, 4)) for _ in COUNTS]  # [out, in], as SequentialMLP's
    fired = []
    accs = []
    for p in params:
        p.main_grad = torch.zeros_like(p)
        acc = p.expand_as(p).grad_fn.next_functions[0][0]

        def hook(*_unused, p=p):  # Megatron DDP's: add the grad into main_grad, drop it, mark ready
            fired.append(p)
            p.main_grad.add_(p.grad)
            p.grad = None

        acc.register_hook(hook)
        accs.append(acc)
    return params, fired, accs


def _step(x, params, arm: bool):
    w = torch.stack([p.t() for p in params])  # [G, in, out], as the grouped experts stack them
    deferred_wgrad.arm(arm)
    try:
        y = grouped_gemm.grouped_mm(x, w, COUNTS, backend="loop")
    finally:
        deferred_wgrad.arm(False)
    (y * torch.arange(y.numel()).view_as(y)).sum().backward()


def test_owed_weight_gradient_is_the_joined_one_and_fires_the_hooks_once():
    x = torch.randn(sum(COUNTS), 4)
    params, fired, _accs = _weights()
    xj = x.clone().requires_grad_()
    _step(xj, params, arm=False)
    joined = [p.main_grad.clone() for p in params]
    assert len(fired) == len(params)

    params, fired, _accs = _weights()
    xs = x.clone().requires_grad_()
    _step(xs, params, arm=True)
    assert torch.equal(xs.grad, xj.grad)
    assert fired == [] and deferred_wgrad.owed() == 1  # dX done, dW owed: no hook has run
    assert deferred_wgrad.run_owed() == 1
    assert len(fired) == len(params)
    for p, ref in zip(params, joined):
        assert torch.equal(p.main_grad, ref)


def test_split_linear_matches_megatrons_plain_branch():
    torch.manual_seed(1)
    w = torch.nn.Parameter(torch.randn(6, 4))
    x = torch.randn(5, 4)
    ref = torch.matmul(x, w.t())
    ref.backward(torch.ones_like(ref))
    expect = w.grad.clone()
    w.grad = None
    xs = x.clone().requires_grad_()
    wd, later = w.detach(), deferred_wgrad.Later(w)
    out = wgrad._SplitLinear.apply(xs, wd, None, later, None)
    assert torch.equal(out, ref)
    out.backward(torch.ones_like(out))
    assert w.grad is None and deferred_wgrad.run_owed() == 1
    assert torch.equal(w.grad, expect)


@pytest.fixture()
def group():
    if not dist.is_initialized():
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        yield dist.group.WORLD
        dist.destroy_process_group()
    else:
        yield dist.new_group([dist.get_rank()])


def test_owed_dw_runs_between_the_dispatch_gradients_launch_and_wait(group, monkeypatch):
    """The token dispatch's exchange, then the experts; in backward: the token gradient's
    all-to-all launched, the experts' dW, then the wait."""
    log = []
    launch, wait, weight_grads = exchange.launch, a2a_clock.Flight.wait, grouped_gemm._weight_grads
    monkeypatch.setattr(exchange, "launch", lambda *a: (log.append("launch"), launch(*a))[1])
    monkeypatch.setattr(a2a_clock.Flight, "wait", lambda self, work: (log.append("wait"), wait(self, work))[1])
    monkeypatch.setattr(grouped_gemm, "_weight_grads", lambda *a, **k: (log.append("dW"), weight_grads(*a, **k))[1])
    before = telemetry.get("moe.fb_overlap.wgrad.during_a2a")
    params, fired, _accs = _weights()
    x = torch.randn(sum(COUNTS), 4, requires_grad=True)
    (tokens,) = exchange._Exchange.apply(group, None, None, x)
    _step(tokens, params, arm=True)
    assert log == ["launch", "wait", "launch", "dW", "wait"], log
    assert len(fired) == len(params) and deferred_wgrad.owed() == 0
    assert telemetry.get("moe.fb_overlap.wgrad.during_a2a") == before + 1


def test_an_unknown_mode_names_the_variable(monkeypatch):
    monkeypatch.setenv(wgrad.MODE_ENV, "later")
    with pytest.raises(ValueError, match=wgrad.MODE_ENV):
        wgrad.split_on()
