// Values computed once per device and then read by every call: a device's properties, a kernel's
// shared-memory opt-in and occupancy never change while the process runs, so the CUDA host code
// asks the runtime once per device instead of once per call (docs/notes/2026-12-02-library-host-cost.md).
//
// Thread-safe: the first thread to ask for a device runs the loader, the others wait for it and
// then all read the stored value; afterwards a lookup is one acquire load (std::call_once's fast
// path). Devices are independent (the autograd engine runs one device per thread). No CUDA here,
// so the caching logic is tested without a GPU (tests/cpp/test_per_device.cpp).
#pragma once

#include <mutex>

namespace dualkv::detail {

// Device indices a per-device cache holds (query_device refuses larger ones with a typed error).
constexpr int kMaxCachedDevices = 64;

template <typename Value>
class PerDevice {
 public:
  // The value of `device` (0 <= device < kMaxCachedDevices: the caller checks), from load(device)
  // the first time any thread asks. A load's failure is a value like any other (it is cached too):
  // give the loader only what cannot change while the process runs.
  template <typename Load>
  const Value& get(int device, Load&& load) {
    Slot& slot = slots_[device];
    std::call_once(slot.once, [&] { slot.value = load(device); });
    return slot.value;
  }

 private:
  struct Slot {
    std::once_flag once;
    Value value{};
  };
  Slot slots_[kMaxCachedDevices];
};

}  // namespace dualkv::detail
