// Backward of the portable fp32 flash attention (flash_attention_fp32.cpp): FlashAttention-2
// with key tiles outer. Each (batch, query head) recomputes its probability tiles from the
// forward's log-sum-exp and its dropout bits from philox.h, accumulates dK/dV of the key tile
// and dQ in fp32; a group's per-head dK/dV are summed at the end (GQA without K/V copies).
// With Z = keep / (1 - p): dV = (P Z)^T dO, dS = P (dP_drop Z - delta), delta = rowsum(dO O)
// of the dropped output O.
#include <torch/library.h>

#include "flash_attention_fp32.h"

namespace npuspeed::cpu::flash32 {
namespace {

// Per-(batch, query head) state: padded Q and dO rows, dQ, lse, delta, each row's key range.
struct HeadGrad {
  std::vector<float> q_rows, do_rows, dq, lse, delta;
  std::vector<int32_t> lo, hi;
  const float* q = nullptr;
  const float* dout = nullptr;
  int64_t q_stride = 0, do_stride = 0, b = 0, h = 0;
};

void backward_key_tile(const Shape& sh, const Call& call, const float* kt, const float* vt, const float* kp,
                       int64_t j0, HeadGrad& g, float* dk, float* dv) {
  const int64_t mk = std::min(kTile, sh.sk - j0), dp = sh.dp;
  alignas(64) float p[kTile * kTile], ds[kTile * kTile];
  uint64_t keep[kTile];
  const bool dropout = call.dropout.on;
  bool started = false;  // the first query tile seen starts this key tile's dK/dV rows
  for (int64_t i0 = 0; i0 < sh.sq; i0 += kTile) {
    const int64_t mq = std::min(kTile, sh.sq - i0);
    const int32_t* lo = g.lo.data() + i0;
    const int32_t* hi = g.hi.data() + i0;
    if (!attention::any_row_meets(lo, hi, mq, j0, j0 + mk)) continue;
    if (dropout) philox::keep_bits(call.dropout, g.b, g.h, i0, mq, j0, keep);
    f32mm::gemm(mq, kTile, sh.d, g.q + i0 * g.q_stride, g.q_stride, 1, kt + j0, sh.skp, p, kTile, false);
    f32mm::gemm(mq, kTile, sh.d, g.dout + i0 * g.do_stride, g.do_stride, 1, vt + j0, sh.skp, ds, kTile, false);
    for (int64_t r = 0; r < mq; ++r) {
      float* prow = p + r * kTile;
      float* drow = ds + r * kTile;  // dP_drop, then dS
      const int64_t a = lo[r] - j0, z = hi[r] - j0;
      if (a >= kTile || z <= 0 || z <= a) {
        std::fill(prow, prow + kTile, 0.0f);
        std::fill(drow, drow + kTile, 0.0f);
        continue;
      }
      f32mm::exp_row(prow, kTile, sh.scale, g.lse[i0 + r]);
      if (a > 0 || z < kTile) f32mm::mask_row(prow, kTile, a, z, 0.0f);
      if (dropout) f32mm::dropout_row(drow, kTile, keep[r], call.dropout.scale);
      const f32mm::Vec delta(g.delta[i0 + r]);
      for (int64_t c = 0; c < kTile; c += f32mm::kW) {
        const f32mm::Vec pv = f32mm::Vec::loadu(prow + c);
        (pv * (f32mm::Vec::loadu(drow + c) - delta)).store(drow + c);
      }
      if (dropout) f32mm::dropout_row(prow, kTile, keep[r], call.dropout.scale);
    }
    // dV += (P Z)^T dO, dK += dS^T Q (A read transposed in place), dQ += dS K.
    f32mm::gemm(mk, dp, mq, p, 1, kTile, g.do_rows.data() + i0 * dp, dp, dv + j0 * dp, dp, started);
    f32mm::gemm(mk, dp, mq, ds, 1, kTile, g.q_rows.data() + i0 * dp, dp, dk + j0 * dp, dp, started);
    f32mm::gemm(mq, dp, mk, ds, kTile, 1, kp + j0 * dp, dp, g.dq.data() + i0 * dp, dp, true);
    started = true;
  }
  if (!started) {  // no query sees these keys
    std::fill(dv + j0 * dp, dv + (j0 + mk) * dp, 0.0f);
    std::fill(dk + j0 * dp, dk + (j0 + mk) * dp, 0.0f);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_attention_fp32_backward(
    const at::Tensor& grad_in, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out_in, const at::Tensor& lse, double scale, bool causal, double dropout_p, int64_t seed,
    int64_t offset, int64_t q_pos0, int64_t k_pos0, int64_t head0, const std::optional<at::Tensor>& key_lo,
    const std::optional<at::Tensor>& key_hi) {
  check_inputs(q, k, v);
  const at::Tensor grad = grad_in.stride(3) == 1 ? grad_in : grad_in.contiguous();
  const at::Tensor out = out_in.stride(3) == 1 ? out_in : out_in.contiguous();
  TORCH_CHECK(grad.sizes() == q.sizes() && out.sizes() == q.sizes() && grad.scalar_type() == at::kFloat &&
                  out.scalar_type() == at::kFloat,
              "npuspeed::flash_attention_fp32_backward: grad/out must match the query");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() &&
                  lse.sizes() == at::IntArrayRef({q.size(1), q.size(2), q.size(0)}),
              "npuspeed::flash_attention_fp32_backward: lse must be fp32 [b, hq, sq]");
  const Shape sh = shape_of(q, k, scale);
  const Call call = make_call(q, k, causal, dropout_p, seed, offset, q_pos0, k_pos0, head0, key_lo, key_hi);
  const int64_t d = sh.d, dp = sh.dp, group = sh.hq / sh.hk;
  const at::Tensor kt = pack_kv(k, sh, Pack::Transposed), vt = pack_kv(v, sh, Pack::Transposed);
  const at::Tensor kp = pack_kv(k, sh, Pack::Rows);
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dkv_heads = at::empty({2, sh.b * sh.hq, sh.skp * dp}, q.options());
  float* dk_heads = dkv_heads.data_ptr<float>();
  float* dv_heads = dk_heads + sh.b * sh.hq * sh.skp * dp;
  const float* lse_base = lse.data_ptr<float>();
  at::parallel_for(0, sh.b * sh.hq, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int64_t bi = bh / sh.hq, h = bh % sh.hq, kv = bi * sh.hk + h / group;
      HeadGrad g;
      g.b = bi;
      g.h = h;
      g.q = head_ptr(q, bi, h);
      g.q_stride = q.stride(0);
      g.dout = head_ptr(grad, bi, h);
      g.do_stride = grad.stride(0);
      g.q_rows.resize(sh.sqp * dp);
      g.do_rows.resize(sh.sqp * dp);
      pack_rows(g.q, g.q_stride, sh.sq, sh.sqp, d, dp, g.q_rows.data());
      pack_rows(g.dout, g.do_stride, sh.sq, sh.sqp, d, dp, g.do_rows.data());
      g.dq.assign(sh.sqp * dp, 0.0f);
      g.lse.assign(lse_base + bh * sh.sq, lse_base + (bh + 1) * sh.sq);
      g.delta.resize(sh.sq);
      g.lo.assign(sh.sqp, 0);
      g.hi.assign(sh.sqp, 0);
      call.rows.fill(bi, 0, sh.sq, g.lo.data(), g.hi.data());
      const float* o = head_ptr(out, bi, h);
      for (int64_t t = 0; t < sh.sq; ++t) {
        const float* orow = o + t * out.stride(0);
        const float* grow = g.do_rows.data() + t * dp;
        float acc = 0.0f;
        for (int64_t c = 0; c < d; ++c) acc += grow[c] * orow[c];
        g.delta[t] = acc;
      }
      for (int64_t j0 = 0; j0 < sh.sk; j0 += kTile)
        backward_key_tile(sh, call, kt.data_ptr<float>() + kv * d * sh.skp, vt.data_ptr<float>() + kv * d * sh.skp,
                          kp.data_ptr<float>() + kv * sh.skp * dp, j0, g, dk_heads + bh * sh.skp * dp,
                          dv_heads + bh * sh.skp * dp);
      float* dq_head = dq.data_ptr<float>() + bi * dq.stride(1) + h * dq.stride(2);
      for (int64_t t = 0; t < sh.sq; ++t)
        for (int64_t c = 0; c < d; ++c) dq_head[t * dq.stride(0) + c] = g.dq[t * dp + c] * sh.scale;
    }
  });
  // dK = scale * sum over the group's query heads of their dK, dV = that sum of dV.
  at::Tensor dk = at::empty(k.sizes(), k.options()), dv = at::empty(v.sizes(), v.options());
  float* dk_out = dk.data_ptr<float>();
  float* dv_out = dv.data_ptr<float>();
  at::parallel_for(0, sh.b * sh.hk, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t bkv = lo; bkv < hi; ++bkv) {
      const int64_t bi = bkv / sh.hk, g_kv = bkv % sh.hk;
      for (int64_t t = 0; t < sh.sk; ++t) {
        float* dk_row = dk_out + t * dk.stride(0) + bi * dk.stride(1) + g_kv * dk.stride(2);
        float* dv_row = dv_out + t * dv.stride(0) + bi * dv.stride(1) + g_kv * dv.stride(2);
        for (int64_t c = 0; c < d; ++c) {
          float sk_sum = 0.0f, sv_sum = 0.0f;
          for (int64_t h = g_kv * group; h < (g_kv + 1) * group; ++h) {
            const int64_t off = (bi * sh.hq + h) * sh.skp * dp + t * dp + c;
            sk_sum += dk_heads[off];
            sv_sum += dv_heads[off];
          }
          dk_row[c] = sk_sum * sh.scale;
          dv_row[c] = sv_sum;
        }
      }
    }
  });
  return {dq, dk, dv};
}

}  // namespace
}  // namespace npuspeed::cpu::flash32

TORCH_LIBRARY_IMPL(npuspeed, CPU, m) {
  m.impl("flash_attention_fp32_backward", &npuspeed::cpu::flash32::flash_attention_fp32_backward);
}
