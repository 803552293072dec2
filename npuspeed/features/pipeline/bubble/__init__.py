"""Each rank's pipeline bubble per step, measured, beside the schedule's formula for it.

Idle: the time this rank spent blocked in Megatron's pipeline send/receive (`_communicate`,
or, where `--overlap-p2p-comm` defers the waits, each wait on its requests) with the device
drained first, so the time is the wait and not queued compute. F and B: the mean `forward_step` and
`backward_step` of one model chunk and micro-batch, from the calls that ran alone (a paired
forward and backward overlap, so neither half is one chunk's cost). The interleaved schedule's
bubble is (PP-1)(F+B)/v in whole-stage units, (PP-1)(F+B) in the chunk units measured here, the
same expression without VPP (v = 1). The example reports it as `pipeline_bubble`.

Here: the waits, chunk times and aligned steps (measure.py); the figures and the formulas
(summary.py); what the measure wraps in Megatron, and when (patches.py).

The formula is the step's length beyond one stage's work, for stages of equal cost and free
transfers; every rank of the pipeline idles it (one that ends early waits for the others at the
gradient reduction). With NPUSPEED_MEASURE_BUBBLE=1 (ranks start each step together) the
measure takes the same terms: each wait less one measured exchange of a pipeline message (a
ring send/receive of its shape, timed once at the first step: what a receive costs when its data
has already been sent); plus the rank's tail, from its last forward/backward to the pipeline's
last; less its imbalance, how much less busy (its step less its waits) it was than the busiest
rank (ends and busy times gathered, relative to the common start). That is the step's length
beyond the busiest rank's work, less this rank's transfers: the median over the steps (a stall
of a shared host in one step is not the schedule's) is `bubble_ms_per_step`. The raw mean wait
stays `idle_ms_per_step`, by phase in `idle_ms_per_step_by_phase`.
"""
