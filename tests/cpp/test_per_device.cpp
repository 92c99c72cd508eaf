// The per-device cache the CUDA host code keeps a device's properties and a kernel's shared-memory
// opt-in in (src/per_device.h), with a counting loader in place of the CUDA runtime: each device
// is loaded exactly once however many threads ask at once, devices keep their own values, and a
// failure is kept like a value (the runtime's answers do not change while the process runs).
#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "per_device.h"

using dualkv::detail::kMaxCachedDevices;
using dualkv::detail::PerDevice;

namespace {

// Stands in for a device query: 1000 + device, counting its calls per device.
struct CountingLoader {
  std::atomic<int>* calls;
  int operator()(int device) const {
    calls[device].fetch_add(1);
    std::this_thread::yield();  // widen the window in which another thread could also load
    return 1000 + device;
  }
};

TEST(PerDevice, LoadsEachDeviceOnceAcrossThreads) {
  static PerDevice<int> cache;
  std::atomic<int> calls[kMaxCachedDevices] = {};
  constexpr int kThreads = 8, kDevices = 4, kRounds = 2000;
  std::atomic<bool> go{false};
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      while (!go.load()) std::this_thread::yield();
      for (int r = 0; r < kRounds; ++r) {
        const int device = (t + r) % kDevices;  // every thread asks for every device, in turns
        if (cache.get(device, CountingLoader{calls}) != 1000 + device) wrong.fetch_add(1);
      }
    });
  go.store(true);
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0);
  for (int d = 0; d < kDevices; ++d) EXPECT_EQ(calls[d].load(), 1) << "device " << d;
  for (int d = kDevices; d < kMaxCachedDevices; ++d) EXPECT_EQ(calls[d].load(), 0) << "device " << d;
}

TEST(PerDevice, DevicesAreIndependentAndTheLastIndexWorks) {
  PerDevice<int> cache;
  std::atomic<int> calls[kMaxCachedDevices] = {};
  EXPECT_EQ(cache.get(kMaxCachedDevices - 1, CountingLoader{calls}), 1000 + kMaxCachedDevices - 1);
  EXPECT_EQ(cache.get(0, CountingLoader{calls}), 1000);
  EXPECT_EQ(cache.get(kMaxCachedDevices - 1, CountingLoader{calls}), 1000 + kMaxCachedDevices - 1);
  EXPECT_EQ(calls[0].load(), 1);
  EXPECT_EQ(calls[kMaxCachedDevices - 1].load(), 1);
  EXPECT_EQ(calls[1].load(), 0);
}

// A failed query (an error code, a message) is cached and handed out again without a new load: the
// runtime's answer for a device is the same on every call, and the dispatcher reports it each time.
TEST(PerDevice, KeepsAFailureLikeAValue) {
  struct Answer {
    int status = -1;
    std::string error;
  };
  PerDevice<Answer> cache;
  int loads = 0;
  const auto unsupported = [&loads](int device) {
    ++loads;
    return Answer{1, "device " + std::to_string(device) + " is sm_75"};
  };
  for (int i = 0; i < 3; ++i) {
    const Answer& a = cache.get(2, unsupported);
    EXPECT_EQ(a.status, 1);
    EXPECT_EQ(a.error, "device 2 is sm_75");
  }
  EXPECT_EQ(loads, 1);
}

}  // namespace
