// Backward of the bf16 CPU flash attention (see flash_attention_bf16.cpp): FlashAttention-2 with key
// tiles outer. Each (batch, query head) recomputes its probability tiles from the forward's
// log-sum-exp, accumulates dK/dV for the key tile and dQ^T in fp32, and the group's per-head
// dK/dV are summed at the end (GQA without K/V copies).
#include <torch/library.h>

#include "flash_attention_bf16.h"

namespace npuspeed::cpu::flash {
namespace {

// 16-bit interleave of two 32-lane halves: [a0..a15 | b0..b15] -> [a0 b0 a1 b1 ... a15 b15].
NPUSPEED_BF16_TARGET inline __m512i interleave_index() {
  alignas(64) int16_t idx[32];
  for (int i = 0; i < 16; ++i) {
    idx[2 * i] = static_cast<int16_t>(i);
    idx[2 * i + 1] = static_cast<int16_t>(16 + i);
  }
  return _mm512_load_si512(idx);
}

// Per-(batch, query head) state of the backward: its packed operands and fp32 accumulators.
struct HeadGrad {
  std::vector<bf16> qt_pack, q_pack, do_pack, dot_pack;  // operands of S^T, dK, dV, dP^T
  std::vector<float> lse2, delta, dq_t;                  // lse in base 2, rowsum(dO * O), dQ^T [d][sqp]
  std::vector<int32_t> lo, hi;                           // each query row's key range (empty past sq)
  int64_t b = 0, h = 0;
};

// dK/dV of one query head for key tile j0 over the query tiles that see it, and its dQ^T
// share. With dropout Z = keep / (1 - p): dV = (P Z)^T dO, dS = P (dP_drop Z - delta), where
// delta = rowsum(dO * O) of the dropped output O (FlashAttention-2 with dropout).
NPUSPEED_BF16_TARGET void backward_key_tile(const Shape& sh, const Call& call, const HeadView& kv_k,
                                            const HeadView& kv_v, const bf16* k_t, int64_t j0, HeadGrad& g,
                                            float* dk, float* dv) {
  const int64_t d = sh.d, sqp = round_up(sh.sq), skp = round_up(sh.sk);
  const int64_t mk = std::min(kTile, sh.sk - j0);
  alignas(64) float st[kTile * kTile], dpt[kTile * kTile];
  alignas(64) bf16 pt_b[kTile * kTile], dst_b[kTile * kTile], dst_pairs[kTile * kTile];
  uint64_t keep_t[kTile];
  if (mk < kTile) std::fill(dst_pairs, dst_pairs + kTile * kTile, bf16(0.0f));
  const __m512i interleave = interleave_index();
  const float c = sh.scale * kLog2e;
  const bool dropout = call.dropout.on;
  const __m512 zscale = _mm512_set1_ps(call.dropout.scale);
  bool started = false;  // the first query tile seen starts this key tile's dK/dV rows
  for (int64_t i0 = 0; i0 < sh.sq; i0 += kTile) {
    const int64_t mq = std::min(kTile, sh.sq - i0);
    if (!attention::any_row_meets(g.lo.data() + i0, g.hi.data() + i0, mq, j0, j0 + mk)) continue;
    if (dropout) {
      philox::keep_bits(call.dropout, g.b, g.h, i0, mq, j0, keep_t);
      std::fill(keep_t + mq, keep_t + kTile, 0ull);
      philox::transpose64(keep_t);  // keep_t[key] bit r: query row i0 + r
    }
    bf16mm::gemm(mk, kTile, d, kv_k.row(j0), kv_k.row_stride, g.qt_pack.data() + 2 * i0, 2 * sqp, st, kTile, false);
    bf16mm::gemm(mk, kTile, d, kv_v.row(j0), kv_v.row_stride, g.dot_pack.data() + 2 * i0, 2 * sqp, dpt, kTile, false);
    for (int64_t cc = 0; cc < mk; ++cc) {  // key j0 + cc sees rows r with lo <= j0 + cc < hi
      const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(j0 + cc));
      for (int v = 0; v < kTile / 16; ++v) {
        const int64_t r0 = 16 * v;
        const __m512i lo = _mm512_loadu_si512(g.lo.data() + i0 + r0), hi = _mm512_loadu_si512(g.hi.data() + i0 + r0);
        const __mmask16 valid = _mm512_cmple_epi32_mask(lo, key) & _mm512_cmpgt_epi32_mask(hi, key);
        const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(st + cc * kTile + r0), _mm512_set1_ps(c),
                                         _mm512_loadu_ps(g.lse2.data() + i0 + r0));
        const __m512 p = _mm512_maskz_mov_ps(valid, bf16mm::exp2_ps(x));
        __m512 dp = _mm512_loadu_ps(dpt + cc * kTile + r0);
        __m512 p_drop = p;
        if (dropout) {
          const __mmask16 kept = static_cast<__mmask16>(keep_t[cc] >> r0);
          p_drop = _mm512_maskz_mul_ps(kept, p, zscale);
          dp = _mm512_maskz_mul_ps(kept, dp, zscale);
        }
        const __m512 ds = _mm512_mul_ps(p, _mm512_sub_ps(dp, _mm512_loadu_ps(g.delta.data() + i0 + r0)));
        bf16mm::store_bf16(pt_b + cc * kTile + r0, p_drop);
        bf16mm::store_bf16(dst_b + cc * kTile + r0, ds);
      }
    }
    // dS^T as row pairs (the B operand of dQ^T = K^T dS^T): interleave key rows cc, cc + 1.
    for (int64_t cc = 0; cc < mk; cc += 2) {
      for (int v = 0; v < kTile / 16; ++v) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(dst_b + cc * kTile + 16 * v));
        const __m256i b = cc + 1 < mk
            ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(dst_b + (cc + 1) * kTile + 16 * v))
            : _mm256_setzero_si256();
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
        _mm512_storeu_si512(dst_pairs + cc * kTile + 32 * v, _mm512_permutexvar_epi16(interleave, both));
      }
    }
    bf16mm::gemm(mk, d, kTile, pt_b, kTile, g.do_pack.data() + i0 * d, 2 * d, dv + j0 * d, d, started);
    bf16mm::gemm(mk, d, kTile, dst_b, kTile, g.q_pack.data() + i0 * d, 2 * d, dk + j0 * d, d, started);
    bf16mm::gemm(d, kTile, kTile, k_t + j0, skp, dst_pairs, 2 * kTile, g.dq_t.data() + i0, sqp, true);
    started = true;
  }
  if (!started) {  // no query sees these keys
    std::fill(dv + j0 * d, dv + (j0 + mk) * d, 0.0f);
    std::fill(dk + j0 * d, dk + (j0 + mk) * d, 0.0f);
  }
}

