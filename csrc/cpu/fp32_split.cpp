// --reuse-fp32-param's split and merge in one pass each (see
// npuspeed/features/reuse_fp32_param/codec.py for the encoding and its reference).
//
//   split: residual[i] = low 16 bits of master[i]; return the indices of exact ties
//          (low == 0x8000) whose round-to-nearest-even went up, and of NaNs.
//   merge: out[i] = ((bf16[i] - carry) << 16) | residual[i], carry = low > 0x8000, or the
//          index is a listed tie; listed NaN indices get their stored bit patterns.
//
// The eager reference makes several full-size int32 temporaries; these loops read and write
// each element once, in parallel.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace npuspeed::cpu {
namespace {

constexpr uint32_t kTie = 0x8000u;

inline bool is_nan_bits(uint32_t w) { return (w & 0x7F800000u) == 0x7F800000u && (w & 0x007FFFFFu); }

void check_flat(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == dtype, name, " has dtype ", t.scalar_type(), ", expected ", dtype);
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// Returns [tie_up_indices, nan_indices] (int64), both ascending.
std::vector<at::Tensor> fp32_split(const at::Tensor& master, at::Tensor& residual) {
  check_flat(master, at::kFloat, "master");
  check_flat(residual, at::kShort, "residual");
  const int64_t n = master.numel();
  TORCH_CHECK(residual.numel() == n, "residual has ", residual.numel(), " elements, master ", n);
  const uint32_t* in = reinterpret_cast<const uint32_t*>(master.data_ptr<float>());
  uint16_t* low = reinterpret_cast<uint16_t*>(residual.data_ptr<int16_t>());
  // Blocks in parallel, each collecting its own exceptions (concatenated in block order);
  // inside a block, a branch-free pass per sub-block and a second look only where one is special.
  constexpr int64_t kBlock = 1 << 16, kSub = 1 << 10;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<std::vector<int64_t>> ties(blocks), nans(blocks);
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const int64_t block_end = std::min(n, (b + 1) * kBlock);
      for (int64_t start = b * kBlock; start < block_end; start += kSub) {
        const int64_t end = std::min(block_end, start + kSub);
        uint32_t special = 0;  // a branch-free (vectorised) pass over the sub-block first
        for (int64_t i = start; i < end; ++i) {
          const uint32_t w = in[i];
          low[i] = static_cast<uint16_t>(w & 0xFFFFu);
          special |= ((w & 0xFFFFu) == kTie) | ((w & 0x7F800000u) == 0x7F800000u);
        }
        if (special == 0) continue;  // rare: look again at this sub-block only
        for (int64_t i = start; i < end; ++i) {
          const uint32_t w = in[i];
          if (is_nan_bits(w)) {
            nans[b].push_back(i);
          } else if ((w & 0xFFFFu) == kTie && ((w >> 16) & 1u)) {
            ties[b].push_back(i);
          }
        }
      }
    }
  });
  auto concat = [](const std::vector<std::vector<int64_t>>& parts) {
    int64_t total = 0;
    for (const auto& p : parts) total += static_cast<int64_t>(p.size());
    at::Tensor t = at::empty({total}, at::kLong);
    int64_t* out = t.data_ptr<int64_t>();
    for (const auto& p : parts) {
      if (!p.empty()) std::memcpy(out, p.data(), p.size() * sizeof(int64_t));
      out += p.size();
    }
    return t;
  };
  return {concat(ties), concat(nans)};
}

void fp32_merge(const at::Tensor& bf16, const at::Tensor& residual, const at::Tensor& tie_up,
                const at::Tensor& nan_index, const at::Tensor& nan_bits, at::Tensor& out) {
  check_flat(bf16, at::kBFloat16, "bf16");
  check_flat(residual, at::kShort, "residual");
  check_flat(out, at::kFloat, "out");
  const int64_t n = out.numel();
  TORCH_CHECK(bf16.numel() == n && residual.numel() == n, "bf16, residual and out sizes differ");
  const uint16_t* high = reinterpret_cast<const uint16_t*>(bf16.data_ptr());
  const uint16_t* low = reinterpret_cast<const uint16_t*>(residual.data_ptr<int16_t>());
  uint32_t* words = reinterpret_cast<uint32_t*>(out.data_ptr<float>());
  at::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint32_t l = low[i];
      const uint32_t carry = l > kTie ? 1u : 0u;
      words[i] = ((static_cast<uint32_t>(high[i]) - carry) << 16) | l;
    }
  });
  const int64_t* ties = tie_up.data_ptr<int64_t>();
  for (int64_t k = 0; k < tie_up.numel(); ++k) {
    const int64_t i = ties[k];
    words[i] = ((static_cast<uint32_t>(high[i]) - 1u) << 16) | low[i];
  }
  const int64_t* nidx = nan_index.data_ptr<int64_t>();
  const int32_t* nbits = nan_bits.data_ptr<int32_t>();
  for (int64_t k = 0; k < nan_index.numel(); ++k) {
    words[nidx[k]] = static_cast<uint32_t>(nbits[k]);
  }
}

}  // namespace
}  // namespace npuspeed::cpu

TORCH_LIBRARY_FRAGMENT(npuspeed, m) {
  m.def("fp32_split(Tensor master, Tensor(a!) residual) -> Tensor[]");
  m.def("fp32_merge(Tensor bf16, Tensor residual, Tensor tie_up, Tensor nan_index, Tensor nan_bits, "
        "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(npuspeed, CPU, m) {
  m.impl("fp32_split", &npuspeed::cpu::fp32_split);
  m.impl("fp32_merge", &npuspeed::cpu::fp32_merge);
}
