// Loads and stores of fp32/fp64/bf16/fp16 rows as pairs of accumulator vectors.
//
// The kernels compute in the accumulation type (fp32 for bf16/fp16/fp32, fp64 for fp64).
// One step covers 2 * Vectorized<acc>::size() elements: exactly one Vectorized<bf16>, so a
// bf16 row is converted once per load and once per store. Tails go through a zero-filled
// buffer, so a reduction over a partial step adds only zeros.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <type_traits>

namespace npuspeed::cpu {

template <typename T>
using acc_t = at::opmath_type<T>;
template <typename T>
using AVec = at::vec::Vectorized<acc_t<T>>;

template <typename T>
constexpr int64_t kStep = 2 * AVec<T>::size();

// Rows per at::parallel_for task: about `elements` elements of rows `width` long, at least one
// row (below that a task costs more to hand out than to run).
inline int64_t row_grain(int64_t elements, int64_t width) {
  return std::max<int64_t>(1, elements / std::max<int64_t>(width, 1));
}

// Full step: `p` holds at least kStep<T> elements.
template <typename T>
inline void load2(const T* p, AVec<T>& a, AVec<T>& b) {
  if constexpr (std::is_same_v<T, acc_t<T>>) {
    a = AVec<T>::loadu(p);
    b = AVec<T>::loadu(p + AVec<T>::size());
  } else {
    std::tie(a, b) = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p));
  }
}

template <typename T>
inline void store2(T* p, const AVec<T>& a, const AVec<T>& b) {
  if constexpr (std::is_same_v<T, acc_t<T>>) {
    a.store(p);
    b.store(p + AVec<T>::size());
  } else {
    at::vec::convert_from_float<T>(a, b).store(p);
  }
}

// Partial step of `count` < kStep<T> elements; the rest of the vectors is zero.
template <typename T>
inline void load2(const T* p, AVec<T>& a, AVec<T>& b, int64_t count) {
  T buf[kStep<T>];
  std::fill(buf, buf + kStep<T>, T(0));
  std::memcpy(buf, p, count * sizeof(T));
  load2(buf, a, b);
}

template <typename T>
inline void store2(T* p, const AVec<T>& a, const AVec<T>& b, int64_t count) {
  T buf[kStep<T>];
  store2(buf, a, b);
  std::memcpy(p, buf, count * sizeof(T));
}

template <typename A>
inline A hsum(const at::vec::Vectorized<A>& v) {
  return at::vec::vec_reduce_all<A>([](auto& x, auto& y) { return x + y; }, v);
}

// The dtypes every op accepts, with a clear error for the rest.
#define NPUSPEED_DISPATCH_FLOATING(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, TYPE, NAME, __VA_ARGS__)

// A step of n <= kStep<T> elements: the full-width path when n is a whole step.
template <typename T>
inline void load2_upto(const T* p, AVec<T>& a, AVec<T>& b, int64_t n) {
  if (n == kStep<T>) {
    load2(p, a, b);
  } else {
    load2(p, a, b, n);
  }
}

template <typename T>
inline void store2_upto(T* p, const AVec<T>& a, const AVec<T>& b, int64_t n) {
  if (n == kStep<T>) {
    store2(p, a, b);
  } else {
    store2(p, a, b, n);
  }
}

}  // namespace npuspeed::cpu
