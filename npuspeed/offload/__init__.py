"""Shared machinery of the swaps (--swap-attention, --swap-optimizer, the adaptive policy's swap):
the sizing rule (sizing.py), compute-stream marks read after one synchronize (marks.py), and
the decisions this process made, for the log, `npuspeed report` and the example's summary
(decisions.py). The link's figures live with the accelerator (accelerator/host_link.py)."""
