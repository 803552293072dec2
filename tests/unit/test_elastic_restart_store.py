"""The per-restart store prefix (npuspeed/features/device/elastic_restart.py) without torchrun: on a
restart with the env:// rendezvous torch gets a PrefixStore named for the attempt; the first
attempt, a store of the caller's own and a non-env init_method reach torch untouched. The
end-to-end restart is tests/distributed/test_elastic_restart.py."""
from __future__ import annotations

import torch.distributed as dist

from launch import free_port
from npuspeed.features.device import elastic_restart


def _calls(monkeypatch, count: str | None):
    seen = []
    wrapped = elastic_restart.per_restart_store(lambda *args, **kwargs: seen.append((args, kwargs)))
    if count is None:
        monkeypatch.delenv(elastic_restart.RESTART_ENV, raising=False)
    else:
        monkeypatch.setenv(elastic_restart.RESTART_ENV, count)
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"),
                        ("WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    return wrapped, seen


def test_a_restart_gets_its_own_prefix(monkeypatch):
    wrapped, seen = _calls(monkeypatch, "2")
    wrapped("gloo")
    (args, _kwargs), = seen
    backend, init_method, _timeout, world_size, rank, store = args[:6]
    assert (backend, init_method, world_size, rank) == ("gloo", None, 1, 0)
    assert isinstance(store, dist.PrefixStore)
    store.set("k", "restart-2")
    assert store.underlying_store.get("npuspeed_restart_2/k") == b"restart-2"


def test_the_first_attempt_and_other_launches_are_torchs(monkeypatch):
    for count in (None, "0"):
        wrapped, seen = _calls(monkeypatch, count)
        wrapped("gloo")
        assert seen[0][0][5] is None  # no store made: torch's own rendezvous
    wrapped, seen = _calls(monkeypatch, "1")
    wrapped("gloo", init_method="tcp://127.0.0.1:1")
    own = object()
    wrapped("gloo", store=own, rank=0, world_size=1)
    assert seen[0][0][1] == "tcp://127.0.0.1:1" and seen[0][0][5] is None
    assert seen[1][0][5] is own
