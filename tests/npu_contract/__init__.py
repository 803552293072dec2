"""The NPU contract tier: torch_npu's own schemas and meta functions, read from its wheels, with
npuspeed's emulators as the CPU kernels, so every NPU code path runs here bound to the real op
contract. A contract check, not a run on NPU hardware."""
