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
// The lane loops below are plain C++ over kLanes independent counters so that the compiler
// vectorises them at the library's SIMD level (AVX-512, AVX2, NEON alike).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace npuspeed::cpu::philox {

constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
constexpr int kLanes = 16;

// Philox4x32-10 on kLanes counters whose first two words vary and last two are shared.
inline void philox_lanes(const uint32_t* c0, const uint32_t* c1, uint32_t c2, uint32_t c3, uint32_t k0,
                         uint32_t k1, uint32_t (*out)[kLanes]) {
  uint32_t x0[kLanes], x1[kLanes], x2[kLanes], x3[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    x0[l] = c0[l];
    x1[l] = c1[l];
    x2[l] = c2;
    x3[l] = c3;
  }
  for (int round = 0; round < 10; ++round) {
    if (round) {
      k0 += kW0;
      k1 += kW1;
    }
    for (int l = 0; l < kLanes; ++l) {
      const uint64_t p0 = static_cast<uint64_t>(kM0) * x0[l];
      const uint64_t p1 = static_cast<uint64_t>(kM1) * x2[l];
      const uint32_t y0 = static_cast<uint32_t>(p1 >> 32) ^ x1[l] ^ k0;
      const uint32_t y2 = static_cast<uint32_t>(p0 >> 32) ^ x3[l] ^ k1;
      x0[l] = y0;
      x1[l] = static_cast<uint32_t>(p1);
      x2[l] = y2;
      x3[l] = static_cast<uint32_t>(p0);
    }
  }
  for (int l = 0; l < kLanes; ++l) {
    out[0][l] = x0[l];
    out[1][l] = x1[l];
    out[2][l] = x2[l];
    out[3][l] = x3[l];
  }
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
  uint32_t c0[kLanes], c1[kLanes], out[4][kLanes];
  const uint32_t thr = dp.threshold;
  for (int64_t base = 0; base < lanes; base += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const int64_t lane = base + l < lanes ? base + l : lanes - 1;
      c0[l] = group0 + static_cast<uint32_t>(lane % groups);
      c1[l] = static_cast<uint32_t>(ig + lane / groups);
    }
    philox_lanes(c0, c1, c2, c3, dp.k0, dp.k1, out);
    for (int l = 0; l < kLanes; ++l) {
      uint32_t byte = 0;
      for (int w = 0; w < 4; ++w) {
        byte |= static_cast<uint32_t>((out[w][l] & 0xFFFFu) < thr) << (2 * w);
        byte |= static_cast<uint32_t>((out[w][l] >> 16) < thr) << (2 * w + 1);
      }
      bytes[base + l] = static_cast<uint8_t>(byte);
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
