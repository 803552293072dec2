// Counter-based random numbers for attention dropout: Philox4x32-10 (Salmon et al., "Parallel
// random numbers: as easy as 1, 2, 3", SC'11), written out here in portable C++.
//
// Why counter-based: the keep/drop decision of an attention element is a pure function of
// (seed, offset, batch, global head, global query position, global key position), so the
// backward regenerates the forward's mask instead of storing an S x S one, any tiling or
// thread count draws the same mask, and a sequence or head split across ranks (context or
// tensor parallelism) draws, for each element, what one rank holding everything would.
//
// Layout of one call: key = (seed lo, seed hi); counter = (key position / 8, query position,
// stream lo, stream hi) with stream = offset + (batch << 32) + global head. Its four 32-bit
// outputs are eight 16-bit uniforms, one per key position 8c .. 8c + 7 (word t / 2, low half
// for even t). An element is kept iff its uniform < threshold = round((1 - p) * 2^16), so p is
// honoured to 2^-16; kept values are scaled by exactly 1 / (1 - p).
//
// kLanes independent counters run at once in generic vectors, which the compiler maps to the
// library's SIMD level (AVX-512, AVX2, NEON alike).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace npuspeed::cpu::philox {

constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
// Counters run kLanes at a time: one 512-bit vector with AVX-512, else 256 bits (one AVX2
// register, two NEON ones).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif

// kLanes-wide vectors in GCC/Clang's generic vector extension: the compiler lowers them to
// the target's SIMD (AVX-512, AVX2, NEON, SVE) or to scalar code, so this stays portable.
typedef uint32_t U32x __attribute__((vector_size(4 * kLanes)));
typedef uint64_t U64x __attribute__((vector_size(8 * kLanes)));
typedef uint8_t U8x __attribute__((vector_size(kLanes)));

// hi/lo 32 bits of m * x per lane. On x86 VPMULUDQ on even/odd lanes (the generic form
// compiles to slow 64-bit multiplies there); elsewhere the widening multiply (NEON UMULL).
inline void mulhilo(const U32x& x, uint32_t m, U32x& hi, U32x& lo) {
#if defined(__AVX512F__)
  const __m512i xv = (__m512i)x, mv = _mm512_set1_epi32(static_cast<int>(m));
  const __m512i even = _mm512_mul_epu32(xv, mv);
  const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(xv, 32), mv);
  hi = (U32x)_mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
  lo = (U32x)_mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
#elif defined(__AVX2__)
  const __m256i xv = (__m256i)x, mv = _mm256_set1_epi32(static_cast<int>(m));
  const __m256i even = _mm256_mul_epu32(xv, mv);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(xv, 32), mv);
  hi = (U32x)_mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
  lo = (U32x)_mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
#else
  const U64x p = (U64x{} + m) * __builtin_convertvector(x, U64x);
  hi = __builtin_convertvector(p >> 32, U32x);
  lo = __builtin_convertvector(p, U32x);
#endif
}

// Philox4x32-10 on kLanes counters whose first two words vary and last two are shared.
inline void philox_lanes(U32x& x0, U32x& x1, U32x& x2, U32x& x3, uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    if (round) {
      k0 += kW0;
      k1 += kW1;
    }
    U32x hi0, lo0, hi1, lo1;
    mulhilo(x0, kM0, hi0, lo0);
    mulhilo(x2, kM1, hi1, lo1);
    x0 = hi1 ^ x1 ^ k0;
    x2 = hi0 ^ x3 ^ k1;
    x1 = lo1;
    x3 = lo0;
  }
}

inline void philox_lanes(const uint32_t* c0, const uint32_t* c1, uint32_t c2, uint32_t c3, uint32_t k0,
                         uint32_t k1, uint32_t (*out)[kLanes]) {
  U32x x0, x1, x2 = U32x{} + c2, x3 = U32x{} + c3;
  std::memcpy(&x0, c0, sizeof(x0));
  std::memcpy(&x1, c1, sizeof(x1));
  philox_lanes(x0, x1, x2, x3, k0, k1);
  std::memcpy(out[0], &x0, sizeof(x0));
  std::memcpy(out[1], &x1, sizeof(x1));
  std::memcpy(out[2], &x2, sizeof(x2));
  std::memcpy(out[3], &x3, sizeof(x3));
}

// Keep bits of kLanes counters: bit t of byte l = (uniform t of lane l) < threshold.
inline U8x keep_bytes(const U32x& c0, const U32x& c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1,
                      uint32_t thr) {
  U32x x[4] = {c0, c1, U32x{} + c2, U32x{} + c3};
  philox_lanes(x[0], x[1], x[2], x[3], k0, k1);
  U32x byte = {};
  for (int w = 0; w < 4; ++w) {
    byte |= (U32x)((x[w] & 0xFFFFu) < thr) & (1u << (2 * w));
    byte |= (U32x)((x[w] >> 16) < thr) & (1u << (2 * w + 1));
  }
  return __builtin_convertvector(byte, U8x);
}

