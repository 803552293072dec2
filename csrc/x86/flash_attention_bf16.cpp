// Flash attention for bf16 on CPUs with AVX512-BF16, in Megatron's [s, b, h, d] layout, with
// attention dropout drawn in the kernel (../cpu/philox.h) and per-row key ranges
// (../cpu/attention_rows.h: causal at global positions, key padding, packed documents).
//
// Why not PyTorch's CPU flash kernel: on bf16 it runs at about a third of the speed of the
// same machine's bf16 GEMMs (its tiles go through generic cpublas calls and per-tile
// conversions). Here every tile product is one register-blocked VDPBF16PS loop
// (bf16_gemm.h) on operands packed once per head, so attention runs near GEMM speed.
//
// The algorithm is FlashAttention-2: forward walks 64 x 64 tiles with an online softmax in
// fp32 (no S x S tensor), keeps the row log-sum-exp; backward recomputes each probability
// tile from it, walking key tiles outer so dK/dV stay local. Tiles no row may see (above the
// causal diagonal, across documents, past the padding) are skipped. GQA reads each K/V head
// once for its query group (no copies). Probabilities and dS enter the next product as bf16,
// as in every flash kernel; all sums are fp32. Parallel over (batch, query head) [x query
// tiles in forward]; dK/dV of a group are summed from per-head fp32 buffers.
#include <torch/library.h>

#include "flash_attention_bf16.h"

namespace npuspeed::cpu::flash {
namespace {

// Forward for one (batch, query head, query tile): online softmax over the key tiles that
// some row may see. Dropout zeroes probabilities after they entered the row sum (the LSE is
// that of the un-dropped softmax) and scales the output by 1 / (1 - p) at the end.
NPUSPEED_BF16_TARGET void forward_tile(const Shape& sh, const Call& call, int64_t bi, int64_t h, const HeadView& q,
                                       const bf16* kt_pack, const bf16* v_pack, int64_t skp, int64_t i0, bf16* out,
                                       int64_t out_stride, float* lse) {
  const int64_t d = sh.d;
  const int64_t rows = std::min(kTile, sh.sq - i0);
  alignas(64) float s_tile[kTile * kTile];
  alignas(64) bf16 p_tile[kTile * kTile];
  std::vector<float> o_acc(kTile * d, 0.0f);
  float m[kTile], l[kTile];
  int32_t lo[kTile], hi[kTile];
  uint64_t keep[kTile];
  for (int64_t r = 0; r < kTile; ++r) {
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.0f;
  }
  const auto [first, last] = call.rows.fill(bi, i0, rows, lo, hi);
  const float c = sh.scale * kLog2e;  // softmax in base 2
  for (int64_t j0 = first / kTile * kTile; j0 < last; j0 += kTile) {
    if (!attention::any_row_meets(lo, hi, rows, j0, j0 + kTile)) continue;
    if (call.dropout.on) philox::keep_bits(call.dropout, bi, h, i0, rows, j0, keep);
    bf16mm::gemm(rows, kTile, d, q.row(i0), q.row_stride, kt_pack + 2 * j0, 2 * skp, s_tile, kTile, false);
    for (int64_t r = 0; r < rows; ++r) {
      float* srow = s_tile + r * kTile;
      bf16* prow = p_tile + r * kTile;
      const int64_t a = lo[r] - j0, z = hi[r] - j0;
      if (a >= kTile || z <= 0 || z <= a) {  // nothing of this row here
        std::fill(prow, prow + kTile, bf16(0.0f));
        continue;
      }
      __m512 x[kTile / 16];
      __mmask16 valid[kTile / 16];
      __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int v = 0; v < kTile / 16; ++v) {
        valid[v] = lanes_within(16 * v, a, z);
        x[v] = _mm512_mul_ps(_mm512_loadu_ps(srow + 16 * v), _mm512_set1_ps(c));
        vmax = _mm512_mask_max_ps(vmax, valid[v], vmax, x[v]);
      }
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(vmax));
      const float alpha = std::exp2(m[r] - m_new);  // 0 on the row's first tile (m = -inf)
      __m512 vsum = _mm512_setzero_ps();
      for (int v = 0; v < kTile / 16; ++v) {
        const __m512 p = _mm512_maskz_mov_ps(valid[v], bf16mm::exp2_ps(_mm512_sub_ps(x[v], _mm512_set1_ps(m_new))));
        vsum = _mm512_add_ps(vsum, p);
        const __mmask16 kept = call.dropout.on ? static_cast<__mmask16>(keep[r] >> (16 * v)) : __mmask16(0xFFFF);
        bf16mm::store_bf16(prow + 16 * v, _mm512_maskz_mov_ps(kept, p));
      }
      l[r] = l[r] * alpha + _mm512_reduce_add_ps(vsum);
      m[r] = m_new;
      if (alpha != 1.0f) {
        float* orow = o_acc.data() + r * d;
        for (int64_t cc = 0; cc < d; cc += 16)
          _mm512_storeu_ps(orow + cc, _mm512_mul_ps(_mm512_loadu_ps(orow + cc), _mm512_set1_ps(alpha)));
      }
    }
    bf16mm::gemm(rows, d, kTile, p_tile, kTile, v_pack + j0 * d, 2 * d, o_acc.data(), d, true);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const bool empty = l[r] == 0.0f;  // a row that sees no key: 0, lse -inf (as ring merges expect)
    const __m512 inv = _mm512_set1_ps(empty ? 0.0f : call.dropout.scale / l[r]);
    for (int64_t cc = 0; cc < d; cc += 16)
      bf16mm::store_bf16(out + (i0 + r) * out_stride + cc, _mm512_mul_ps(_mm512_loadu_ps(o_acc.data() + r * d + cc), inv));
    lse[i0 + r] = empty ? -std::numeric_limits<float>::infinity() : (m[r] + std::log2(l[r])) * kLn2;
  }
}

