// RMSNorm over the last dimension, forward and backward, in one pass per row each way.
//
//   y = x * rstd * w,                  rstd = 1 / sqrt(mean(x^2) + eps)    (per row)
//   dx = rstd * (w*g - x * rstd^2 * mean(x*w*g))
//   dw = sum_rows g * x * rstd
//
// Eager PyTorch runs this as five or six elementwise/reduction kernels each way, with fp32
// temporaries of the full input for bf16; here a row is read once (it stays in cache for the
// second sweep) and written once. Accumulation is fp32 (fp64 for fp64 inputs). The weight
// gradient is accumulated per thread chunk in fp32 and summed at the end.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cmath>

#include "vec_io.h"

namespace npuspeed::cpu {
namespace {

template <typename T>
void rms_norm_fwd_kernel(const T* x, const acc_t<T>* w, T* y, acc_t<T>* rstd_out, int64_t rows,
                         int64_t h, double eps) {
  using A = acc_t<T>;
  using V = AVec<T>;
  constexpr int64_t S = kStep<T>;
  const int64_t grain = row_grain(32768, h);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * h;
      T* yr = y + r * h;
      V acc0(A(0)), acc1(A(0)), a, b;
      int64_t j = 0;
      for (; j + S <= h; j += S) {
        load2(xr + j, a, b);
        acc0 = at::vec::fmadd(a, a, acc0);
        acc1 = at::vec::fmadd(b, b, acc1);
      }
      if (j < h) {
        load2(xr + j, a, b, h - j);
        acc0 = at::vec::fmadd(a, a, acc0);
        acc1 = at::vec::fmadd(b, b, acc1);
      }
      const A rstd = A(1) / std::sqrt(hsum(acc0 + acc1) / A(h) + A(eps));
      rstd_out[r] = rstd;
      const V vr(rstd);
      for (j = 0; j + S <= h; j += S) {
        load2(xr + j, a, b);
        store2(yr + j, a * vr * V::loadu(w + j), b * vr * V::loadu(w + j + V::size()));
      }
      if (j < h) {
        load2(xr + j, a, b, h - j);
        V wa, wb;
        load2(w + j, wa, wb, h - j);
        store2(yr + j, a * vr * wa, b * vr * wb, h - j);
      }
    }
  });
}

// dx for rows [begin, end); adds g * x * rstd into dw_part (length h) when it is not null.
template <typename T>
void rms_norm_bwd_rows(const T* g, const T* x, const acc_t<T>* w, const acc_t<T>* rstd, T* dx,
                       acc_t<T>* dw_part, int64_t begin, int64_t end, int64_t h) {
  using A = acc_t<T>;
  using V = AVec<T>;
  constexpr int64_t S = kStep<T>;
  for (int64_t r = begin; r < end; ++r) {
    const T* gr = g + r * h;
    const T* xr = x + r * h;
    T* dxr = dx + r * h;
    const A rs = rstd[r];
    V acc0(A(0)), acc1(A(0)), ga, gb, xa, xb, wa, wb;
    int64_t j = 0;
    for (; j < h; j += S) {
      const int64_t n = std::min<int64_t>(S, h - j);
      load2_upto(gr + j, ga, gb, n);
      load2_upto(xr + j, xa, xb, n);
      load2_upto(w + j, wa, wb, n);
      acc0 = at::vec::fmadd(xa * wa, ga, acc0);
      acc1 = at::vec::fmadd(xb * wb, gb, acc1);
    }
    // c = rstd^3 * mean(x*w*g); dx = rstd*w*g - c*x
    const V c(rs * rs * rs * hsum(acc0 + acc1) / A(h));
    const V vr(rs);
    for (j = 0; j < h; j += S) {
      const int64_t n = std::min<int64_t>(S, h - j);
      load2_upto(gr + j, ga, gb, n);
      load2_upto(xr + j, xa, xb, n);
      load2_upto(w + j, wa, wb, n);
      const V da = vr * wa * ga - c * xa;
      const V db = vr * wb * gb - c * xb;
      store2_upto(dxr + j, da, db, n);
      if (dw_part != nullptr) {
        V pa, pb;
        load2_upto(dw_part + j, pa, pb, n);
        store2_upto(dw_part + j, at::vec::fmadd(ga, xa * vr, pa), at::vec::fmadd(gb, xb * vr, pb), n);
      }
    }
  }
}

