// `npuspeed::attention_dropout_mask`: the keep mask the flash attention kernels draw, made
// explicit ([b, h, sq, sk] bool, True = kept) for tests and references. Never used in training:
// the kernels regenerate each tile's bits from philox.h instead of storing this.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "philox.h"

namespace npuspeed::cpu {
namespace {

at::Tensor attention_dropout_mask(int64_t batch, int64_t heads, int64_t sq, int64_t sk, double p, int64_t seed,
                                  int64_t offset, int64_t q_pos0, int64_t k_pos0, int64_t head0) {
  TORCH_CHECK(batch >= 0 && heads >= 0 && sq >= 0 && sk >= 0, "attention_dropout_mask: negative size");
  TORCH_CHECK(p >= 0.0 && p < 1.0, "attention_dropout_mask: p must be in [0, 1)");
  const philox::Dropout dp(p, seed, offset, q_pos0, k_pos0, head0);
  at::Tensor mask = at::empty({batch, heads, sq, sk}, at::TensorOptions().dtype(at::kBool));
  bool* base = mask.data_ptr<bool>();
  const int64_t tiles = (sq + 63) / 64;
  at::parallel_for(0, batch * heads * tiles, 1, [&](int64_t lo, int64_t hi) {
    uint64_t bits[64];
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t bh = task / tiles, i0 = (task % tiles) * 64, rows = std::min<int64_t>(64, sq - i0);
      for (int64_t j0 = 0; j0 < sk; j0 += 64) {
        if (dp.on) {
          philox::keep_bits(dp, bh / heads, bh % heads, i0, rows, j0, bits);
        } else {
          std::fill(bits, bits + 64, ~0ull);
        }
        const int64_t cols = std::min<int64_t>(64, sk - j0);
        for (int64_t r = 0; r < rows; ++r) {
          bool* row = base + (bh * sq + i0 + r) * sk + j0;
          for (int64_t c = 0; c < cols; ++c) row[c] = (bits[r] >> c) & 1u;
        }
      }
    }
  });
  return mask;
}

// Philox4x32-10 on one counter, for known-answer tests of philox.h.
std::vector<int64_t> philox4x32(std::vector<int64_t> counter, std::vector<int64_t> key) {
  TORCH_CHECK(counter.size() == 4 && key.size() == 2, "philox4x32: counter of 4 words, key of 2");
  uint32_t c0[philox::kLanes], c1[philox::kLanes], out[4][philox::kLanes];
  std::fill(c0, c0 + philox::kLanes, static_cast<uint32_t>(counter[0]));
  std::fill(c1, c1 + philox::kLanes, static_cast<uint32_t>(counter[1]));
  philox::philox_lanes(c0, c1, static_cast<uint32_t>(counter[2]), static_cast<uint32_t>(counter[3]),
                       static_cast<uint32_t>(key[0]), static_cast<uint32_t>(key[1]), out);
  return {out[0][0], out[1][0], out[2][0], out[3][0]};
}

}  // namespace
}  // namespace npuspeed::cpu

TORCH_LIBRARY_FRAGMENT(npuspeed, m) {
  m.def("attention_dropout_mask(int batch, int heads, int sq, int sk, float p, int seed, int offset, "
        "int q_pos0=0, int k_pos0=0, int head0=0) -> Tensor",
        &npuspeed::cpu::attention_dropout_mask);
  m.def("philox4x32(int[] counter, int[] key) -> int[]", &npuspeed::cpu::philox4x32);
}
