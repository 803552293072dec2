"""Python front ends of the `npuspeed::` C++ ops; each has a pure-PyTorch reference."""
from __future__ import annotations


def catalog() -> list[dict]:
    """Each op: whether the compiled library provides it and what implementation runs."""
    from npuspeed.ops._extension import load_library

    lib = load_library()
    rows = []
    for name, source in [("memory_tracker", "csrc/cpu/memory_tracker.cpp")]:
        compiled = lib["compiled"]
        rows.append({
            "name": name,
            "compiled": compiled,
            "implementation": f"C++ {source} ({lib['source']})" if compiled else f"none: {lib['error']}",
            "error": lib["error"],
        })
    return rows
