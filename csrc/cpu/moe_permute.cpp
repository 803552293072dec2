// MoE token permute and unpermute (--use-fused-moe-token-permute-and-unpermute).
//
//   permute:   tokens [T, H], routing_map [T, E] (bool)  ->  permuted [N, H] (rows grouped by
//              expert, tokens ascending within an expert: Megatron's order), sorted_indices [N]
//              (row -> token), tokens_per_expert [E]
//   unpermute: out[t] = sum over the rows r of token t of permuted[r] * row_probs[r]
//
// Megatron's unfused path transposes the routing map and the probabilities into dense
// [E, T] copies, masks them, gathers, and scatter-adds back. Here permute is a counting sort
// over token blocks (per-block counts [blocks, E], never [T, E]) that copies each token row
// straight to its k destinations; unpermute builds the inverse (token -> its rows, ascending,
// so the sum runs in Megatron's order) and reduces each output row once in fp32, in parallel
// and without atomics. No Python loop over experts, no one-hot matrix.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <vector>

#include "vec_io.h"

namespace npuspeed::cpu {
namespace {

constexpr int64_t kMaxBlocks = 256;  // bounds the per-block count table at 256 x E

void check_cpu(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_permute_cpu(const at::Tensor& tokens_in,
                                                              const at::Tensor& routing_map_in) {
  const char* op = "npuspeed::moe_permute";
  check_cpu(tokens_in, op, "tokens");
  check_cpu(routing_map_in, op, "routing_map");
  TORCH_CHECK(tokens_in.dim() == 2, op, ": tokens must be [num_tokens, hidden], got ", tokens_in.sizes());
  TORCH_CHECK(routing_map_in.dim() == 2 && routing_map_in.size(0) == tokens_in.size(0), op,
              ": routing_map must be [num_tokens, num_experts] with num_tokens = ", tokens_in.size(0),
              ", got ", routing_map_in.sizes());
  const at::Tensor tokens = tokens_in.contiguous();
  const at::Tensor map = routing_map_in.scalar_type() == at::kBool ? routing_map_in.contiguous()
                                                                   : routing_map_in.ne(0).contiguous();
  const int64_t T = tokens.size(0), H = tokens.size(1), E = map.size(1);
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(kMaxBlocks, (T + 511) / 512));
  const int64_t per_block = T == 0 ? 0 : (T + blocks - 1) / blocks;
  const bool* m = map.const_data_ptr<bool>();

  // Pass 1: counts per (block, expert).
  std::vector<int64_t> counts(blocks * E, 0);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      int64_t* c = counts.data() + b * E;
      const int64_t t1 = std::min(T, (b + 1) * per_block);
      for (int64_t t = b * per_block; t < t1; ++t) {
        const bool* row = m + t * E;
        for (int64_t e = 0; e < E; ++e) c[e] += row[e];
      }
    }
  });
  // Exclusive prefix in (expert, block) order: block b's first row of expert e.
  at::Tensor tokens_per_expert = at::empty({E}, map.options().dtype(at::kLong));
  int64_t* tpe = tokens_per_expert.mutable_data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t start = total;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t n = counts[b * E + e];
      counts[b * E + e] = total;
      total += n;
    }
    tpe[e] = total - start;
  }

  at::Tensor permuted = at::empty({total, H}, tokens.options());
  at::Tensor sorted_indices = at::empty({total}, map.options().dtype(at::kLong));
  int64_t* idx = sorted_indices.mutable_data_ptr<int64_t>();
  const char* src = static_cast<const char*>(tokens.const_data_ptr());
  char* dst = static_cast<char*>(permuted.mutable_data_ptr());
  const size_t row_bytes = static_cast<size_t>(H) * tokens.element_size();
  // Pass 2: each block writes its tokens to their rows (disjoint ranges per block).
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      int64_t* cursor = counts.data() + b * E;
      const int64_t t1 = std::min(T, (b + 1) * per_block);
      for (int64_t t = b * per_block; t < t1; ++t) {
        const bool* row = m + t * E;
        for (int64_t e = 0; e < E; ++e) {
          if (!row[e]) continue;
          const int64_t r = cursor[e]++;
          idx[r] = t;
          if (row_bytes) std::memcpy(dst + r * row_bytes, src + t * row_bytes, row_bytes);
        }
      }
    }
  });
  return {permuted, sorted_indices, tokens_per_expert};
}