std::tuple<at::Tensor, at::Tensor> flash_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       double scale, bool causal, double dropout_p, int64_t seed,
                                                       int64_t offset, int64_t q_pos0, int64_t k_pos0, int64_t head0,
                                                       const std::optional<at::Tensor>& key_lo,
                                                       const std::optional<at::Tensor>& key_hi) {
  check_inputs(q, k, v);
  const Shape sh = shape_of(q, k, scale, causal);
  const Call call = make_call(q, k, causal, dropout_p, seed, offset, q_pos0, k_pos0, head0, key_lo, key_hi);
  const int64_t skp = round_up(sh.sk), tiles = (sh.sq + kTile - 1) / kTile, group = sh.hq / sh.hk;
  const at::Tensor kt = pack_kv(k, sh, Pack::ColPairs), vp = pack_kv(v, sh, Pack::RowPairs);
  at::Tensor out = at::empty({sh.sq, sh.b, sh.hq, sh.d}, q.options());
  at::Tensor lse = at::empty({sh.b, sh.hq, sh.sq}, q.options().dtype(at::kFloat));
  auto* out_base = out.data_ptr<at::BFloat16>();
  const auto* kt_base = kt.data_ptr<at::BFloat16>();
  const auto* vp_base = vp.data_ptr<at::BFloat16>();
  float* lse_base = lse.data_ptr<float>();
  const int64_t out_stride = sh.b * sh.hq * sh.d;
  at::parallel_for(0, sh.b * sh.hq * tiles, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t bh = task / tiles, i0 = (task % tiles) * kTile;
      const int64_t bi = bh / sh.hq, h = bh % sh.hq, kv = bi * sh.hk + h / group;
      HeadView qv = head(q, bi, h);
      forward_tile(sh, call, bi, h, qv, kt_base + kv * skp * sh.d, vp_base + kv * skp * sh.d, skp, i0,
                   out_base + (bi * sh.hq + h) * sh.d, out_stride, lse_base + bh * sh.sq);
    }
  });
  return {out, lse};
}

}  // namespace
}  // namespace npuspeed::cpu::flash

// The schema is in this (x86-only) file: where it is not built, the op does not exist and
// npuspeed's report says the bf16 kernel was not built for this CPU.
TORCH_LIBRARY_FRAGMENT(npuspeed, m) {
  m.def("flash_attention(Tensor query, Tensor key, Tensor value, float scale, bool causal, "
        "float dropout_p=0.0, int seed=0, int offset=0, int q_pos0=0, int k_pos0=0, int head0=0, "
        "Tensor? key_lo=None, Tensor? key_hi=None) -> (Tensor, Tensor)");
  m.def("flash_attention_backward(Tensor grad, Tensor query, Tensor key, Tensor value, Tensor out, "
        "Tensor lse, float scale, bool causal, float dropout_p=0.0, int seed=0, int offset=0, "
        "int q_pos0=0, int k_pos0=0, int head0=0, Tensor? key_lo=None, Tensor? key_hi=None) "
        "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(npuspeed, CPU, m) {
  m.impl("flash_attention", &npuspeed::cpu::flash::flash_attention_cpu);
}
