"""What the pipelined schedules share (a shared room, not a feature: no flag, no patch of its own).

`--moe-fb-overlap` pairs each forward with a backward in Megatron's schedules, DualPipeV runs its
own V order (with the overlap on, its pairs take the same turns), the planner replays the V, and
the device feature measures Megatron's own schedules as their baseline. What more than one of
them uses lives here, beneath the features, so that no feature imports another's folder:
which schedule the flags ask for (which.py); the two parties that take turns (turns.py) and
the scope of a pairing schedule call (pairing.py); the paired-or-serial step trial
(pair_choice.py); Megatron's forward/backward of one chunk (chunks.py); a pipeline message's
shape (message.py); the V's placement and per-rank order (v_placement.py, v_order.py); and
each rank's bubble, measured beside the schedule's formula (bubble/).
"""
