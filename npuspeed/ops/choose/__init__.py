"""One chooser: which implementation a flag runs, measured once per key, the same way everywhere.

Every feature that can run its own path or Megatron's (the fused ops, fused attention's
fallback, gradient-accumulation fusion, fused linear cross-entropy) hands `Chooser.pick` a
candidate list for one call. The rule, in one place:
- measure once per key (op, device type, dtypes, shapes, options): a warm-up round runs every
  candidate on fresh copies of the inputs (the baseline first; a candidate that raises, or
  whose output disagrees with the baseline's, is dropped), then interleaved timed rounds;
- one clock (trial.Clock): the process's CPU time on the host, device events on accelerators;
- one criterion per feature (criteria.py): time for speed features, bytes first within a
  stated time allowance for a feature whose point is memory; ties go to Megatron's path;
- one guard: random states (host, device, Megatron's tracker) and the CPU memory peak are put back;
- one override scheme: a flag's fixed value, else `NPUSPEED_<X>_PATH` (each chooser names its
  variable), else the measurement; a kernel that runs unmeasured is checked once against
  Megatron's output (`ForcedKernelDisagrees`);
- one deterministic rule: under --deterministic-mode nothing is timed; bytes (where the
  criterion reads them), then the feature's preference order decide, the same on every rank;
- one record (record.Choice) that `npuspeed report` and every feature's path() read.
"""
