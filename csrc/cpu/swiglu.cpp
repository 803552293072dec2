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

#include "vec_io.h"

namespace npuspeed::cpu {
namespace {

// The same operation order as ATen's vectorized silu and silu_backward CPU kernels, so fp32
// results match them bit for bit (eager on strided chunk halves may differ by an ulp).
template <typename V>
inline V silu(const V& a) {
  const V one(typename V::value_type(1));
  return a / (one + a.neg().exp());
}

template <typename T>
void swiglu_fwd_kernel(const T* x, T* y, int64_t rows, int64_t f) {
  using V = AVec<T>;
  constexpr int64_t S = kStep<T>;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(f, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* a_row = x + r * 2 * f;
      const T* b_row = a_row + f;
      T* y_row = y + r * f;
      V a0, a1, b0, b1;
      for (int64_t j = 0; j < f; j += S) {
        const int64_t n = std::min<int64_t>(S, f - j);
        load2_upto(a_row + j, a0, a1, n);
        load2_upto(b_row + j, b0, b1, n);
        store2_upto(y_row + j, silu(a0) * b0, silu(a1) * b1, n);
      }
    }
  });
}

template <typename T>
void swiglu_bwd_kernel(const T* g, const T* x, T* dx, int64_t rows, int64_t f) {
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
      V a[2], b[2], gg[2], da[2], db[2];
      for (int64_t j = 0; j < f; j += S) {
        const int64_t n = std::min<int64_t>(S, f - j);
        load2_upto(a_row + j, a[0], a[1], n);
        load2_upto(b_row + j, b[0], b[1], n);
        load2_upto(g_row + j, gg[0], gg[1], n);
        for (int k = 0; k < 2; ++k) {
          const V denom = one + a[k].neg().exp();  // sigmoid = 1 / denom, silu = a / denom
          const V s = one / denom;
          db[k] = gg[k] * (a[k] / denom);
          da[k] = gg[k] * b[k] * s * (one + a[k] * (one - s));
        }
        store2_upto(da_row + j, da[0], da[1], n);
        store2_upto(db_row + j, db[0], db[1], n);
      }
    }
  });
}

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
    swiglu_fwd_kernel<scalar_t>(x.const_data_ptr<scalar_t>(), y.mutable_data_ptr<scalar_t>(), rows, f);
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
    swiglu_bwd_kernel<scalar_t>(g.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                                dx.mutable_data_ptr<scalar_t>(), rows, f);
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
