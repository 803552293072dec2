// SwiGLU in Megatron's layout: the fc1 output [..., 2F] holds the gate half a = x[..., :F]
// and the linear half b = x[..., F:] (torch.chunk(x, 2, -1)).
//
//   y  = silu(a) * b,        silu(a) = a * s,  s = sigmoid(a)
//   da = g * b * s * (1 + a * (1 - s))
//   db = g * silu(a)
//
// Eager PyTorch runs silu, mul and in backward silu_backward, two muls and the cat of the
// chunk gradients, each over strided halves with full-size temporaries. Here each row is read
// once and written once each way, in fp32 (fp64 for fp64), with the sigmoid recomputed in
// backward from the saved input rather than stored.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "swiglu_kernels.h"

namespace npuspeed::cpu {
namespace {

int64_t half_width(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() >= 1, name, ": input must have at least one dimension");
  TORCH_CHECK(x.size(-1) % 2 == 0, name, ": the last dimension (", x.size(-1),
              ") must be even: it holds the gate and linear halves");
  TORCH_CHECK(x.device().is_cpu(), name, ": CPU tensors expected");
  return x.size(-1) / 2;
}

at::Tensor swiglu_cpu(const at::Tensor& input) {
  const int64_t f = half_width(input, "npuspeed::swiglu");
  const at::Tensor x = input.contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = f;
  at::Tensor y = at::empty(sizes, x.options());
  const int64_t rows = f == 0 ? 0 : x.numel() / (2 * f);
  if (rows == 0) {
    return y;
  }
  NPUSPEED_DISPATCH_FLOATING(x.scalar_type(), "npuspeed::swiglu", [&] {
    swiglu_rows::swiglu_fwd<scalar_t>(x.const_data_ptr<scalar_t>(), nullptr, y.mutable_data_ptr<scalar_t>(), rows, f);
  });
  return y;
}

at::Tensor swiglu_backward_cpu(const at::Tensor& grad, const at::Tensor& input) {
  const int64_t f = half_width(input, "npuspeed::swiglu_backward");
  const at::Tensor x = input.contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = f;
  TORCH_CHECK(grad.sizes() == at::IntArrayRef(sizes), "npuspeed::swiglu_backward: grad shape ", grad.sizes(),
              " does not match the output shape ", at::IntArrayRef(sizes));
  const at::Tensor g = grad.to(x.scalar_type()).contiguous();
  at::Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t rows = f == 0 ? 0 : x.numel() / (2 * f);
  if (rows == 0) {
    return dx;
  }
  NPUSPEED_DISPATCH_FLOATING(x.scalar_type(), "npuspeed::swiglu_backward", [&] {
    swiglu_rows::swiglu_bwd<scalar_t>(g.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), nullptr,
                                      dx.mutable_data_ptr<scalar_t>(), nullptr, rows, f);
  });
  return dx;
}

}  // namespace
}  // namespace npuspeed::cpu

TORCH_LIBRARY_FRAGMENT(npuspeed, m) {
  m.def("swiglu(Tensor input) -> Tensor");
  m.def("swiglu_backward(Tensor grad, Tensor input) -> Tensor");
}

TORCH_LIBRARY_IMPL(npuspeed, CPU, m) {
  m.impl("swiglu", &npuspeed::cpu::swiglu_cpu);
  m.impl("swiglu_backward", &npuspeed::cpu::swiglu_backward_cpu);
}
