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

#include "swiglu_kernels.h"

namespace npuspeed::cpu {
namespace {

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
    swiglu_rows::swiglu_fwd<scalar_t>(x.const_data_ptr<scalar_t>(), p.const_data_ptr<float>(),
                                      y.mutable_data_ptr<scalar_t>(), x.size(0), f);
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
      swiglu_rows::swiglu_bwd<scalar_t>(g.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                                        p.const_data_ptr<float>(), dx.mutable_data_ptr<scalar_t>(),
                                        probs_grad ? dp.mutable_data_ptr<float>() : nullptr, x.size(0), f);
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