NPUSPEED_BF16_TARGET void row_dot(const HeadView& a, const HeadView& b, int64_t s, int64_t d, float* out) {
  for (int64_t t = 0; t < s; ++t) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t cc = 0; cc < d; cc += 16)
      acc = _mm512_fmadd_ps(bf16mm::load_bf16(a.row(t) + cc), bf16mm::load_bf16(b.row(t) + cc), acc);
    out[t] = _mm512_reduce_add_ps(acc);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_attention_backward_cpu(
    const at::Tensor& grad_in, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double scale, bool causal, double dropout_p, int64_t seed,
    int64_t offset, int64_t q_pos0, int64_t k_pos0, int64_t head0, const std::optional<at::Tensor>& key_lo,
    const std::optional<at::Tensor>& key_hi) {
  check_inputs(q, k, v);
  const Call call = make_call(q, k, causal, dropout_p, seed, offset, q_pos0, k_pos0, head0, key_lo, key_hi);
  const at::Tensor grad = grad_in.stride(3) == 1 ? grad_in : grad_in.contiguous();
  TORCH_CHECK(grad.sizes() == q.sizes() && out.sizes() == q.sizes() && grad.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16 && out.stride(3) == 1,
              "npuspeed::flash_attention_backward: grad/out must match the query");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() &&
                  lse.sizes() == at::IntArrayRef({q.size(1), q.size(2), q.size(0)}),
              "npuspeed::flash_attention_backward: lse must be fp32 [b, hq, sq]");
  const Shape sh = shape_of(q, k, scale, causal);
  const int64_t d = sh.d, sqp = round_up(sh.sq), skp = round_up(sh.sk), group = sh.hq / sh.hk;
  const at::Tensor k_t = pack_kv(k, sh, Pack::Transpose);
  const bf16* k_t_base = k_t.data_ptr<at::BFloat16>();
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::BFloat16* dq_base = dq.data_ptr<at::BFloat16>();
  at::Tensor dkv_heads = at::empty({2, sh.b * sh.hq, skp * d}, q.options().dtype(at::kFloat));
  float* dk_heads = dkv_heads.data_ptr<float>();
  float* dv_heads = dk_heads + sh.b * sh.hq * skp * d;
  const float* lse_base = lse.data_ptr<float>();
  at::parallel_for(0, sh.b * sh.hq, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int64_t bi = bh / sh.hq, h = bh % sh.hq, g_kv = h / group;
      const HeadView qv = head(q, bi, h), dov = head(grad, bi, h), ov = head(out, bi, h);
      HeadGrad g;
      g.qt_pack.resize(sqp * d);
      g.q_pack.resize(sqp * d);
      g.do_pack.resize(sqp * d);
      g.dot_pack.resize(sqp * d);
      pack(Pack::ColPairs, qv, sh.sq, sqp, d, g.qt_pack.data());
      pack(Pack::RowPairs, qv, sh.sq, sqp, d, g.q_pack.data());
      pack(Pack::RowPairs, dov, sh.sq, sqp, d, g.do_pack.data());
      pack(Pack::ColPairs, dov, sh.sq, sqp, d, g.dot_pack.data());
      g.lse2.assign(sqp, 0.0f);
      g.delta.assign(sqp, 0.0f);
      g.dq_t.assign(d * sqp, 0.0f);
      g.lo.assign(sqp, 0);
      g.hi.assign(sqp, 0);
      g.b = bi;
      g.h = h;
      call.rows.fill(bi, 0, sh.sq, g.lo.data(), g.hi.data());
      for (int64_t t = 0; t < sh.sq; ++t) g.lse2[t] = lse_base[bh * sh.sq + t] * kLog2e;
      row_dot(dov, ov, sh.sq, d, g.delta.data());
      const HeadView kk = head(k, bi, g_kv), vv = head(v, bi, g_kv);
      const bf16* kt = k_t_base + (bi * sh.hk + g_kv) * skp * d;
      for (int64_t j0 = 0; j0 < sh.sk; j0 += kTile)
        backward_key_tile(sh, call, kk, vv, kt, j0, g, dk_heads + bh * skp * d, dv_heads + bh * skp * d);
      at::BFloat16* dq_head = dq_base + bi * dq.stride(1) + h * dq.stride(2);
      for (int64_t t = 0; t < sh.sq; ++t)
        for (int64_t cc = 0; cc < d; ++cc) dq_head[t * dq.stride(0) + cc] = g.dq_t[cc * sqp + t] * sh.scale;
    }
  });
  // dK = scale * sum over the group's query heads of their dK, dV = that sum of dV.
  at::Tensor dk = at::empty(k.sizes(), k.options()), dv = at::empty(v.sizes(), v.options());
  at::BFloat16* dk_out = dk.data_ptr<at::BFloat16>();
  at::BFloat16* dv_out = dv.data_ptr<at::BFloat16>();
  at::parallel_for(0, sh.b * sh.hk, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t bkv = lo; bkv < hi; ++bkv) {
      const int64_t bi = bkv / sh.hk, g_kv = bkv % sh.hk;
      for (int64_t t = 0; t < sh.sk; ++t) {
        for (int64_t cc = 0; cc < d; ++cc) {
          float sk_sum = 0.0f, sv_sum = 0.0f;
          for (int64_t h = g_kv * group; h < (g_kv + 1) * group; ++h) {
            const int64_t off = (bi * sh.hq + h) * skp * d + t * d + cc;
            sk_sum += dk_heads[off];
            sv_sum += dv_heads[off];
          }
          const int64_t o = t * dk.stride(0) + bi * dk.stride(1) + g_kv * dk.stride(2) + cc;
          dk_out[o] = sk_sum * sh.scale;
          dv_out[o] = sv_sum;
        }
      }
    }
  });
  return {dq, dk, dv};
}


}  // namespace
}  // namespace npuspeed::cpu::flash

TORCH_LIBRARY_IMPL(npuspeed, CPU, m) {
  m.impl("flash_attention_backward", &npuspeed::cpu::flash::flash_attention_backward_cpu);
}