void check_inputs(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() >= 1, "npuspeed::rms_norm: input must have at least one dimension");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1), "npuspeed::rms_norm: weight must be 1-D of size ",
              x.size(-1), " (the last dimension of the input), got ", w.sizes());
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "npuspeed::rms_norm: CPU tensors expected");
}

std::tuple<at::Tensor, at::Tensor> rms_norm_cpu(const at::Tensor& input, const at::Tensor& weight, double eps) {
  check_inputs(input, weight);
  const at::Tensor x = input.contiguous();
  const int64_t h = x.size(-1);
  const int64_t rows = h == 0 ? 0 : x.numel() / h;
  auto acc_type = at::toOpMathType(x.scalar_type());
  const at::Tensor w = weight.to(acc_type).contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  auto rstd_sizes = x.sizes().vec();
  rstd_sizes.pop_back();
  at::Tensor rstd = at::empty(rstd_sizes, x.options().dtype(acc_type));
  if (rows == 0) {
    return {y, rstd};
  }
  NPUSPEED_DISPATCH_FLOATING(x.scalar_type(), "npuspeed::rms_norm", [&] {
    rms_norm_fwd_kernel<scalar_t>(x.const_data_ptr<scalar_t>(), w.const_data_ptr<acc_t<scalar_t>>(),
                                  y.mutable_data_ptr<scalar_t>(), rstd.mutable_data_ptr<acc_t<scalar_t>>(),
                                  rows, h, eps);
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cpu(const at::Tensor& grad, const at::Tensor& input,
                                                        const at::Tensor& weight, const at::Tensor& rstd,
                                                        bool weight_grad) {
  check_inputs(input, weight);
  TORCH_CHECK(grad.sizes() == input.sizes(), "npuspeed::rms_norm_backward: grad and input shapes differ");
  const at::Tensor x = input.contiguous();
  const at::Tensor g = grad.to(x.scalar_type()).contiguous();
  const int64_t h = x.size(-1);
  const int64_t rows = h == 0 ? 0 : x.numel() / h;
  auto acc_type = at::toOpMathType(x.scalar_type());
  const at::Tensor w = weight.to(acc_type).contiguous();
  const at::Tensor rs = rstd.to(acc_type).contiguous();
  at::Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (!weight_grad) {  // dw is then an empty placeholder
    at::Tensor dw = at::empty({0}, weight.options());
    if (rows > 0) {
      NPUSPEED_DISPATCH_FLOATING(x.scalar_type(), "npuspeed::rms_norm_backward", [&] {
        using A = acc_t<scalar_t>;
        const int64_t grain = row_grain(32768, h);
        at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
          rms_norm_bwd_rows<scalar_t>(g.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                                      w.const_data_ptr<A>(), rs.const_data_ptr<A>(),
                                      dx.mutable_data_ptr<scalar_t>(), nullptr, b, e, h);
        });
      });
    }
    return {dx, dw};
  }
  // One fp32 partial weight gradient per chunk of rows, summed afterwards.
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows));
  at::Tensor parts = at::zeros({chunks, h}, x.options().dtype(acc_type));
  if (rows > 0) {
    NPUSPEED_DISPATCH_FLOATING(x.scalar_type(), "npuspeed::rms_norm_backward", [&] {
      using A = acc_t<scalar_t>;
      at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
        for (int64_t c = cb; c < ce; ++c) {
          const int64_t b = rows * c / chunks, e = rows * (c + 1) / chunks;
          rms_norm_bwd_rows<scalar_t>(g.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                                      w.const_data_ptr<A>(), rs.const_data_ptr<A>(),
                                      dx.mutable_data_ptr<scalar_t>(), parts.mutable_data_ptr<A>() + c * h,
                                      b, e, h);
        }
      });
    });
  }
  return {dx, parts.sum(0).to(weight.scalar_type())};
}

}  // namespace
}  // namespace npuspeed::cpu

TORCH_LIBRARY_FRAGMENT(npuspeed, m) {
  m.def("rms_norm(Tensor input, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def(
      "rms_norm_backward(Tensor grad, Tensor input, Tensor weight, Tensor rstd, bool weight_grad) "
      "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(npuspeed, CPU, m) {
  m.impl("rms_norm", &npuspeed::cpu::rms_norm_cpu);
  m.impl("rms_norm_backward", &npuspeed::cpu::rms_norm_backward_cpu);
}
