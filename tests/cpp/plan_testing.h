// Test helper: a layout's plan through the C ABI (dualkv_plan_inspect / _ex), as the CUDA backend
// would build it (bf16; the plan does not depend on the dtype), with gtest failures on errors.
#ifndef DUALKV_TESTS_PLAN_TESTING_H_
#define DUALKV_TESTS_PLAN_TESTING_H_

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "dualkv/dualkv.h"
#include "forest_testing.h"

namespace dualkv::testing {

struct Inspected {
  dualkv_plan_info info{};
  std::vector<int32_t> plan;
};

// The plan of layout v for request req (dualkv_plan_inspect_ex: the size call, then the plan).
inline Inspected inspect_request(const dualkv_layout& v, const dualkv_plan_request& req, int sms) {
  Inspected r;
  r.info.struct_size = sizeof(r.info);
  EXPECT_EQ(dualkv_plan_inspect_ex(&v, &req, sms, &r.info, nullptr, 0), DUALKV_OK) << dualkv_last_error();
  r.plan.resize(r.info.plan_len);
  EXPECT_EQ(dualkv_plan_inspect_ex(&v, &req, sms, &r.info, r.plan.data(), r.info.plan_len), DUALKV_OK)
      << dualkv_last_error();
  return r;
}

// A CUDA bf16 plan request for head_dim, a sliding window (0: none), external prefixes (NULL: none)
// and the kernel family's tiles (DUALKV_PLAN_TILES_*; DEVICE is PORTABLE for dualkv_plan_inspect_ex).
inline dualkv_plan_request cuda_request(int head_dim, int32_t window, const dualkv_prefixes* px,
                                        int32_t tiles = DUALKV_PLAN_TILES_DEVICE) {
  return dualkv_plan_request{sizeof(dualkv_plan_request), DUALKV_DEVICE_CUDA, 0, DUALKV_DTYPE_BFLOAT16,
                             head_dim, window, px, tiles};
}

// The plan of layout v (with external prefixes px, or none: NULL).
inline Inspected inspect(const dualkv_layout& v, const dualkv_prefixes* px, int head_dim, int sms) {
  return inspect_request(v, cuda_request(head_dim, 0, px), sms);
}
// The plan of layout l through the plain entry point (dualkv_plan_inspect).
inline Inspected inspect(const HostLayout& l, int head_dim, int sms) {
  Inspected r;
  r.info.struct_size = sizeof(r.info);
  const dualkv_layout v = l.view();
  EXPECT_EQ(dualkv_plan_inspect(&v, head_dim, sms, &r.info, nullptr, 0), DUALKV_OK) << dualkv_last_error();
  r.plan.resize(r.info.plan_len);
  EXPECT_EQ(dualkv_plan_inspect(&v, head_dim, sms, &r.info, r.plan.data(), r.info.plan_len), DUALKV_OK)
      << dualkv_last_error();
  return r;
}

// The plan of layout l cut to a sliding window of `window` positions.
inline Inspected inspect_windowed(const HostLayout& l, int head_dim, int32_t window, int sms) {
  return inspect_request(l.view(), cuda_request(head_dim, window, nullptr), sms);
}

}  // namespace dualkv::testing

#endif  // DUALKV_TESTS_PLAN_TESTING_H_
