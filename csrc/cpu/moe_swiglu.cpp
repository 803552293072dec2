// SwiGLU weighted by the router probability of each row, for the grouped expert MLP:
//
//   x [N, 2F] = [a | b],  p [N]  ->  y = silu(a) * b * p      [N, F]
//   da = g * p * b * s * (1 + a * (1 - s)),  db = g * p * silu(a),  dp = sum_j g * silu(a) * b
//
// Megatron's expert MLP computes glu(x) (chunk, silu, an add of glu_linear_offset, a mul),
// then promotes it to fp32 to scale by the probabilities and casts back: about eight passes
// over [N, F] forward and a dozen backward, each with a full-size temporary. Here each row is
// read once and written once each way, in fp32, with the sigmoid recomputed in backward.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "vec_io.h"

namespace npuspeed::cpu {
namespace {

template <typename V>
inline V silu(const V& a) {  // ATen's vectorized silu: a / (1 + exp(-a))
  const V one(typename V::value_type(1));
  return a / (one + a.neg().exp());
}

template <typename T>
void fwd_kernel(const T* x, const float* p, T* y, int64_t rows, int64_t f) {
  using V = AVec<T>;
  using A = acc_t<T>;
  constexpr int64_t S = kStep<T>;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(f, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* a_row = x + r * 2 * f;
      const T* b_row = a_row + f;
      const V w(static_cast<A>(p[r]));
      V a0, a1, b0, b1;
      for (int64_t j = 0; j < f; j += S) {
        const int64_t n = std::min<int64_t>(S, f - j);
        load2_upto(a_row + j, a0, a1, n);
        load2_upto(b_row + j, b0, b1, n);
        store2_upto(y + r * f + j, silu(a0) * b0 * w, silu(a1) * b1 * w, n);
      }
    }
  });
}

template <typename T>
void bwd_kernel(const T* g, const T* x, const float* p, T* dx, float* dp, int64_t rows, int64_t f) {
  using V = AVec<T>;
  using A = acc_t<T>;
  constexpr int64_t S = kStep<T>;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(f, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    const V one(A(1));
    for (int64_t r = begin; r < end; ++r) {
      const T* a_row = x + r * 2 * f;
      const T* b_row = a_row + f;
      const T* g_row = g + r * f;
      T* da_row = dx + r * 2 * f;
      T* db_row = da_row + f;
      const V w(static_cast<A>(p[r]));
      V dot(A(0));
      V a[2], b[2], gg[2], da[2], db[2];
      for (int64_t j = 0; j < f; j += S) {
        const int64_t n = std::min<int64_t>(S, f - j);
        load2_upto(a_row + j, a[0], a[1], n);
        load2_upto(b_row + j, b[0], b[1], n);
        load2_upto(g_row + j, gg[0], gg[1], n);
        for (int k = 0; k < 2; ++k) {
          const V denom = one + a[k].neg().exp();
          const V s = one / denom;
          const V act = a[k] / denom;
          const V gw = gg[k] * w;
          dot = dot + gg[k] * (act * b[k]);  // tails are zero-filled, so they add nothing
          db[k] = gw * act;
          da[k] = gw * b[k] * s * (one + a[k] * (one - s));
        }
        store2_upto(da_row + j, da[0], da[1], n);
        store2_upto(db_row + j, db[0], db[1], n);
      }
      if (dp) dp[r] = static_cast<float>(hsum<A>(dot));
    }
  });
}

int64_t check(const at::Tensor& x, const at::Tensor& probs, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && probs.device().is_cpu(), op, ": CPU tensors expected");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, op, ": input must be [rows, 2F] (gate and linear halves), got ",
              x.sizes());
  TORCH_CHECK(probs.numel() == x.size(0), op, ": probs must hold one value per row (", x.size(0), "), got ",
              probs.sizes());
  return x.size(1) / 2;
}

at::Tensor moe_weighted_swiglu_cpu(const at::Tensor& input, const at::Tensor& probs_in) {
  const char* op = "npuspeed::moe_weighted_swiglu";
  const int64_t f = check(input, probs_in, op);
  const at::Tensor x = input.contiguous();
  const at::Tensor p = probs_in.reshape({-1}).to(at::kFloat).contiguous();
  at::Tensor y = at::empty({x.size(0), f}, x.options());
  if (x.size(0) == 0 || f == 0) return y;
  NPUSPEED_DISPATCH_FLOATING(x.scalar_type(), "npuspeed::moe_weighted_swiglu", [&] {
    fwd_kernel<scalar_t>(x.const_data_ptr<scalar_t>(), p.const_data_ptr<float>(), y.mutable_data_ptr<scalar_t>(),
                         x.size(0), f);
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> moe_weighted_swiglu_backward_cpu(const at::Tensor& grad, const at::Tensor& input,
                                                                    const at::Tensor& probs_in, bool probs_grad) {
  const char* op = "npuspeed::moe_weighted_swiglu_backward";
  const int64_t f = check(input, probs_in, op);
  const at::Tensor x = input.contiguous();
  TORCH_CHECK(grad.dim() == 2 && grad.size(0) == x.size(0) && grad.size(1) == f, op, ": grad must be [", x.size(0),
              ", ", f, "], got ", grad.sizes());
  const at::Tensor g = grad.to(x.scalar_type()).contiguous();
  const at::Tensor p = probs_in.reshape({-1}).to(at::kFloat).contiguous();
  at::Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor dp = at::empty({probs_grad ? x.size(0) : 0}, x.options().dtype(at::kFloat));
  if (x.size(0) > 0 && f > 0) {
    NPUSPEED_DISPATCH_FLOATING(x.scalar_type(), "npuspeed::moe_weighted_swiglu_backward", [&] {
      bwd_kernel<scalar_t>(g.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), p.const_data_ptr<float>(),
                           dx.mutable_data_ptr<scalar_t>(), probs_grad ? dp.mutable_data_ptr<float>() : nullptr,
                           x.size(0), f);
    });
  } else if (probs_grad) {
    dp.zero_();
  }
  if (probs_grad && probs_in.scalar_type() != at::kFloat) dp = dp.to(probs_in.scalar_type());
  return {dx, dp};
}

}  // namespace
}  // namespace npuspeed::cpu

TORCH_LIBRARY_FRAGMENT(npuspeed, m) {
  m.def("moe_weighted_swiglu(Tensor input, Tensor probs) -> Tensor");
  m.def("moe_weighted_swiglu_backward(Tensor grad, Tensor input, Tensor probs, bool probs_grad) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(npuspeed, CPU, m) {
  m.impl("moe_weighted_swiglu", &npuspeed::cpu::moe_weighted_swiglu_cpu);
  m.impl("moe_weighted_swiglu_backward", &npuspeed::cpu::moe_weighted_swiglu_backward_cpu);
}