// Dropout of one attention call: what the kernels need to draw any element's decision.
struct Dropout {
  bool on = false;
  uint32_t threshold = 1u << 16;  // keep iff uniform16 < threshold
  float scale = 1.0f;             // 1 / (1 - p) for kept values
  uint32_t k0 = 0, k1 = 0;        // the seed
  uint64_t offset = 0;
  int64_t q_pos0 = 0, k_pos0 = 0, head0 = 0;  // global position of row 0 / column 0, first head

  Dropout() = default;
  Dropout(double p, int64_t seed, int64_t off, int64_t q0, int64_t kk0, int64_t h0)
      : on(p > 0.0), scale(p > 0.0 ? static_cast<float>(1.0 / (1.0 - p)) : 1.0f),
        k0(static_cast<uint32_t>(static_cast<uint64_t>(seed))),
        k1(static_cast<uint32_t>(static_cast<uint64_t>(seed) >> 32)), offset(static_cast<uint64_t>(off)),
        q_pos0(q0), k_pos0(kk0), head0(h0) {
    threshold = static_cast<uint32_t>(std::lround((1.0 - p) * 65536.0));
  }

  uint64_t stream(int64_t b, int64_t h) const {
    return offset + (static_cast<uint64_t>(b) << 32) + static_cast<uint64_t>(head0 + h);
  }
};

// Keep bits of a tile: bits[r] bit c = keep(query q_pos0 + i0 + r, key k_pos0 + j0 + c) for
// r < rows, c < 64, for batch b and local head h.
inline void keep_bits(const Dropout& dp, int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t j0,
                      uint64_t* bits) {
  const uint64_t stream = dp.stream(b, h);
  const uint32_t c2 = static_cast<uint32_t>(stream), c3 = static_cast<uint32_t>(stream >> 32);
  const int64_t jg = dp.k_pos0 + j0, ig = dp.q_pos0 + i0;
  const int shift = static_cast<int>(jg & 7);
  const int groups = shift ? 9 : 8;  // 8-key groups covering [jg, jg + 64)
  const uint32_t group0 = static_cast<uint32_t>(static_cast<uint64_t>(jg) >> 3);
  const int64_t lanes = rows * groups;
  uint8_t bytes[64 * 9 + kLanes];
  const uint32_t thr = dp.threshold;
  U32x iota;
  for (int l = 0; l < kLanes; ++l) iota[l] = static_cast<uint32_t>(l);
  static_assert(kLanes % 8 == 0, "a batch of lanes holds whole rows of 8 groups");
  if (groups == 8) {  // aligned: a batch of kLanes lanes is kLanes / 8 whole rows
    for (int64_t base = 0; base < lanes; base += kLanes) {
      const U32x c0 = (iota & 7u) + group0;
      const U32x c1 = (iota >> 3) + static_cast<uint32_t>(ig + base / 8);
      const U8x byte = keep_bytes(c0, c1, c2, c3, dp.k0, dp.k1, thr);
      std::memcpy(bytes + base, &byte, kLanes);
    }
  } else {  // 9 groups a row: lane = row * 9 + g, counted up without division
    int64_t lane_row = 0;
    int g = 0;
    for (int64_t base = 0; base < lanes; base += kLanes) {
      U32x c0, c1;
      for (int l = 0; l < kLanes; ++l) {
        c0[l] = group0 + static_cast<uint32_t>(g);
        c1[l] = static_cast<uint32_t>(ig + lane_row);
        if (++g == groups) {
          g = 0;
          ++lane_row;
        }
      }
      const U8x byte = keep_bytes(c0, c1, c2, c3, dp.k0, dp.k1, thr);
      std::memcpy(bytes + base, &byte, kLanes);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = bytes + r * groups;
    uint64_t word;
    std::memcpy(&word, row, 8);
    bits[r] = shift ? (word >> shift) | (static_cast<uint64_t>(row[8]) << (64 - shift)) : word;
  }
}

// bits[r] bit c -> out[c] bit r, for a 64 x 64 bit matrix (in place, Hacker's Delight 7-3).
inline void transpose64(uint64_t* a) {
  uint64_t m = 0x00000000FFFFFFFFull;
  for (int j = 32; j != 0; j >>= 1, m ^= m << j) {
    for (int k = 0; k < 64; k = ((k | j) + 1) & ~j) {
      const uint64_t t = ((a[k] >> j) ^ a[k | j]) & m;
      a[k] ^= t << j;
      a[k | j] ^= t;
    }
  }
}

}  // namespace npuspeed::cpu::philox
