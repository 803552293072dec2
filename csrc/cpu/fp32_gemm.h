// Small fp32 GEMMs and row helpers for the portable flash attention kernel, on ATen's
// `at::vec::Vectorized<float>` (AVX-512, AVX2, NEON, or plain C++: whatever the library is
// compiled for). Each tile product is 64 x 64 x d: too small for a BLAS call to pay off, so
// it is one register-blocked loop: MR rows x NV vectors of C stay in registers over k.
//
// C[m x n] (+)= A[m x k] * B[k x n]: A(i, p) = A[i * ars + p * acs] (so A or A^T is read in
// place), B row-major with ldb, n a multiple of the vector width (callers pad).
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace npuspeed::cpu::f32mm {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();
// Accumulators MR x NV plus NV operands and one broadcast must fit the register file:
// 16 x 512-bit / 32 x 128-bit registers -> 8 rows; 16 x 256-bit registers -> 6 rows.
constexpr int kMR = kW == 8 ? 6 : 8;

inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

template <int MR, int NV>
inline void micro(int64_t k, const float* A, int64_t ars, int64_t acs, const float* B, int64_t ldb, float* C,
                  int64_t ldc, bool accumulate) {
  Vec acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = accumulate ? Vec::loadu(C + r * ldc + kW * v) : Vec(0.0f);
  for (int64_t p = 0; p < k; ++p) {
    Vec b[NV];
    for (int v = 0; v < NV; ++v) b[v] = Vec::loadu(B + p * ldb + kW * v);
    for (int r = 0; r < MR; ++r) {
      const Vec a(A[r * ars + p * acs]);
      for (int v = 0; v < NV; ++v) acc[r][v] = at::vec::fmadd(a, b[v], acc[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v].store(C + r * ldc + kW * v);
}

template <int NV, int MR = kMR>
inline void rows(int64_t m, int64_t k, const float* A, int64_t ars, int64_t acs, const float* B, int64_t ldb,
                 float* C, int64_t ldc, bool accumulate) {
  int64_t r = 0;
  for (; r + MR <= m; r += MR) micro<MR, NV>(k, A + r * ars, ars, acs, B, ldb, C + r * ldc, ldc, accumulate);
  if constexpr (MR > 1) {
    if (r < m) rows<NV, MR - 1>(m - r, k, A + r * ars, ars, acs, B, ldb, C + r * ldc, ldc, accumulate);
  }
}

inline void gemm(int64_t m, int64_t n, int64_t k, const float* A, int64_t ars, int64_t acs, const float* B,
                 int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  int64_t j = 0;
  for (; j + 2 * kW <= n; j += 2 * kW) rows<2>(m, k, A, ars, acs, B + j, ldb, C + j, ldc, accumulate);
  for (; j < n; j += kW) rows<1>(m, k, A, ars, acs, B + j, ldb, C + j, ldc, accumulate);
}

// Row helpers over n floats (n a multiple of the vector width).
inline void scale_row(float* x, int64_t n, float s) {
  const Vec vs(s);
  for (int64_t c = 0; c < n; c += kW) (Vec::loadu(x + c) * vs).store(x + c);
}

inline float max_row(const float* x, int64_t n) {
  Vec m(-std::numeric_limits<float>::infinity());
  for (int64_t c = 0; c < n; c += kW) m = at::vec::maximum(m, Vec::loadu(x + c));
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, m);
}

// x = exp(x * mul - sub) in place; returns the sum.
inline float exp_row(float* x, int64_t n, float mul, float sub) {
  const Vec vm(mul), vs(sub);
  Vec sum(0.0f);
  for (int64_t c = 0; c < n; c += kW) {
    const Vec e = at::vec::fmsub(Vec::loadu(x + c), vm, vs).exp_u20();
    e.store(x + c);
    sum = sum + e;
  }
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sum);
}

// Entries outside [lo, hi) of a row of n get `fill`.
inline void mask_row(float* x, int64_t n, int64_t lo, int64_t hi, float fill) {
  std::fill(x, x + std::clamp<int64_t>(lo, 0, n), fill);
  std::fill(x + std::clamp<int64_t>(hi, 0, n), x + n, fill);
}

// x[c] = 0 where bit c of keep is clear, else x[c] * scale (dropout of one 64-wide row).
inline void dropout_row(float* x, int64_t n, uint64_t keep, float scale) {
  for (int64_t c = 0; c < n; ++c) x[c] = (keep >> c) & 1u ? x[c] * scale : 0.0f;
}

inline float dot_row(const float* a, const float* b, int64_t n) {
  Vec acc(0.0f);
  for (int64_t c = 0; c < n; c += kW) acc = at::vec::fmadd(Vec::loadu(a + c), Vec::loadu(b + c), acc);
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
}

}  // namespace npuspeed::cpu::f32mm
