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

// Each block is served with a 64-byte header in front of the caller's bytes, holding the
// size and the wrapped allocator's context and deleter. The pointer handed out is both the
// data and the context (torch's raw_allocate / raw_deallocate and copy-on-write require
// that), and freeing needs no lookup table or lock. 64 bytes keep the default alignment.
constexpr size_t kHeader = 64;

struct Header {
  void* inner_context;
  c10::DeleterFnPtr inner_deleter;
  int64_t nbytes;
};
static_assert(sizeof(Header) <= kHeader, "header must fit in its slot");

void raise_peak(int64_t now) {
  int64_t peak = g_peak.load();
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
}

void tracked_delete(void* ptr) {
  if (ptr == nullptr) {
    return;
  }
  auto* header = reinterpret_cast<Header*>(static_cast<char*>(ptr) - kHeader);
  Header copy = *header;
  g_current.fetch_sub(copy.nbytes);
  if (copy.inner_deleter != nullptr) {
    copy.inner_deleter(copy.inner_context);
  }
}

class TrackingAllocator final : public c10::Allocator {
 public:
  explicit TrackingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes == 0) {
      return inner_->allocate(0);
    }
    c10::DataPtr inner = inner_->allocate(nbytes + kHeader);
    char* base = static_cast<char*>(inner.get());
    c10::Device device = inner.device();
    auto* header = reinterpret_cast<Header*>(base);
    header->inner_deleter = inner.get_deleter();
    header->nbytes = static_cast<int64_t>(nbytes);
    header->inner_context = inner.release_context();
    int64_t now = g_current.fetch_add(header->nbytes) + header->nbytes;
    g_num_allocs.fetch_add(1);
    raise_peak(now);
    void* data = base + kHeader;
    return c10::DataPtr(data, data, &tracked_delete, device);
  }

  c10::DeleterFnPtr raw_deleter() const override { return &tracked_delete; }

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
