// The SIMD level this library was compiled for (see npuspeed/ops/build_flags.py), so that
// Python can refuse a library built for instructions the running CPU lacks.
#include <torch/library.h>

#include <string>
#include <vector>

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

// Which source sets this library holds: "cpu" (portable) always, "x86" (intrinsics) where built.
std::vector<std::string> kernel_sets() {
#if defined(NPUSPEED_NO_X86)
  return {"cpu"};
#else
  return {"cpu", "x86"};
#endif
}

}  // namespace
}  // namespace npuspeed

TORCH_LIBRARY_FRAGMENT(npuspeed, m) {
  m.def("cpu_capability() -> str", &npuspeed::cpu_capability);
  m.def("kernel_sets() -> str[]", &npuspeed::kernel_sets);
}