// token -> its rows in ascending row order, as CSR (offsets [T + 1], rows [N]).
void invert(const int64_t* idx, int64_t N, int64_t T, std::vector<int64_t>& offsets,
            std::vector<int64_t>& rows, const char* op) {
  offsets.assign(T + 1, 0);
  for (int64_t r = 0; r < N; ++r) {
    const int64_t t = idx[r];
    TORCH_CHECK(t >= 0 && t < T, op, ": sorted_indices[", r, "] = ", t, " is outside [0, ", T, ")");
    ++offsets[t + 1];
  }
  for (int64_t t = 0; t < T; ++t) offsets[t + 1] += offsets[t];
  rows.resize(N);
  std::vector<int64_t> cursor(offsets.begin(), offsets.end() - 1);
  for (int64_t r = 0; r < N; ++r) rows[cursor[idx[r]]++] = r;
}

template <typename T>
void unpermute_kernel(const T* x, const float* p, T* out, const std::vector<int64_t>& offsets,
                      const std::vector<int64_t>& rows, int64_t num_tokens, int64_t H) {
  using V = AVec<T>;
  using A = acc_t<T>;
  constexpr int64_t S = kStep<T>;
  const int64_t padded = (H + S - 1) / S * S;  // whole steps: the accumulator needs no tails
  const int64_t grain = row_grain(8192, H);
  at::parallel_for(0, num_tokens, grain, [&](int64_t t0, int64_t t1) {
    std::vector<A> acc(padded);
    for (int64_t t = t0; t < t1; ++t) {
      std::fill(acc.begin(), acc.end(), A(0));
      for (int64_t k = offsets[t]; k < offsets[t + 1]; ++k) {
        const int64_t r = rows[k];
        const T* xr = x + r * H;
        const V w(p ? static_cast<A>(p[r]) : A(1));
        V x0, x1;
        for (int64_t j = 0; j < H; j += S) {
          load2_upto(xr + j, x0, x1, std::min<int64_t>(S, H - j));
          if (p) {
            x0 = x0 * w;
            x1 = x1 * w;
          }
          A* a = acc.data() + j;
          (V::loadu(a) + x0).store(a);
          (V::loadu(a + V::size()) + x1).store(a + V::size());
        }
      }
      T* o = out + t * H;
      for (int64_t j = 0; j < H; j += S) {
        const A* a = acc.data() + j;
        store2_upto(o + j, V::loadu(a), V::loadu(a + V::size()), std::min<int64_t>(S, H - j));
      }
    }
  });
}

void check_rows(const at::Tensor& permuted, const at::Tensor& sorted_indices,
                const c10::optional<at::Tensor>& row_probs, const char* op) {
  check_cpu(permuted, op, "permuted");
  check_cpu(sorted_indices, op, "sorted_indices");
  TORCH_CHECK(permuted.dim() == 2, op, ": permuted must be [rows, hidden], got ", permuted.sizes());
  TORCH_CHECK(sorted_indices.dim() == 1 && sorted_indices.size(0) == permuted.size(0), op,
              ": sorted_indices must be [rows] with rows = ", permuted.size(0), ", got ", sorted_indices.sizes());
  if (row_probs.has_value()) {
    check_cpu(*row_probs, op, "row_probs");
    TORCH_CHECK(row_probs->dim() == 1 && row_probs->size(0) == permuted.size(0), op,
                ": row_probs must be [rows] with rows = ", permuted.size(0), ", got ", row_probs->sizes());
  }
}

at::Tensor moe_unpermute_cpu(const at::Tensor& permuted_in, const at::Tensor& sorted_indices_in,
                             const c10::optional<at::Tensor>& row_probs_in, int64_t num_tokens) {
  const char* op = "npuspeed::moe_unpermute";
  check_rows(permuted_in, sorted_indices_in, row_probs_in, op);
  TORCH_CHECK(num_tokens >= 0, op, ": num_tokens must be >= 0");
  const at::Tensor x = permuted_in.contiguous();
  const at::Tensor idx = sorted_indices_in.to(at::kLong).contiguous();
  const int64_t N = x.size(0), H = x.size(1);
  at::Tensor out = at::empty({num_tokens, H}, x.options());
  std::vector<int64_t> offsets, rows;
  invert(idx.const_data_ptr<int64_t>(), N, num_tokens, offsets, rows, op);
  at::Tensor probs;
  if (row_probs_in.has_value()) probs = row_probs_in->to(at::kFloat).contiguous();
  NPUSPEED_DISPATCH_FLOATING(x.scalar_type(), "npuspeed::moe_unpermute", [&] {
    unpermute_kernel<scalar_t>(x.const_data_ptr<scalar_t>(),
                                      probs.defined() ? probs.const_data_ptr<float>() : nullptr,
                                      out.mutable_data_ptr<scalar_t>(), offsets, rows, num_tokens, H);
  });
  return out;
}

