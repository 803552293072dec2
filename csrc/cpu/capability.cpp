// The SIMD level this library was compiled for (see npuspeed/ops/build_flags.py), so that
// Python can refuse a library built for instructions the running CPU lacks.
#include <torch/library.h>

#include <string>

namespace npuspeed {
namespace {

std::string cpu_capability() {
#if defined(CPU_CAPABILITY_AVX512)
  return "avx512";
#elif defined(CPU_CAPABILITY_AVX2)
  return "avx2";
#else
  return "default";
#endif
}

}  // namespace
}  // namespace npuspeed

TORCH_LIBRARY_FRAGMENT(npuspeed, m) {
  m.def("cpu_capability() -> str", &npuspeed::cpu_capability);
}
