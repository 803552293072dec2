// Shared by the bf16 CPU flash attention forward and backward (flash_attention_bf16*.cpp): the
// [s, b, h, d] head views, the operand packings of bf16_gemm.h, shape checks, and the
// call (../cpu/attention_call.h: masking rows and philox dropout), which the portable
// fp32 kernel shares so both draw the same masks.
#pragma once
// GCC 12's AVX-512 headers start reductions from _mm512_undefined_* and then warn about it.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../cpu/attention_call.h"
#include "../cpu/philox.h"
#include "bf16_gemm.h"

namespace npuspeed::cpu::flash {

using bf16mm::bf16;
constexpr int64_t kTile = 64;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

inline int64_t round_up(int64_t x) { return (x + kTile - 1) / kTile * kTile; }

// One head of a [s, b, h, d] tensor: row t at base + t * row_stride.
struct HeadView {
  const bf16* base;
  int64_t row_stride;
  const bf16* row(int64_t t) const { return base + t * row_stride; }
};

inline HeadView head(const at::Tensor& x, int64_t b, int64_t h) {
  return {x.data_ptr<at::BFloat16>() + b * x.stride(1) + h * x.stride(2), x.stride(0)};
}

// [s][d] -> pairs of rows: dst[(t/2) * 2d + 2c + t%2] = x[t][c]; rows s..sp-1 are zero.
inline void pack_row_pairs(const HeadView& x, int64_t s, int64_t sp, int64_t d, bf16* dst) {
  for (int64_t t = 0; t < sp; ++t) {
    bf16* out = dst + (t / 2) * 2 * d + (t % 2);
    if (t < s) {
      const bf16* in = x.row(t);
      for (int64_t c = 0; c < d; ++c) out[2 * c] = in[c];
    } else {
      for (int64_t c = 0; c < d; ++c) out[2 * c] = bf16(0.0f);
    }
  }
}

// [s][d] -> pairs of columns of its transpose: dst[(c/2) * 2sp + 2t + c%2] = x[t][c].
inline void pack_col_pairs(const HeadView& x, int64_t s, int64_t sp, int64_t d, bf16* dst) {
  for (int64_t t = 0; t < sp; ++t) {
    const bf16* in = t < s ? x.row(t) : nullptr;
    for (int64_t c = 0; c < d; c += 2) {
      bf16* out = dst + (c / 2) * 2 * sp + 2 * t;
      out[0] = in ? in[c] : bf16(0.0f);
      out[1] = in ? in[c + 1] : bf16(0.0f);
    }
  }
}

// [s][d] -> its transpose [d][sp]; columns s..sp-1 are zero.
inline void pack_transpose(const HeadView& x, int64_t s, int64_t sp, int64_t d, bf16* dst) {
  for (int64_t c = 0; c < d; ++c)
    for (int64_t t = 0; t < sp; ++t) dst[c * sp + t] = t < s ? x.row(t)[c] : bf16(0.0f);
}

enum class Pack { RowPairs, ColPairs, Transpose };

inline void pack(Pack how, const HeadView& x, int64_t s, int64_t sp, int64_t d, bf16* dst) {
  switch (how) {
    case Pack::RowPairs: pack_row_pairs(x, s, sp, d, dst); break;
    case Pack::ColPairs: pack_col_pairs(x, s, sp, d, dst); break;
    case Pack::Transpose: pack_transpose(x, s, sp, d, dst); break;
  }
}

// Valid-column mask of 16 lanes starting at column c0 of a row that may use columns < limit.
NPUSPEED_BF16_TARGET inline __mmask16 lanes_below(int64_t c0, int64_t limit) {
  const int64_t n = std::max<int64_t>(0, std::min<int64_t>(16, limit - c0));
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u);
}

// Lanes c0 .. c0 + 15 that lie in [lo, hi).
NPUSPEED_BF16_TARGET inline __mmask16 lanes_within(int64_t c0, int64_t lo, int64_t hi) {
  return lanes_below(c0, hi) & static_cast<__mmask16>(~lanes_below(c0, lo));
}

struct Shape {
  int64_t sq, sk, b, hq, hk, d;
  float scale;
  bool causal;
};

using attention::Call;

using attention::make_call;

inline void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(bf16mm::cpu_has_avx512_bf16(),
              "npuspeed::flash_attention needs a CPU with AVX512-BF16; use scaled_dot_product_attention");
  for (const auto* t : {&q, &k, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16 && t->dim() == 4 && t->stride(3) == 1,
                "npuspeed::flash_attention: expected CPU bf16 [s, b, h, d] tensors with a contiguous last dim");
  }
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(1) == k.size(1) && q.size(3) == k.size(3),
              "npuspeed::flash_attention: query/key/value shapes disagree");
  TORCH_CHECK(q.size(2) % k.size(2) == 0, "npuspeed::flash_attention: query heads must be a multiple of key heads");
  TORCH_CHECK(q.size(3) % 16 == 0, "npuspeed::flash_attention: head dim must be a multiple of 16");
  TORCH_CHECK(q.size(0) > 0 && k.size(0) > 0, "npuspeed::flash_attention: empty sequence");
}

inline Shape shape_of(const at::Tensor& q, const at::Tensor& k, double scale, bool causal) {
  return {q.size(0), k.size(0), q.size(1), q.size(2), k.size(2), q.size(3), static_cast<float>(scale), causal};
}

// Every (batch, key head) of K or V packed once, shared by its query group.
inline at::Tensor pack_kv(const at::Tensor& x, const Shape& sh, Pack how) {
  const int64_t skp = round_up(sh.sk);
  at::Tensor packed = at::empty({sh.b * sh.hk, skp * sh.d}, x.options());
  auto* base = packed.data_ptr<at::BFloat16>();
  at::parallel_for(0, sh.b * sh.hk, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t bh = lo; bh < hi; ++bh) {
      const HeadView view = head(x, bh / sh.hk, bh % sh.hk);
      pack(how, view, sh.sk, skp, sh.d, base + bh * skp * sh.d);
    }
  });
  return packed;
}


}  // namespace npuspeed::cpu::flash
