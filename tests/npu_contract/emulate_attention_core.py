"""EMULATOR (not the real op) internals shared by the forward and the gradient emulators:
layouts, the documented mask shapes and sparse modes, TND sequences and statistics storage,
and the dropout keep mask as a pure function of (seed, offset, shape), so that the gradient
given the forward's seed / offset / numels rebuilds exactly the forward's mask.
"""
from __future__ import annotations

import torch

UNBOUNDED = 2147483647
COMPRESSED = 2048
LAYOUTS = ("SBH", "BSH", "BSND", "BNSD", "TND")
MAX_SEQUENCES = 1024  # "actual_seq_qlen ... 1~2K, varlen场景下长度最大支持1K" (2.9.0 / 2.14.0 docs)
MAX_T = 1 << 20  # "varlen场景下: T(B*S)取值范围1~1M"


def to_bnsd(x: torch.Tensor, layout: str, head_dim: int) -> torch.Tensor:
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.permute(0, 2, 1, 3)
    if layout == "BSH":
        b, s, h = x.shape
        return x.view(b, s, h // head_dim, head_dim).permute(0, 2, 1, 3)
    s, b, h = x.shape  # SBH
    return x.view(s, b, h // head_dim, head_dim).permute(1, 2, 0, 3)


def from_bnsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    b, n, s, d = x.shape
    if layout == "BNSD":
        return x.contiguous()
    if layout == "BSND":
        return x.permute(0, 2, 1, 3).contiguous()
    if layout == "BSH":
        return x.permute(0, 2, 1, 3).reshape(b, s, n * d)
    return x.permute(2, 0, 1, 3).reshape(s, b, n * d)


def _check_dtype(atten_mask) -> None:
    if atten_mask.dtype not in (torch.bool, torch.uint8):
        raise ValueError("atten_mask must be bool or uint8")


def check_compressed(atten_mask, sparse_mode: int) -> None:
    if tuple(atten_mask.shape) != (COMPRESSED, COMPRESSED):
        raise ValueError(f"sparse_mode {sparse_mode} needs the compressed {COMPRESSED}x{COMPRESSED} atten_mask")
    _check_dtype(atten_mask)
    expected = torch.ones(COMPRESSED, COMPRESSED, dtype=torch.bool, device=atten_mask.device).triu(1)
    if not torch.equal(atten_mask.bool(), expected):
        raise ValueError("the compressed atten_mask must be the upper triangle (True above the diagonal)")


def full_mask(atten_mask, b: int, n: int, sq: int, sk: int) -> torch.Tensor:
    """The documented shapes only: SS, 11SS, B1SS, BNSS (N = query heads); 1NSS is not one."""
    _check_dtype(atten_mask)
    m, shape = atten_mask.bool(), tuple(atten_mask.shape)
    if m.dim() == 2 and shape == (sq, sk):
        return m[None, None]
    if m.dim() == 4 and shape[2:] == (sq, sk) and shape[:2] in ((1, 1), (b, 1), (b, n)):
        return m
    raise ValueError(f"atten_mask shape {shape} is not SS, 11SS, B1SS or BNSS for B={b} N={n} Sq={sq} Skv={sk} "
                     "(the documented shapes; 1NSS is not one)")


def mask(atten_mask, sparse_mode, pre, nxt, b, n, sq, sk, device) -> torch.Tensor | None:
    """True = masked out. With no atten_mask nothing is masked: sparse_mode and the band are ignored."""
    if atten_mask is None:
        return None
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    if sparse_mode == 0:
        band_out = ((j - i) > nxt) | ((i - j) > pre)
        return full_mask(atten_mask, b, n, sq, sk) | band_out[None, None]
    if sparse_mode == 1:
        return full_mask(atten_mask, b, n, sq, sk)
    if sparse_mode not in (2, 3, 4):
        raise NotImplementedError(f"sparse_mode {sparse_mode} is not emulated")
    check_compressed(atten_mask, sparse_mode)
    if sparse_mode == 2:
        return (j > i)[None, None]
    if sparse_mode == 3:
        return (j > i + (sk - sq))[None, None]
    rel = j - i - (sk - sq)
    return ((rel > nxt) | (rel < -pre))[None, None]


def tnd_mask(atten_mask, sparse_mode, pre, nxt, sq, sk, device):
    if atten_mask is None:  # nothing masked (sparse_mode and the band are ignored)
        return None
    if sparse_mode in (0, 1):
        if atten_mask.dim() != 2:
            raise ValueError(f"TND: atten_mask shape {tuple(atten_mask.shape)}; varlen takes only SS (maxSq x maxSkv)")
        raise NotImplementedError("TND with a full (maxSq x maxSkv) atten_mask is not emulated")
    return mask(atten_mask, sparse_mode, pre, nxt, 1, 1, sq, sk, device)


def head_dim(query, key, value, head_num: int, layout: str) -> int:
    if not isinstance(head_num, int) or head_num <= 0:
        raise TypeError("head_num must be a positive int")
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have one shape")
    if query.dtype != key.dtype or key.dtype != value.dtype:
        raise ValueError("query, key and value must have one dtype")
    if layout in ("SBH", "BSH"):
        if query.dim() != 3 or query.shape[-1] % head_num:
            raise ValueError(f"{layout}: query hidden {query.shape[-1]} is not head_num * D")
        return _in_range(query.shape[-1] // head_num, head_num)
    n_axis = {"BNSD": 1, "BSND": 2, "TND": 1}[layout]
    if query.dim() != (3 if layout == "TND" else 4) or query.shape[n_axis] != head_num:
        raise ValueError(f"{layout}: query has {query.shape[n_axis]} heads, head_num={head_num}")
    if key.dim() != query.dim() or key.shape[-1] != query.shape[-1]:
        raise ValueError(f"{layout}: Dq must equal Dk")
    return _in_range(query.shape[-1], head_num)


def _in_range(d: int, head_num: int) -> int:
    """"D ... 取值范围1~768", "Nq取值范围1~256"."""
    if not (1 <= d <= 768 and head_num <= 256):
        raise ValueError(f"head dim {d} must be in 1..768 and head_num {head_num} in 1..256")
    return d


def check_common(pse, padding_mask, prefix, sink, keep_prob, layout, cu_q, cu_k, softmax_layout):
    if layout not in LAYOUTS:
        raise NotImplementedError(f"input_layout {layout!r} is not emulated (only {LAYOUTS})")
    if any(x is not None for x in (pse, padding_mask, prefix)):
        raise NotImplementedError("pse, padding_mask and prefix are not emulated")
    if sink is not None:
        raise NotImplementedError("sink (torch_npu >= 2.9.0) is not emulated; pass sink=None")
    if layout != "TND" and (cu_q is not None or cu_k is not None):
        raise ValueError("actual_seq_qlen / actual_seq_kvlen are for input_layout TND (varlen)")
    if softmax_layout not in ("", "TND") or (softmax_layout == "TND" and layout != "TND"):
        raise ValueError(f"softmax_layout {softmax_layout!r}: '' or, with input_layout TND only, 'TND'")
    if not 0.0 < keep_prob <= 1.0:
        raise ValueError("keep_prob must be in (0, 1]")


def dropout_keep(keep_prob, numels: int, seed: int, offset: int, dropout_mask, device) -> torch.Tensor | None:
    """The flat keep mask (True = kept) of `numels` draws: the caller's dropout_mask, else a pure
    function of (seed, offset), so the gradient given the same seed / offset rebuilds it."""
    if keep_prob == 1.0:
        return None
    if dropout_mask is not None:
        if dropout_mask.dtype not in (torch.bool, torch.uint8) or dropout_mask.numel() != numels:
            raise ValueError(f"dropout_mask: bool/uint8 with numels = {numels} entries (nonzero = kept)")
        return dropout_mask.reshape(-1).bool().to(device)
    gen = torch.Generator().manual_seed((int(seed) * 6364136223846793005 + int(offset)) % (1 << 63))
    return (torch.rand(numels, generator=gen) < keep_prob).to(device)


def draw_seed(seed: int, offset: int, device) -> tuple[int, int]:
    """The (seed, offset) a forward uses: the caller's, or with both 0 (the default) a fresh
    seed from torch's generator of the tensors' device (as the op draws from its generator)."""
    if seed or offset:
        return int(seed), int(offset)
    return int(torch.randint(1, 1 << 62, (1,), device=device).item()), 0


#: the first torch_npu whose schema of npu_fusion_attention has each argument (2.6.0's has none)
ARGUMENT_SINCE = {"softmax_layout": "2.9.0", "sink": "2.9.0", "dropout_mask": "2.14.0", "seed": "2.14.0",
                  "offset": "2.14.0"}


def compressed(device=None) -> torch.Tensor:
    """The documented compressed mask of sparse_mode 2 / 3 / 4."""
    return torch.ones(COMPRESSED, COMPRESSED, dtype=torch.bool, device=device).triu(1)
