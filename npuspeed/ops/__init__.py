"""Python front ends of the `npuspeed::` C++ ops; each has a pure-PyTorch reference."""
from __future__ import annotations


def catalog() -> list[dict]:
    """Each op: whether the compiled library provides it and what implementation runs."""
    import torch

    from npuspeed.ops._extension import load_library

    lib = load_library()
    rows = []
    for name, source in [("memory_tracker", "csrc/cpu/memory_tracker.cpp"),
                         ("rms_norm", "csrc/cpu/rms_norm.cpp"), ("swiglu", "csrc/cpu/swiglu.cpp"),
                         ("rotary_pos_emb", "csrc/cpu/rope.cpp"),
                         ("fp32_split", "csrc/cpu/fp32_split.cpp"), ("fp32_merge", "csrc/cpu/fp32_split.cpp"),
                         ("flash_attention", "csrc/x86/flash_attention_bf16.cpp"),
                         ("flash_attention_fp32", "csrc/cpu/flash_attention_fp32.cpp"),
                         ("attention_dropout_mask", "csrc/cpu/attention_dropout_mask.cpp"),
                         ("moe_permute", "csrc/cpu/moe_permute.cpp"), ("moe_unpermute", "csrc/cpu/moe_permute.cpp"),
                         ("moe_weighted_swiglu", "csrc/cpu/moe_swiglu.cpp")]:
        op = "memory_tracker_enable" if name == "memory_tracker" else name
        compiled = lib["compiled"] and hasattr(torch.ops.npuspeed, op)
        impl = (f"C++ {source} ({lib['source']}, {lib.get('cpu_capability')})" if compiled
                else f"pure-PyTorch reference: {lib['error'] or 'op not in the library'}")
        if name == "flash_attention":  # bf16 CPU attention under --use-flash-attn
            from npuspeed.ops.flash_attention import machine_reason

            reason = machine_reason()
            impl = (f"{impl}, AVX512-BF16" if reason is None
                    else f"scaled_dot_product_attention or Megatron's unfused path, measured "
                         f"(npuspeed's kernel unavailable: {reason})")
        rows.append({"name": name, "compiled": compiled, "implementation": impl, "error": lib["error"]})
    return rows
