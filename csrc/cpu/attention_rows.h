// Which keys each query row of a flash attention call may see, shared by the bf16 and fp32
// kernels: one [lo, hi) range of local key indices per (batch, query row), never an S x S mask.
//
// The range is the intersection of: all keys; causal (global key position <= global query
// position, with q_pos0 / k_pos0 the global positions of row 0 and column 0, so a sequence
// split across ranks masks as the whole one); and optional per-row bounds [key_lo, key_hi) in
// global key positions, int32 [b, sq] with any strides (key padding: [b, 1] expanded; packed
// documents: the query's document). Rows left with nothing output 0 with lse = -inf (what a
// ring merge expects); tiles outside every row's range are skipped.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <optional>

namespace npuspeed::cpu::attention {

struct Rows {
  bool causal = false;
  int64_t q_pos0 = 0, k_pos0 = 0, sk = 0;
  const int32_t* lo = nullptr;
  const int32_t* hi = nullptr;
  int64_t lo_sb = 0, lo_sr = 0, hi_sb = 0, hi_sr = 0;  // strides (batch, row) of the bounds

  // Local key range of query row i of batch b, clipped to [0, sk]; hi <= lo means empty.
  void range(int64_t b, int64_t i, int64_t& first, int64_t& last) const {
    int64_t a = 0, z = sk;
    if (lo) a = std::max<int64_t>(a, static_cast<int64_t>(lo[b * lo_sb + i * lo_sr]) - k_pos0);
    if (hi) z = std::min<int64_t>(z, static_cast<int64_t>(hi[b * hi_sb + i * hi_sr]) - k_pos0);
    if (causal) z = std::min<int64_t>(z, q_pos0 + i - k_pos0 + 1);
    first = a;
    last = std::max(a, z);
  }

  // Ranges of rows [i0, i0 + n) into lo/hi (int32); returns the union's [min lo, max hi).
  std::pair<int64_t, int64_t> fill(int64_t b, int64_t i0, int64_t n, int32_t* out_lo, int32_t* out_hi) const {
    int64_t umin = sk, umax = 0;
    for (int64_t r = 0; r < n; ++r) {
      int64_t a, z;
      range(b, i0 + r, a, z);
      out_lo[r] = static_cast<int32_t>(a);
      out_hi[r] = static_cast<int32_t>(z);
      if (z > a) {
        umin = std::min(umin, a);
        umax = std::max(umax, z);
      }
    }
    return {umin, umax};
  }
};

// True when some row r < n with range [lo[r], hi[r]) meets keys [j0, j1).
inline bool any_row_meets(const int32_t* lo, const int32_t* hi, int64_t n, int64_t j0, int64_t j1) {
  for (int64_t r = 0; r < n; ++r)
    if (lo[r] < j1 && hi[r] > j0 && hi[r] > lo[r]) return true;
  return false;
}

inline void check_bounds(const std::optional<at::Tensor>& t, int64_t b, int64_t sq, const char* name) {
  if (!t) return;
  TORCH_CHECK(t->scalar_type() == at::kInt && t->dim() == 2 && t->size(0) == b && (t->size(1) == sq) &&
                  t->device().is_cpu(),
              "npuspeed flash attention: ", name, " must be int32 [b, sq] on the CPU (expand a [b, 1] one)");
}

inline Rows make_rows(bool causal, int64_t q_pos0, int64_t k_pos0, int64_t b, int64_t sq, int64_t sk,
                      const std::optional<at::Tensor>& key_lo, const std::optional<at::Tensor>& key_hi) {
  check_bounds(key_lo, b, sq, "key_lo");
  check_bounds(key_hi, b, sq, "key_hi");
  Rows rows;
  rows.causal = causal;
  rows.q_pos0 = q_pos0;
  rows.k_pos0 = k_pos0;
  rows.sk = sk;
  if (key_lo) {
    rows.lo = key_lo->data_ptr<int32_t>();
    rows.lo_sb = key_lo->stride(0);
    rows.lo_sr = key_lo->stride(1);
  }
  if (key_hi) {
    rows.hi = key_hi->data_ptr<int32_t>();
    rows.hi_sb = key_hi->stride(0);
    rows.hi_sr = key_hi->stride(1);
  }
  return rows;
}

}  // namespace npuspeed::cpu::attention
