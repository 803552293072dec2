// Shared by the portable fp32 flash attention forward and backward (flash_attention_fp32*.cpp):
// checks, the call's masking rows and dropout, and the per-head packings (K^T / V^T as
// [d][skp], K / V / Q / dO as [sp][dp] rows padded to the vector width).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <optional>
#include <tuple>

#include "attention_call.h"
#include "fp32_gemm.h"
#include "philox.h"

namespace npuspeed::cpu::flash32 {

constexpr int64_t kTile = 64;

struct Shape {
  int64_t sq, sk, b, hq, hk, d, dp, sqp, skp;  // dp: d padded to the vector width
  float scale;
};

using attention::Call;

inline void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  for (const auto* t : {&q, &k, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 4 && t->stride(3) == 1,
                "npuspeed::flash_attention_fp32: expected CPU fp32 [s, b, h, d] tensors with a contiguous last dim");
  }
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(1) == k.size(1) && q.size(3) == k.size(3),
              "npuspeed::flash_attention_fp32: query/key/value shapes disagree");
  TORCH_CHECK(q.size(2) % k.size(2) == 0,
              "npuspeed::flash_attention_fp32: query heads must be a multiple of key heads");
  TORCH_CHECK(q.size(0) > 0 && k.size(0) > 0 && q.size(3) > 0, "npuspeed::flash_attention_fp32: empty input");
}

inline Shape shape_of(const at::Tensor& q, const at::Tensor& k, double scale) {
  const int64_t d = q.size(3);
  return {q.size(0), k.size(0), q.size(1), q.size(2), k.size(2), d, f32mm::round_up(d, f32mm::kW),
          f32mm::round_up(q.size(0), kTile), f32mm::round_up(k.size(0), kTile), static_cast<float>(scale)};
}

using attention::make_call;

inline const float* head_ptr(const at::Tensor& x, int64_t b, int64_t h) {
  return x.data_ptr<float>() + b * x.stride(1) + h * x.stride(2);
}

// Rows [0, s) of one head of an [s, b, h, d] tensor -> dst [sp][dp], zero padded.
inline void pack_rows(const float* src, int64_t stride, int64_t s, int64_t sp, int64_t d, int64_t dp, float* dst) {
  for (int64_t t = 0; t < sp; ++t) {
    float* out = dst + t * dp;
    if (t < s) {
      std::copy(src + t * stride, src + t * stride + d, out);
      std::fill(out + d, out + dp, 0.0f);
    } else {
      std::fill(out, out + dp, 0.0f);
    }
  }
}

// Rows [0, s) of one head -> its transpose dst [d][sp], zero padded.
inline void pack_transposed(const float* src, int64_t stride, int64_t s, int64_t sp, int64_t d, float* dst) {
  for (int64_t c = 0; c < d; ++c) {
    float* out = dst + c * sp;
    for (int64_t t = 0; t < s; ++t) out[t] = src[t * stride + c];
    std::fill(out + s, out + sp, 0.0f);
  }
}

enum class Pack { Rows, Transposed };

// Every (batch, key head) of K or V packed once, shared by its query group.
inline at::Tensor pack_kv(const at::Tensor& x, const Shape& sh, Pack how) {
  const int64_t per = how == Pack::Rows ? sh.skp * sh.dp : sh.d * sh.skp;
  at::Tensor packed = at::empty({sh.b * sh.hk, per}, x.options());
  float* base = packed.data_ptr<float>();
  at::parallel_for(0, sh.b * sh.hk, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t bh = lo; bh < hi; ++bh) {
      const float* src = head_ptr(x, bh / sh.hk, bh % sh.hk);
      if (how == Pack::Rows) {
        pack_rows(src, x.stride(0), sh.sk, sh.skp, sh.d, sh.dp, base + bh * per);
      } else {
        pack_transposed(src, x.stride(0), sh.sk, sh.skp, sh.d, base + bh * per);
      }
    }
  });
  return packed;
}

}  // namespace npuspeed::cpu::flash32
