// Rotary position embedding for Megatron's [s, b, h, d] layout, forward and backward.
//
// cos/sin are cos(freqs) and sin(freqs) (already scaled and rounded as Megatron does), of a
// shape broadcastable to [s, b, h, rot] with rot <= d; the last d - rot channels pass through.
// Rotate-half form, with h2 = rot / 2 and j < h2:
//   out[j]      = x[j] * c[j]         - x[j + h2] * s[j]
//   out[j + h2] = x[j + h2] * c[j+h2] + x[j] * s[j + h2]
// Interleaved form: the same on the pairs (2k, 2k+1). The backward is the transposed
// rotation, so the same kernel runs with the roles of the sine terms exchanged. No fused
// multiply-adds: the fp32 forward then equals Megatron's `t * cos + rotate_half(t) * sin` bitwise.
//
// Eager PyTorch materialises the rotated copy (chunk, neg, cat), two products and a sum, plus
// a cat for the pass-through; here each row is read and written once.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "vec_io.h"

namespace npuspeed::cpu {
namespace {

struct RopeGeometry {
  int64_t s, b, h, d, rot;
  int64_t cs0, cs1, cs2;  // strides of cos/sin over s, b, h (0 where broadcast)
};

template <typename T, bool kBackward>
void rope_half_row(const T* x, const acc_t<T>* c, const acc_t<T>* sn, T* out, int64_t h2) {
  using V = AVec<T>;
  constexpr int64_t S = kStep<T>;
  V lo[2], hi[2], cl[2], ch[2], sl[2], sh[2], ol[2], oh[2];
  for (int64_t j = 0; j < h2; j += S) {
    const int64_t n = std::min<int64_t>(S, h2 - j);
    load2_upto(x + j, lo[0], lo[1], n);
    load2_upto(x + h2 + j, hi[0], hi[1], n);
    load2_upto(c + j, cl[0], cl[1], n);
    load2_upto(c + h2 + j, ch[0], ch[1], n);
    load2_upto(sn + j, sl[0], sl[1], n);
    load2_upto(sn + h2 + j, sh[0], sh[1], n);
    for (int k = 0; k < 2; ++k) {
      if constexpr (!kBackward) {
        ol[k] = lo[k] * cl[k] - hi[k] * sl[k];
        oh[k] = hi[k] * ch[k] + lo[k] * sh[k];
      } else {
        ol[k] = lo[k] * cl[k] + hi[k] * sh[k];
        oh[k] = hi[k] * ch[k] - lo[k] * sl[k];
      }
    }
    store2_upto(out + j, ol[0], ol[1], n);
    store2_upto(out + h2 + j, oh[0], oh[1], n);
  }
}

// Pairs (2k, 2k+1): a step of 2N elements is split into its N even and N odd channels
// (at::vec::deinterleave2), rotated, and interleaved back. Written with explicit vector ops:
// GCC's SLP vectorizer turns the scalar form into fmaddsub even under -ffp-contract=off.
template <typename T, bool kBackward>
void rope_interleaved_row(const T* x, const acc_t<T>* c, const acc_t<T>* sn, T* out, int64_t rot) {
  using V = AVec<T>;
  constexpr int64_t S = kStep<T>;
  V x0, x1, c0, c1, s0, s1;
  for (int64_t j = 0; j < rot; j += S) {
    const int64_t n = std::min<int64_t>(S, rot - j);
    load2_upto(x + j, x0, x1, n);
    load2_upto(c + j, c0, c1, n);
    load2_upto(sn + j, s0, s1, n);
    auto [e, o] = at::vec::deinterleave2(x0, x1);
    auto [ce, co] = at::vec::deinterleave2(c0, c1);
    auto [se, so] = at::vec::deinterleave2(s0, s1);
    V oe, oo;
    if constexpr (!kBackward) {
      oe = e * ce - o * se;
      oo = o * co + e * so;
    } else {
      oe = e * ce + o * so;
      oo = o * co - e * se;
    }
    auto [y0, y1] = at::vec::interleave2(oe, oo);
    store2_upto(out + j, y0, y1, n);
  }
}

template <typename T, bool kBackward>
void rope_kernel(const T* x, const acc_t<T>* c, const acc_t<T>* sn, T* out, const RopeGeometry& g,
                 bool interleaved) {
  const int64_t rows = g.s * g.b * g.h;
  const int64_t grain = row_grain(16384, g.d);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t hi = r % g.h, bi = (r / g.h) % g.b, si = r / (g.h * g.b);
      const int64_t coff = si * g.cs0 + bi * g.cs1 + hi * g.cs2;
      const T* xr = x + r * g.d;
      T* outr = out + r * g.d;
      if (interleaved) {
        rope_interleaved_row<T, kBackward>(xr, c + coff, sn + coff, outr, g.rot);
      } else {
        rope_half_row<T, kBackward>(xr, c + coff, sn + coff, outr, g.rot / 2);
      }
      if (g.rot < g.d) {
        std::memcpy(outr + g.rot, xr + g.rot, (g.d - g.rot) * sizeof(T));
      }
    }
  });
}

