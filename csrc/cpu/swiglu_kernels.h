// The SwiGLU row kernels shared by npuspeed::swiglu (swiglu.cpp) and the router-weighted
// npuspeed::moe_weighted_swiglu (moe_swiglu.cpp): one pass over each row each way, fp32
// (fp64 for fp64) accumulation, the sigmoid recomputed in backward from the saved input.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>

#include "vec_io.h"

namespace npuspeed::cpu::swiglu_rows {

// The same operation order as ATen's vectorized silu and silu_backward CPU kernels, so fp32
// results match them bit for bit (eager on strided chunk halves may differ by an ulp).
template <typename V>
inline V silu(const V& a) {  // a / (1 + exp(-a))
  const V one(typename V::value_type(1));
  return a / (one + a.neg().exp());
}

// y = silu(a) * b * p[row] for x = [a | b] of `rows` rows; p == nullptr means weight 1.
template <typename T>
void swiglu_fwd(const T* x, const float* p, T* y, int64_t rows, int64_t f) {
  using V = AVec<T>;
  using A = acc_t<T>;
  constexpr int64_t S = kStep<T>;
  const int64_t grain = row_grain(16384, f);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* a_row = x + r * 2 * f;
      const T* b_row = a_row + f;
      const V w(p ? static_cast<A>(p[r]) : A(1));  // x 1 is exact: unweighted results are unchanged
      V a0, a1, b0, b1;
      for (int64_t j = 0; j < f; j += S) {
        const int64_t n = std::min<int64_t>(S, f - j);
        load2_upto(a_row + j, a0, a1, n);
        load2_upto(b_row + j, b0, b1, n);
        store2_upto(y + r * f + j, silu(a0) * b0 * w, silu(a1) * b1 * w, n);
      }
    }
  });
}

// dx = [da | db] of swiglu_fwd; dp[row] = sum(g * silu(a) * b) when dp != nullptr.
template <typename T>
void swiglu_bwd(const T* g, const T* x, const float* p, T* dx, float* dp, int64_t rows, int64_t f) {
  using V = AVec<T>;
  using A = acc_t<T>;
  constexpr int64_t S = kStep<T>;
  const int64_t grain = row_grain(16384, f);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    const V one(A(1));
    for (int64_t r = begin; r < end; ++r) {
      const T* a_row = x + r * 2 * f;
      const T* b_row = a_row + f;
      const T* g_row = g + r * f;
      T* da_row = dx + r * 2 * f;
      T* db_row = da_row + f;
      const V w(p ? static_cast<A>(p[r]) : A(1));  // x 1 is exact: unweighted results are unchanged
      V dot(A(0));
      V a[2], b[2], gg[2], da[2], db[2];
      for (int64_t j = 0; j < f; j += S) {
        const int64_t n = std::min<int64_t>(S, f - j);
        load2_upto(a_row + j, a[0], a[1], n);
        load2_upto(b_row + j, b[0], b[1], n);
        load2_upto(g_row + j, gg[0], gg[1], n);
        for (int k = 0; k < 2; ++k) {
          const V denom = one + a[k].neg().exp();
          const V s = one / denom;
          const V act = a[k] / denom;
          const V gw = gg[k] * w;
          if (dp) dot = dot + gg[k] * (act * b[k]);  // tails are zero-filled, so they add nothing
          db[k] = gw * act;
          da[k] = gw * b[k] * s * (one + a[k] * (one - s));
        }
        store2_upto(da_row + j, da[0], da[1], n);
        store2_upto(db_row + j, db[0], db[1], n);
      }
      if (dp) dp[r] = static_cast<float>(hsum<A>(dot));
    }
  });
}

}  // namespace npuspeed::cpu::swiglu_rows
