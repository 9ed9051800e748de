// A counting CPU allocator: torch.cuda.max_memory_allocated() for CPU tensors.
//
// torch keeps no CPU memory statistics. This wraps the current CPU allocator and counts the bytes
// of every block it hands out until the block is freed, on any thread. Any thread matters: gloo
// frees collective buffers on its worker threads, which the profiler's memory events never see.
// Loaded by measure.py through torch.utils.cpp_extension (needs g++ and ninja).

#include <c10/core/CPUAllocator.h>
#include <torch/extension.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>

namespace {

// The allocator we count for, restored by uninstall() but kept: storages allocated while we were
// installed keep allocating through us when resized (FSDP's storage.resize_).
at::Allocator* wrapped = nullptr;
at::DeleterFnPtr wrapped_free = nullptr;  // its raw deleter, which frees our blocks too
bool installed = false;

struct Counts {
  std::mutex mutex;
  std::unordered_map<void*, size_t> block_sizes;  // blocks handed out and not yet freed
  int64_t live = 0;
  int64_t peak = 0;
};

// Never destroyed: at interpreter exit tensors are still freed after static destructors have run.
Counts& counts() {
  static auto* instance = new Counts();
  return *instance;
}

void counted_free(void* ptr) {
  if (ptr == nullptr) {
    return;
  }
  {
    Counts& c = counts();
    std::lock_guard<std::mutex> guard(c.mutex);
    auto it = c.block_sizes.find(ptr);
    if (it != c.block_sizes.end()) {
      c.live -= static_cast<int64_t>(it->second);
      c.block_sizes.erase(it);
    }
  }
  wrapped_free(ptr);
}

struct CountingAllocator final : at::Allocator {
  at::DataPtr allocate(size_t nbytes) override {
    void* ptr = wrapped->raw_allocate(nbytes);
    if (ptr != nullptr) {
      Counts& c = counts();
      std::lock_guard<std::mutex> guard(c.mutex);
      c.block_sizes[ptr] = nbytes;
      c.live += static_cast<int64_t>(nbytes);
      c.peak = std::max(c.peak, c.live);
    }
    return {ptr, ptr, &counted_free, at::Device(at::DeviceType::CPU)};
  }
  at::DeleterFnPtr raw_deleter() const override { return &counted_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingAllocator counting;
constexpr uint8_t kPriority = 100;  // above the default CPU allocator's registration

void install() {
  TORCH_CHECK(!installed, "the counting CPU allocator is already installed");
  if (wrapped == nullptr) {
    wrapped = c10::GetCPUAllocator();
    wrapped_free = wrapped->raw_deleter();
    TORCH_CHECK(wrapped_free != nullptr, "the CPU allocator has no raw deleter to wrap");
  }
  c10::SetCPUAllocator(&counting, kPriority);
  installed = true;
}

// Blocks allocated while installed stay counted until freed; new blocks come from the wrapped one.
void uninstall() {
  TORCH_CHECK(installed, "the counting CPU allocator is not installed");
  c10::SetCPUAllocator(wrapped, kPriority);
  installed = false;
}

int64_t live_bytes() {
  std::lock_guard<std::mutex> guard(counts().mutex);
  return counts().live;
}

int64_t peak_bytes() {
  std::lock_guard<std::mutex> guard(counts().mutex);
  return counts().peak;
}

void reset_peak() {
  std::lock_guard<std::mutex> guard(counts().mutex);
  counts().peak = counts().live;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install, "count CPU allocations from now on");
  m.def("uninstall", &uninstall, "stop counting new allocations");
  m.def("live_bytes", &live_bytes, "bytes of counted blocks not yet freed");
  m.def("peak_bytes", &peak_bytes, "most live bytes since the last reset_peak()");
  m.def("reset_peak", &reset_peak, "set the peak to the live bytes now");
}