at::Tensor rope_cpu(const at::Tensor& input, const at::Tensor& cos, const at::Tensor& sin, bool interleaved,
                    bool backward) {
  const char* name = backward ? "npuspeed::rotary_pos_emb_backward" : "npuspeed::rotary_pos_emb";
  TORCH_CHECK(input.dim() == 4, name, ": input must be [s, b, h, d], got ", input.sizes());
  TORCH_CHECK(cos.dim() == 4 && sin.sizes() == cos.sizes(), name,
              ": cos and sin must be 4-D and of one shape, got ", cos.sizes(), " and ", sin.sizes());
  TORCH_CHECK(input.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(), name,
              ": CPU tensors expected");
  const at::Tensor x = input.contiguous();
  RopeGeometry g{x.size(0), x.size(1), x.size(2), x.size(3), cos.size(3), 0, 0, 0};
  TORCH_CHECK(g.rot % 2 == 0 && g.rot <= g.d, name, ": the rotary dimension (", g.rot,
              ") must be even and at most the head dimension (", g.d, ")");
  const auto acc_type = at::toOpMathType(x.scalar_type());
  const at::Tensor c = cos.to(acc_type).contiguous().expand({g.s, g.b, g.h, g.rot});
  const at::Tensor sn = sin.to(acc_type).contiguous().expand({g.s, g.b, g.h, g.rot});
  g.cs0 = c.stride(0);
  g.cs1 = c.stride(1);
  g.cs2 = c.stride(2);
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (x.numel() == 0) {
    return out;
  }
  NPUSPEED_DISPATCH_FLOATING(x.scalar_type(), "npuspeed::rotary_pos_emb", [&] {
    using A = acc_t<scalar_t>;
    if (backward) {
      rope_kernel<scalar_t, true>(x.const_data_ptr<scalar_t>(), c.const_data_ptr<A>(), sn.const_data_ptr<A>(),
                                  out.mutable_data_ptr<scalar_t>(), g, interleaved);
    } else {
      rope_kernel<scalar_t, false>(x.const_data_ptr<scalar_t>(), c.const_data_ptr<A>(), sn.const_data_ptr<A>(),
                                   out.mutable_data_ptr<scalar_t>(), g, interleaved);
    }
  });
  return out;
}

at::Tensor rotary_pos_emb_cpu(const at::Tensor& t, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  return rope_cpu(t, cos, sin, interleaved, false);
}

at::Tensor rotary_pos_emb_backward_cpu(const at::Tensor& grad, const at::Tensor& cos, const at::Tensor& sin,
                                       bool interleaved) {
  return rope_cpu(grad, cos, sin, interleaved, true);
}

}  // namespace
}  // namespace npuspeed::cpu

TORCH_LIBRARY_FRAGMENT(npuspeed, m) {
  m.def("rotary_pos_emb(Tensor t, Tensor cos, Tensor sin, bool interleaved) -> Tensor");
  m.def("rotary_pos_emb_backward(Tensor grad, Tensor cos, Tensor sin, bool interleaved) -> Tensor");
}

TORCH_LIBRARY_IMPL(npuspeed, CPU, m) {
  m.impl("rotary_pos_emb", &npuspeed::cpu::rotary_pos_emb_cpu);
  m.impl("rotary_pos_emb_backward", &npuspeed::cpu::rotary_pos_emb_backward_cpu);
}
