// Flash attention for bf16 on CPUs with AVX512-BF16, in Megatron's [s, b, h, d] layout.
//
// Why not PyTorch's CPU flash kernel: on bf16 it runs at about a third of the speed of the
// same machine's bf16 GEMMs (its tiles go through generic cpublas calls and per-tile
// conversions). Here every tile product is one register-blocked VDPBF16PS loop
// (bf16_gemm.h) on operands packed once per head, so attention runs near GEMM speed.
//
// The algorithm is FlashAttention-2: forward walks 64 x 64 tiles with an online softmax in
// fp32 (no S x S tensor), keeps the row log-sum-exp; backward recomputes each probability
// tile from it, walking key tiles outer so dK/dV stay local. Causal tiles above the diagonal
// are skipped. GQA reads each K/V head once for its query group (no copies). Probabilities
// and dS enter the next product as bf16, as in every flash kernel; all sums are fp32.
// Parallel over (batch, query head) [x query tiles in forward]; dK/dV of a group are summed
// from per-head fp32 buffers.
// GCC 12's AVX-512 headers start reductions from _mm512_undefined_* and then warn about it.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

#include "bf16_gemm.h"

namespace npuspeed::cpu {
namespace {

using bf16mm::bf16;
constexpr int64_t kTile = 64;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

int64_t round_up(int64_t x) { return (x + kTile - 1) / kTile * kTile; }

// One head of a [s, b, h, d] tensor: row t at base + t * row_stride.
struct HeadView {
  const bf16* base;
  int64_t row_stride;
  const bf16* row(int64_t t) const { return base + t * row_stride; }
};

HeadView head(const at::Tensor& x, int64_t b, int64_t h) {
  return {x.data_ptr<at::BFloat16>() + b * x.stride(1) + h * x.stride(2), x.stride(0)};
}

// [s][d] -> pairs of rows: dst[(t/2) * 2d + 2c + t%2] = x[t][c]; rows s..sp-1 are zero.
void pack_row_pairs(const HeadView& x, int64_t s, int64_t sp, int64_t d, bf16* dst) {
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
void pack_col_pairs(const HeadView& x, int64_t s, int64_t sp, int64_t d, bf16* dst) {
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
void pack_transpose(const HeadView& x, int64_t s, int64_t sp, int64_t d, bf16* dst) {
  for (int64_t c = 0; c < d; ++c)
    for (int64_t t = 0; t < sp; ++t) dst[c * sp + t] = t < s ? x.row(t)[c] : bf16(0.0f);
}

enum class Pack { RowPairs, ColPairs, Transpose };

void pack(Pack how, const HeadView& x, int64_t s, int64_t sp, int64_t d, bf16* dst) {
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

struct Shape {
  int64_t sq, sk, b, hq, hk, d;
  float scale;
  bool causal;
};

// Forward for one (batch, query head, query tile): online softmax over key tiles.
NPUSPEED_BF16_TARGET void forward_tile(const Shape& sh, const HeadView& q, const bf16* kt_pack,
                                       const bf16* v_pack, int64_t skp, int64_t i0, bf16* out,
                                       int64_t out_stride, float* lse) {
  const int64_t d = sh.d;
  const int64_t rows = std::min(kTile, sh.sq - i0);
  alignas(64) float s_tile[kTile * kTile];
  alignas(64) bf16 p_tile[kTile * kTile];
  std::vector<float> o_acc(kTile * d, 0.0f);
  float m[kTile], l[kTile];
  for (int64_t r = 0; r < kTile; ++r) {
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.0f;
  }
  const float c = sh.scale * kLog2e;  // softmax in base 2
  const int64_t j_end = sh.causal ? std::min(sh.sk, i0 + rows) : sh.sk;
  for (int64_t j0 = 0; j0 < j_end; j0 += kTile) {
    bf16mm::gemm(rows, kTile, d, q.row(i0), q.row_stride, kt_pack + 2 * j0, 2 * skp, s_tile, kTile, false);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t limit = sh.causal ? std::min(sh.sk, i0 + r + 1) - j0 : sh.sk - j0;
      float* srow = s_tile + r * kTile;
      __m512 x[kTile / 16];
      __mmask16 valid[kTile / 16];
      __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int v = 0; v < kTile / 16; ++v) {
        valid[v] = lanes_below(16 * v, limit);
        x[v] = _mm512_mul_ps(_mm512_loadu_ps(srow + 16 * v), _mm512_set1_ps(c));
        vmax = _mm512_mask_max_ps(vmax, valid[v], vmax, x[v]);
      }
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(vmax));
      const float alpha = std::exp2(m[r] - m_new);  // 0 on the first tile (m = -inf)
      __m512 vsum = _mm512_setzero_ps();
      for (int v = 0; v < kTile / 16; ++v) {
        const __m512 p = _mm512_maskz_mov_ps(valid[v], bf16mm::exp2_ps(_mm512_sub_ps(x[v], _mm512_set1_ps(m_new))));
        vsum = _mm512_add_ps(vsum, p);
        bf16mm::store_bf16(p_tile + r * kTile + 16 * v, p);
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
    const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
    for (int64_t cc = 0; cc < d; cc += 16)
      bf16mm::store_bf16(out + (i0 + r) * out_stride + cc, _mm512_mul_ps(_mm512_loadu_ps(o_acc.data() + r * d + cc), inv));
    lse[i0 + r] = (m[r] + std::log2(l[r])) * kLn2;
  }
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal) {
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
  TORCH_CHECK(!causal || q.size(0) == k.size(0), "npuspeed::flash_attention: causal needs sq == sk");
  TORCH_CHECK(q.size(0) > 0 && k.size(0) > 0, "npuspeed::flash_attention: empty sequence");
}

Shape shape_of(const at::Tensor& q, const at::Tensor& k, double scale, bool causal) {
  return {q.size(0), k.size(0), q.size(1), q.size(2), k.size(2), q.size(3), static_cast<float>(scale), causal};
}

// Every (batch, key head) of K or V packed once, shared by its query group.
at::Tensor pack_kv(const at::Tensor& x, const Shape& sh, Pack how) {
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

std::tuple<at::Tensor, at::Tensor> flash_attention_cpu(const at::Tensor& q, const at::Tensor& k,
                                                       const at::Tensor& v, double scale, bool causal) {
  check_inputs(q, k, v, causal);
  const Shape sh = shape_of(q, k, scale, causal);
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
      forward_tile(sh, qv, kt_base + kv * skp * sh.d, vp_base + kv * skp * sh.d, skp, i0,
                   out_base + (bi * sh.hq + h) * sh.d, out_stride, lse_base + bh * sh.sq);
    }
  });
  return {out, lse};
}


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
};

// dK/dV of one query head for key tile j0 over all its query tiles, and its dQ^T share.
NPUSPEED_BF16_TARGET void backward_key_tile(const Shape& sh, const HeadView& kv_k, const HeadView& kv_v,
                                            const bf16* k_t, int64_t j0, HeadGrad& g, float* dk, float* dv) {
  const int64_t d = sh.d, sqp = round_up(sh.sq), skp = round_up(sh.sk);
  const int64_t mk = std::min(kTile, sh.sk - j0);
  alignas(64) float st[kTile * kTile], dpt[kTile * kTile];
  alignas(64) bf16 pt_b[kTile * kTile], dst_b[kTile * kTile], dst_pairs[kTile * kTile];
  if (mk < kTile) std::fill(dst_pairs, dst_pairs + kTile * kTile, bf16(0.0f));
  const __m512i interleave = interleave_index();
  const float c = sh.scale * kLog2e;
  const int64_t i_first = sh.causal ? j0 : 0;
  for (int64_t i0 = i_first; i0 < sh.sq; i0 += kTile) {
    const int64_t mq = std::min(kTile, sh.sq - i0);
    bf16mm::gemm(mk, kTile, d, kv_k.row(j0), kv_k.row_stride, g.qt_pack.data() + 2 * i0, 2 * sqp, st, kTile, false);
    bf16mm::gemm(mk, kTile, d, kv_v.row(j0), kv_v.row_stride, g.dot_pack.data() + 2 * i0, 2 * sqp, dpt, kTile, false);
    for (int64_t cc = 0; cc < mk; ++cc) {  // key j0 + cc sees queries r in [lo, mq)
      const int64_t lo = sh.causal ? std::max<int64_t>(0, j0 + cc - i0) : 0;
      for (int v = 0; v < kTile / 16; ++v) {
        const int64_t r0 = 16 * v;
        const __mmask16 valid = lanes_below(r0, mq) & ~lanes_below(r0, lo);
        const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(st + cc * kTile + r0), _mm512_set1_ps(c),
                                         _mm512_loadu_ps(g.lse2.data() + i0 + r0));
        const __m512 p = _mm512_maskz_mov_ps(valid, bf16mm::exp2_ps(x));
        const __m512 ds = _mm512_mul_ps(p, _mm512_sub_ps(_mm512_loadu_ps(dpt + cc * kTile + r0),
                                                         _mm512_loadu_ps(g.delta.data() + i0 + r0)));
        bf16mm::store_bf16(pt_b + cc * kTile + r0, p);
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
    const bool more = i0 != i_first;  // the first query tile starts this key tile's dK/dV rows
    bf16mm::gemm(mk, d, kTile, pt_b, kTile, g.do_pack.data() + i0 * d, 2 * d, dv + j0 * d, d, more);
    bf16mm::gemm(mk, d, kTile, dst_b, kTile, g.q_pack.data() + i0 * d, 2 * d, dk + j0 * d, d, more);
    bf16mm::gemm(d, kTile, kTile, k_t + j0, skp, dst_pairs, 2 * kTile, g.dq_t.data() + i0, sqp, true);
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
    const at::Tensor& out, const at::Tensor& lse, double scale, bool causal) {
  check_inputs(q, k, v, causal);
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
      for (int64_t t = 0; t < sh.sq; ++t) g.lse2[t] = lse_base[bh * sh.sq + t] * kLog2e;
      row_dot(dov, ov, sh.sq, d, g.delta.data());
      const HeadView kk = head(k, bi, g_kv), vv = head(v, bi, g_kv);
      const bf16* kt = k_t_base + (bi * sh.hk + g_kv) * skp * d;
      for (int64_t j0 = 0; j0 < sh.sk; j0 += kTile)
        backward_key_tile(sh, kk, vv, kt, j0, g, dk_heads + bh * skp * d, dv_heads + bh * skp * d);
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
}  // namespace npuspeed::cpu

TORCH_LIBRARY_FRAGMENT(npuspeed, m) {
  m.def("flash_attention(Tensor query, Tensor key, Tensor value, float scale, bool causal) -> (Tensor, Tensor)");
  m.def("flash_attention_backward(Tensor grad, Tensor query, Tensor key, Tensor value, Tensor out, "
        "Tensor lse, float scale, bool causal) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(npuspeed, CPU, m) {
  m.impl("flash_attention", &npuspeed::cpu::flash_attention_cpu);
  m.impl("flash_attention_backward", &npuspeed::cpu::flash_attention_backward_cpu);
}