// d permuted[r] = grad[t(r)] * p[r];  d p[r] = <grad[t(r)], permuted[r]> (fp32).
template <typename T>
void unpermute_bwd_kernel(const T* g, const T* x, const int64_t* idx, const float* p, T* dx, float* dp,
                          int64_t N, int64_t H) {
  using V = AVec<T>;
  using A = acc_t<T>;
  constexpr int64_t S = kStep<T>;
  const int64_t grain = row_grain(8192, H);
  at::parallel_for(0, N, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* gr = g + idx[r] * H;
      const V w(p ? static_cast<A>(p[r]) : A(1));
      V dot(A(0));
      V g0, g1, x0, x1;
      for (int64_t j = 0; j < H; j += S) {
        const int64_t n = std::min<int64_t>(S, H - j);
        load2_upto(gr + j, g0, g1, n);
        if (dp) {
          load2_upto(x + r * H + j, x0, x1, n);
          dot = dot + g0 * x0 + g1 * x1;
        }
        store2_upto(dx + r * H + j, p ? g0 * w : g0, p ? g1 * w : g1, n);
      }
      if (dp) dp[r] = static_cast<float>(hsum<A>(dot));
    }
  });
}

std::tuple<at::Tensor, at::Tensor> moe_unpermute_backward_cpu(const at::Tensor& grad_in,
                                                              const at::Tensor& sorted_indices_in,
                                                              const c10::optional<at::Tensor>& row_probs_in,
                                                              const c10::optional<at::Tensor>& permuted_in,
                                                              bool probs_grad) {
  const char* op = "npuspeed::moe_unpermute_backward";
  check_cpu(grad_in, op, "grad");
  check_cpu(sorted_indices_in, op, "sorted_indices");
  TORCH_CHECK(grad_in.dim() == 2, op, ": grad must be [num_tokens, hidden], got ", grad_in.sizes());
  TORCH_CHECK(!probs_grad || (row_probs_in.has_value() && permuted_in.has_value()), op,
              ": probs_grad needs row_probs and permuted");
  const int64_t N = sorted_indices_in.numel(), H = grad_in.size(1), T = grad_in.size(0);
  if (probs_grad) check_rows(*permuted_in, sorted_indices_in, row_probs_in, op);
  const at::Tensor g = grad_in.contiguous();
  const at::Tensor x = probs_grad ? permuted_in->to(g.scalar_type()).contiguous() : at::Tensor();
  TORCH_CHECK(!probs_grad || x.size(1) == H, op, ": permuted has ", x.size(1), " columns, grad ", H);
  const at::Tensor idx = sorted_indices_in.to(at::kLong).contiguous();
  const int64_t* ip = idx.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < N; ++r) {
    TORCH_CHECK(ip[r] >= 0 && ip[r] < T, op, ": sorted_indices[", r, "] = ", ip[r], " is outside [0, ", T, ")");
  }
  at::Tensor dx = at::empty({N, H}, g.options());
  at::Tensor probs, dp;
  if (row_probs_in.has_value()) probs = row_probs_in->to(at::kFloat).contiguous();
  if (probs_grad) dp = at::empty({N}, g.options().dtype(at::kFloat));
  NPUSPEED_DISPATCH_FLOATING(g.scalar_type(), "npuspeed::moe_unpermute_backward", [&] {
    unpermute_bwd_kernel<scalar_t>(g.const_data_ptr<scalar_t>(), x.defined() ? x.const_data_ptr<scalar_t>() : nullptr,
                                   ip, probs.defined() ? probs.const_data_ptr<float>() : nullptr,
                                   dx.mutable_data_ptr<scalar_t>(),
                                   dp.defined() ? dp.mutable_data_ptr<float>() : nullptr, N, H);
  });
  if (!dp.defined()) {
    dp = at::empty({0}, g.options().dtype(at::kFloat));
  } else if (row_probs_in->scalar_type() != at::kFloat) {
    dp = dp.to(row_probs_in->scalar_type());
  }
  return {dx, dp};
}

}  // namespace
}  // namespace npuspeed::cpu

TORCH_LIBRARY_FRAGMENT(npuspeed, m) {
  m.def("moe_permute(Tensor tokens, Tensor routing_map) -> (Tensor, Tensor, Tensor)");
  m.def("moe_unpermute(Tensor permuted, Tensor sorted_indices, Tensor? row_probs, int num_tokens) -> Tensor");
  m.def("moe_unpermute_backward(Tensor grad, Tensor sorted_indices, Tensor? row_probs, Tensor? permuted, "
        "bool probs_grad) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(npuspeed, CPU, m) {
  m.impl("moe_permute", &npuspeed::cpu::moe_permute_cpu);
  m.impl("moe_unpermute", &npuspeed::cpu::moe_unpermute_cpu);
  m.impl("moe_unpermute_backward", &npuspeed::cpu::moe_unpermute_backward_cpu);
}
