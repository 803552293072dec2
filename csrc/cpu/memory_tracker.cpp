// A CPU allocator that counts live bytes, so CPU runs report real peak memory, and caches
// large freed blocks, as a device's caching allocator does.
//
// It wraps the allocator that was current when tracking was enabled: each allocation is
// served by the wrapped allocator and carries a small context recording its size; the
// deleter subtracts it. Storages resized in place (untyped_storage().resize_) reallocate
// through the allocator that created them, so their frees and regrowths are counted too.
//
// Why the cache: torch's CPU allocator has none, and glibc serves large blocks with fresh
// mmaps (or, aligned, from untouched heap), so a storage freed and grown again between steps
// (every activation; the recompute's resize_(0); --reuse-fp32-param's masters) faults all
// its pages in again, measured at 10-20% of a step on the example. Freed blocks of at least
// kCacheMin bytes are kept (up to a cap) and handed out again to a request of the same size
// or up to 1/8 smaller. Live and peak bytes count requested bytes, not cached ones (like
// memory_allocated on CUDA); reserved bytes are those of every block not yet handed back
// (live blocks at their capacity, plus the cache), and empty_cache() hands the cache back.
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>

namespace npuspeed {
namespace {

std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
// Reserved: bytes of every block not handed back to the wrapped allocator (live or cached).
std::atomic<int64_t> g_reserved{0};
std::atomic<int64_t> g_peak_reserved{0};
std::atomic<int64_t> g_num_allocs{0};

// Each block is served with a 64-byte header in front of the caller's bytes, holding the
// size and the wrapped allocator's context and deleter. The pointer handed out is both the
// data and the context (torch's raw_allocate / raw_deallocate and copy-on-write require
// that), and freeing needs no lookup table or lock. 64 bytes keep the default alignment.
constexpr size_t kHeader = 64;

struct Header {
  void* inner_context;
  c10::DeleterFnPtr inner_deleter;
  int64_t nbytes;    // requested by the caller (what the statistics count)
  int64_t capacity;  // usable bytes after the header (>= nbytes when served from the cache)
};
static_assert(sizeof(Header) <= kHeader, "header must fit in its slot");

void raise(std::atomic<int64_t>& peak_counter, int64_t now) {
  int64_t peak = peak_counter.load();
  while (now > peak && !peak_counter.compare_exchange_weak(peak, now)) {
  }
}

// The cache of freed blocks, by capacity. Off until cache_limit() is set above zero.
constexpr int64_t kCacheMin = 1 << 20;
struct Cache {
  std::mutex mutex;
  std::multimap<int64_t, Header*> blocks;  // by capacity
  int64_t bytes = 0;
};
// Never destroyed: tensors are still freed during interpreter shutdown.
Cache& cache() {
  static Cache* instance = new Cache();
  return *instance;
}
std::atomic<int64_t> g_cache_limit{0};
std::atomic<int64_t> g_cache_hits{0};

void release_block(Header* header) {
  Header copy = *header;
  g_reserved.fetch_sub(copy.capacity);
  if (copy.inner_deleter != nullptr) {
    copy.inner_deleter(copy.inner_context);
  }
}

// A cached block able to hold nbytes without wasting more than 1/8 of it, or nullptr.
Header* take_cached(int64_t nbytes) {
  if (nbytes < kCacheMin || g_cache_limit.load() == 0) {
    return nullptr;
  }
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  auto it = c.blocks.lower_bound(nbytes);
  if (it == c.blocks.end() || it->first - it->first / 8 > nbytes) {
    return nullptr;
  }
  Header* header = it->second;
  c.bytes -= it->first;
  c.blocks.erase(it);
  return header;
}

bool keep_cached(Header* header) {
  if (header->capacity < kCacheMin || g_cache_limit.load() == 0) {
    return false;
  }
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  if (c.bytes + header->capacity > g_cache_limit.load()) {
    return false;
  }
  c.blocks.emplace(header->capacity, header);
  c.bytes += header->capacity;
  return true;
}

void tracked_delete(void* ptr) {
  if (ptr == nullptr) {
    return;
  }
  auto* header = reinterpret_cast<Header*>(static_cast<char*>(ptr) - kHeader);
  g_current.fetch_sub(header->nbytes);
  if (!keep_cached(header)) {
    release_block(header);
  }
}

class TrackingAllocator final : public c10::Allocator {
 public:
  explicit TrackingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes == 0) {
      return inner_->allocate(0);
    }
    Header* header = take_cached(static_cast<int64_t>(nbytes));
    c10::Device device(c10::DeviceType::CPU);
    if (header != nullptr) {
      g_cache_hits.fetch_add(1);
    } else {
      c10::DataPtr inner = inner_->allocate(nbytes + kHeader);
      device = inner.device();
      header = reinterpret_cast<Header*>(inner.get());
      header->inner_deleter = inner.get_deleter();
      header->inner_context = inner.release_context();
      header->capacity = static_cast<int64_t>(nbytes);
      raise(g_peak_reserved, g_reserved.fetch_add(header->capacity) + header->capacity);
    }
    header->nbytes = static_cast<int64_t>(nbytes);
    int64_t now = g_current.fetch_add(header->nbytes) + header->nbytes;
    g_num_allocs.fetch_add(1);
    raise(g_peak, now);
    void* data = reinterpret_cast<char*>(header) + kHeader;
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
  int64_t cached = 0;
  {
    std::lock_guard<std::mutex> lock(cache().mutex);
    cached = cache().bytes;
  }
  return {g_current.load(), g_peak.load(), g_num_allocs.load(), g_enabled ? 1 : 0,
          cached, g_cache_hits.load(), g_cache_limit.load(), g_reserved.load(), g_peak_reserved.load()};
}

void set_cache_limit(int64_t bytes) { g_cache_limit.store(bytes < 0 ? 0 : bytes); }

void empty_cache() {
  std::multimap<int64_t, Header*> blocks;
  {
    std::lock_guard<std::mutex> lock(cache().mutex);
    blocks.swap(cache().blocks);
    cache().bytes = 0;
  }
  for (auto& entry : blocks) {
    release_block(entry.second);
  }
}

void reset_peak() {
  g_peak.store(g_current.load());
  g_peak_reserved.store(g_reserved.load());
}

// Put back peaks read before a measurement that reset them (a kernel choice timed once per
// shape), so the run's own peak statistics do not lose what came before it.
void restore_peak(int64_t peak, int64_t peak_reserved) {
  g_peak.store(std::max(peak, g_current.load()));
  g_peak_reserved.store(std::max(peak_reserved, g_reserved.load()));
}

}  // namespace
}  // namespace npuspeed

TORCH_LIBRARY_FRAGMENT(npuspeed, m) {
  m.def("memory_tracker_enable() -> bool", &npuspeed::enable);
  m.def("memory_tracker_stats() -> int[]", &npuspeed::stats);
  m.def("memory_tracker_reset_peak() -> ()", &npuspeed::reset_peak);
  m.def("memory_tracker_restore_peak(int peak, int peak_reserved) -> ()", &npuspeed::restore_peak);
  m.def("memory_tracker_set_cache_limit(int bytes) -> ()", &npuspeed::set_cache_limit);
  m.def("memory_tracker_empty_cache() -> ()", &npuspeed::empty_cache);
}
