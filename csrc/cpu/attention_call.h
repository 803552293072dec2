// What one flash attention call needs besides its tensors, shared by the bf16 and fp32 kernels:
// the rows each query may see (attention_rows.h) and the dropout generator (philox.h).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

#include "attention_rows.h"
#include "philox.h"

namespace npuspeed::cpu::attention {

struct Call {
  Rows rows;
  philox::Dropout dropout;
};

inline Call make_call(const at::Tensor& q, const at::Tensor& k, bool causal, double dropout_p, int64_t seed,
                      int64_t offset, int64_t q_pos0, int64_t k_pos0, int64_t head0,
                      const std::optional<at::Tensor>& key_lo, const std::optional<at::Tensor>& key_hi) {
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "npuspeed flash attention: dropout_p must be in [0, 1)");
  return {make_rows(causal, q_pos0, k_pos0, q.size(1), q.size(0), k.size(0), key_lo, key_hi),
          philox::Dropout(dropout_p, seed, offset, q_pos0, k_pos0, head0)};
}

}  // namespace npuspeed::cpu::attention
