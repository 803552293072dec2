// A CPU allocator that counts live bytes, so CPU runs report real peak memory.
//
// It wraps the allocator that was current when tracking was enabled: each allocation is
// served by the wrapped allocator and carries a small context recording its size; the
// deleter subtracts it. Storages resized in place (untyped_storage().resize_) reallocate
// through the allocator that created them, so their frees and regrowths are counted too.
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>

namespace npuspeed {
namespace {

std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_num_allocs{0};

struct TrackedContext {
  void* inner_context;
  c10::DeleterFnPtr inner_deleter;
  int64_t nbytes;
};

void raise_peak(int64_t now) {
  int64_t peak = g_peak.load();
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
}

void tracked_delete(void* ptr) {
  auto* ctx = static_cast<TrackedContext*>(ptr);
  g_current.fetch_sub(ctx->nbytes);
  if (ctx->inner_deleter != nullptr) {
    ctx->inner_deleter(ctx->inner_context);
  }
  delete ctx;
}

class TrackingAllocator final : public c10::Allocator {
 public:
  explicit TrackingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t nbytes) override {
    c10::DataPtr inner = inner_->allocate(nbytes);
    if (nbytes == 0 || inner.get() == nullptr) {
      return inner;
    }
    auto* ctx = new TrackedContext{nullptr, inner.get_deleter(), static_cast<int64_t>(nbytes)};
    void* data = inner.get();
    c10::Device device = inner.device();
    ctx->inner_context = inner.release_context();
    int64_t now = g_current.fetch_add(ctx->nbytes) + ctx->nbytes;
    g_num_allocs.fetch_add(1);
    raise_peak(now);
    return c10::DataPtr(data, ctx, &tracked_delete, device);
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

 private:
  c10::Allocator* inner_;
};

bool g_enabled = false;

bool enable() {
  if (!g_enabled) {
    static TrackingAllocator allocator(c10::GetCPUAllocator());
    // Priority above the default so later default registrations do not displace it.
    c10::SetCPUAllocator(&allocator, /*priority=*/10);
    g_enabled = c10::GetCPUAllocator() == &allocator;
  }
  return g_enabled;
}

std::vector<int64_t> stats() {
  return {g_current.load(), g_peak.load(), g_num_allocs.load(), g_enabled ? 1 : 0};
}

void reset_peak() { g_peak.store(g_current.load()); }

}  // namespace
}  // namespace npuspeed

TORCH_LIBRARY_FRAGMENT(npuspeed, m) {
  m.def("memory_tracker_enable() -> bool", &npuspeed::enable);
  m.def("memory_tracker_stats() -> int[]", &npuspeed::stats);
  m.def("memory_tracker_reset_peak() -> ()", &npuspeed::reset_peak);
}
