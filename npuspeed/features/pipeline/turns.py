"""Two parties on one rank that take turns: the forward of micro-batch i+1 (the calling
thread) and the backward of micro-batch i (a worker thread; on a GPU or NPU, autograd's device
thread runs its nodes).

Only the party holding the turn computes. Each gives the turn away right after it launches an
expert all-to-all (`pass_turn`), so the other's compute runs while that transfer is in flight,
and takes it back to wait for the transfer. The turn changes hands at the same points on every
rank, so every collective (the all-to-alls, TP's, DDP's) is issued in the same order on all of
them: that is what keeps a rank from waiting on a peer that is in another collective.
"""
from __future__ import annotations

import threading

from npuspeed import telemetry

FORWARD, BACKWARD = "forward", "backward"
_OTHER = {FORWARD: BACKWARD, BACKWARD: FORWARD}


class Turns:
    def __init__(self, first: str = BACKWARD):
        self._cond = threading.Condition()
        self._holder = first
        self._alive = {FORWARD, BACKWARD}
        self.forward_thread = threading.get_ident()

    def role(self) -> str:
        """The forward runs on the thread that made the pair; anything else is the backward."""
        return FORWARD if threading.get_ident() == self.forward_thread else BACKWARD

    def take(self, role: str) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._holder == role)

    def pass_turn(self) -> bool:
        """Let the other party compute until it launches a transfer of its own (or ends);
        False when there is no other party left (the caller just waits for its transfer)."""
        me = self.role()
        other = _OTHER[me]
        with self._cond:
            if other not in self._alive:
                return False
            self._holder = other
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._holder == me)
        telemetry.count(f"moe.fb_overlap.turn.{me}")
        return True

    def leave(self, role: str) -> None:
        with self._cond:
            self._alive.discard(role)
            if self._holder == role:
                self._holder = _OTHER[role]
            self._cond.notify_all()


def run_pair(forward, backward, setup_worker=None):
    """forward() on this thread and backward() on a worker, taking turns (the backward first:
    the loss's backward reaches the last layer's combine while the forward has attention to
    compute). Returns forward()'s result; an error of either is raised here."""
    turns = Turns(first=BACKWARD)
    errors: list[BaseException] = []

    def worker():
        try:
            if setup_worker is not None:
                setup_worker()
            turns.take(BACKWARD)
            backward()
        except BaseException as exc:  # noqa: BLE001 (raised again on the calling thread)
            errors.append(exc)
        finally:
            turns.leave(BACKWARD)

    thread = threading.Thread(target=worker, name="npuspeed-fb-overlap-backward", daemon=True)
    _ACTIVE.turns = turns
    thread.start()
    try:
        turns.take(FORWARD)
        result = forward()
        turns.leave(FORWARD)
        thread.join()
    finally:
        turns.leave(FORWARD)  # on an error: the backward runs on alone (its peers expect its collectives)
        _ACTIVE.turns = None
    if errors:
        raise errors[0]
    return result


class _Active:
    turns: Turns | None = None


_ACTIVE = _Active()


def current() -> Turns | None:
    """The pair taking turns now (None: nothing to hand the turn to)."""
    return _ACTIVE.turns
