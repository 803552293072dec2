// Small bf16 GEMMs with fp32 accumulation on AVX512-BF16 (VDPBF16PS), for the CPU flash
// attention kernel: its seven per-tile products (64 x 64 x d) are too small for a BLAS call
// to pay off and need fp32 results from bf16 inputs, which torch's bf16 matmul rounds away.
//
// C[m x n] (+)= A[m x k] * B. A is row-major bf16 with k contiguous (lda between rows), so a
// pair A[r][2p..2p+1] is one 32-bit broadcast. B is "pair-packed": k/2 rows of n pairs, the
// pair (B[2p][j], B[2p+1][j]) at Bp[p * ldb + 2 * j], which is the operand layout VDPBF16PS
// multiplies lane-wise. k is even, n a multiple of 16.
//
// Every function carries the target attribute, so the library still builds (and runs the
// portable paths) at any NPUSPEED_CPU_CAPABILITY; callers check `cpu_has_avx512_bf16()` first.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#define NPUSPEED_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace npuspeed::cpu::bf16mm {

using bf16 = c10::BFloat16;

inline bool cpu_has_avx512_bf16() {
#if defined(__x86_64__) || defined(_M_X64)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// Rows MR x (16 * NV) columns of C; the k loop keeps the accumulators in registers.
template <int MR, int NV>
NPUSPEED_BF16_TARGET inline void micro(int64_t k, const bf16* A, int64_t lda, const bf16* Bp, int64_t ldb,
                                       float* C, int64_t ldc, bool accumulate) {
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v)
      acc[r][v] = accumulate ? _mm512_loadu_ps(C + r * ldc + 16 * v) : _mm512_setzero_ps();
  for (int64_t p = 0; p < k / 2; ++p) {
    __m512bh b[NV];
    for (int v = 0; v < NV; ++v)
      b[v] = (__m512bh)_mm512_loadu_si512(Bp + p * ldb + 32 * v);
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, A + r * lda + 2 * p, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < NV; ++v)
        acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v)
      _mm512_storeu_ps(C + r * ldc + 16 * v, acc[r][v]);
}

template <int NV>
NPUSPEED_BF16_TARGET inline void rows(int64_t m, int64_t k, const bf16* A, int64_t lda, const bf16* Bp,
                                      int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  constexpr int MR = 8;
  int64_t r = 0;
  for (; r + MR <= m; r += MR)
    micro<MR, NV>(k, A + r * lda, lda, Bp, ldb, C + r * ldc, ldc, accumulate);
  const int64_t left = m - r;
  A += r * lda;
  C += r * ldc;
  switch (left) {
    case 7: micro<7, NV>(k, A, lda, Bp, ldb, C, ldc, accumulate); break;
    case 6: micro<6, NV>(k, A, lda, Bp, ldb, C, ldc, accumulate); break;
    case 5: micro<5, NV>(k, A, lda, Bp, ldb, C, ldc, accumulate); break;
    case 4: micro<4, NV>(k, A, lda, Bp, ldb, C, ldc, accumulate); break;
    case 3: micro<3, NV>(k, A, lda, Bp, ldb, C, ldc, accumulate); break;
    case 2: micro<2, NV>(k, A, lda, Bp, ldb, C, ldc, accumulate); break;
    case 1: micro<1, NV>(k, A, lda, Bp, ldb, C, ldc, accumulate); break;
    default: break;
  }
}

NPUSPEED_BF16_TARGET inline void gemm(int64_t m, int64_t n, int64_t k, const bf16* A, int64_t lda,
                                      const bf16* Bp, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  int64_t j = 0;
  for (; j + 32 <= n; j += 32)
    rows<2>(m, k, A, lda, Bp + 2 * j, ldb, C + j, ldc, accumulate);
  if (j < n)
    rows<1>(m, k, A, lda, Bp + 2 * j, ldb, C + j, ldc, accumulate);
}

// 2^x for x <= 0 in fp32 (relative error ~1e-8 before rounding): x = n + f, |f| <= 1/2,
// 2^f by its degree-7 Taylor series, scaled by 2^n. Arguments below -126 give ~0.
NPUSPEED_BF16_TARGET inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.525273380405984e-05f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265069591007e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471805599453e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 16 fp32 -> 16 bf16 (round to nearest even), as torch's float->bfloat16 conversion.
NPUSPEED_BF16_TARGET inline void store_bf16(bf16* dst, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(v));
}

NPUSPEED_BF16_TARGET inline __m512 load_bf16(const bf16* src) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

}  // namespace npuspeed::cpu::bf16mm
