// Portable fp32 flash attention (FlashAttention-2) in Megatron's [s, b, h, d] layout, on
// `at::vec` (builds on any CPU: x86, Arm): the fp32 counterpart of the bf16 AVX512-BF16
// kernel (../x86/flash_attention_bf16.cpp), with the same masking rows (attention_rows.h:
// causal at global positions, key padding, packed documents) and the same dropout draws
// (philox.h), so a mask does not depend on the dtype or the kernel that drew it.
//
// Forward: per (batch, query head, 64-row query tile), an online softmax over the key tiles
// some row may see; K^T and V packed once per key head (GQA without copies); the output and
// the row log-sum-exp (of the un-dropped softmax, as ring attention merges need) come back.
#include <torch/library.h>

#include "flash_attention_fp32.h"

namespace npuspeed::cpu::flash32 {
namespace {

void forward_tile(const Shape& sh, const Call& call, int64_t bi, int64_t h, const float* q, int64_t q_stride,
                  const float* kt, const float* vp, int64_t i0, float* out, int64_t out_stride, float* lse) {
  const int64_t rows = std::min(kTile, sh.sq - i0), dp = sh.dp;
  alignas(64) float s_tile[kTile * kTile];
  std::vector<float> o_acc(kTile * dp, 0.0f);
  float m[kTile], l[kTile];
  int32_t lo[kTile], hi[kTile];
  uint64_t keep[kTile];
  std::fill(m, m + kTile, -std::numeric_limits<float>::infinity());
  std::fill(l, l + kTile, 0.0f);
  const auto [first, last] = call.rows.fill(bi, i0, rows, lo, hi);
  for (int64_t j0 = first / kTile * kTile; j0 < last; j0 += kTile) {
    if (!attention::any_row_meets(lo, hi, rows, j0, j0 + kTile)) continue;
    if (call.dropout.on) philox::keep_bits(call.dropout, bi, h, i0, rows, j0, keep);
    f32mm::gemm(rows, kTile, sh.d, q + i0 * q_stride, q_stride, 1, kt + j0, sh.skp, s_tile, kTile, false);
    for (int64_t r = 0; r < rows; ++r) {
      float* row = s_tile + r * kTile;
      const int64_t a = lo[r] - j0, z = hi[r] - j0;
      if (a >= kTile || z <= 0 || z <= a) {  // nothing of this row here
        std::fill(row, row + kTile, 0.0f);
        continue;
      }
      const bool edge = a > 0 || z < kTile;
      if (edge) f32mm::mask_row(row, kTile, a, z, -std::numeric_limits<float>::infinity());
      const float m_new = std::max(m[r], f32mm::max_row(row, kTile) * sh.scale);
      const float alpha = std::exp(m[r] - m_new);  // 0 on the row's first tile (m = -inf)
      const float sum = f32mm::exp_row(row, kTile, sh.scale, m_new);
      if (edge) f32mm::mask_row(row, kTile, a, z, 0.0f);
      l[r] = l[r] * alpha + sum;
      m[r] = m_new;
      if (alpha != 1.0f) f32mm::scale_row(o_acc.data() + r * dp, dp, alpha);
      if (call.dropout.on) f32mm::dropout_row(row, kTile, keep[r], 1.0f);
    }
    f32mm::gemm(rows, dp, kTile, s_tile, kTile, 1, vp + j0 * dp, dp, o_acc.data(), dp, true);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const bool empty = l[r] == 0.0f;  // a row that sees no key: 0, lse -inf (as ring merges expect)
    const float inv = empty ? 0.0f : call.dropout.scale / l[r];
    const float* acc = o_acc.data() + r * dp;
    float* dst = out + (i0 + r) * out_stride;
    for (int64_t c = 0; c < sh.d; ++c) dst[c] = acc[c] * inv;
    lse[i0 + r] = empty ? -std::numeric_limits<float>::infinity() : m[r] + std::log(l[r]);
  }
}

std::tuple<at::Tensor, at::Tensor> flash_attention_fp32(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                        double scale, bool causal, double dropout_p, int64_t seed,
                                                        int64_t offset, int64_t q_pos0, int64_t k_pos0, int64_t head0,
                                                        const std::optional<at::Tensor>& key_lo,
                                                        const std::optional<at::Tensor>& key_hi) {
  check_inputs(q, k, v);
  const Shape sh = shape_of(q, k, scale);
  const Call call = make_call(q, k, causal, dropout_p, seed, offset, q_pos0, k_pos0, head0, key_lo, key_hi);
  const int64_t tiles = sh.sqp / kTile, group = sh.hq / sh.hk;
  const at::Tensor kt = pack_kv(k, sh, Pack::Transposed), vp = pack_kv(v, sh, Pack::Rows);
  at::Tensor out = at::empty({sh.sq, sh.b, sh.hq, sh.d}, q.options());
  at::Tensor lse = at::empty({sh.b, sh.hq, sh.sq}, q.options());
  const float* kt_base = kt.data_ptr<float>();
  const float* vp_base = vp.data_ptr<float>();
  float* out_base = out.data_ptr<float>();
  float* lse_base = lse.data_ptr<float>();
  at::parallel_for(0, sh.b * sh.hq * tiles, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t bh = task / tiles, i0 = (task % tiles) * kTile;
      const int64_t bi = bh / sh.hq, h = bh % sh.hq, kv = bi * sh.hk + h / group;
      forward_tile(sh, call, bi, h, head_ptr(q, bi, h), q.stride(0), kt_base + kv * sh.d * sh.skp,
                   vp_base + kv * sh.skp * sh.dp, i0, out_base + (bi * sh.hq + h) * sh.d, out.stride(0),
                   lse_base + bh * sh.sq);
    }
  });
  return {out, lse};
}

}  // namespace
}  // namespace npuspeed::cpu::flash32

TORCH_LIBRARY_FRAGMENT(npuspeed, m) {
  m.def("flash_attention_fp32(Tensor query, Tensor key, Tensor value, float scale, bool causal, "
        "float dropout_p=0.0, int seed=0, int offset=0, int q_pos0=0, int k_pos0=0, int head0=0, "
        "Tensor? key_lo=None, Tensor? key_hi=None) -> (Tensor, Tensor)");
  m.def("flash_attention_fp32_backward(Tensor grad, Tensor query, Tensor key, Tensor value, Tensor out, "
        "Tensor lse, float scale, bool causal, float dropout_p=0.0, int seed=0, int offset=0, "
        "int q_pos0=0, int k_pos0=0, int head0=0, Tensor? key_lo=None, Tensor? key_hi=None) "
        "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(npuspeed, CPU, m) {
  m.impl("flash_attention_fp32", &npuspeed::cpu::flash32::flash_attention_fp32);
}
