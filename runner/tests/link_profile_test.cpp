#include "zl/link_profile.h"

#include <gtest/gtest.h>

#include "status_test_support.h"

namespace zl {
namespace {

using std::chrono::microseconds;
using std::chrono::milliseconds;

TEST(LinkProfileTest, NamedProfilesHaveTheDesignedNumbers) {
  ASSERT_OK_AND_ASSIGN(LinkProfile p, link_profile_from_name("mobile"));
  EXPECT_EQ(p.latency, milliseconds(10));
  EXPECT_EQ(p.bandwidth_bits_per_s, 200'000'000u);
  ASSERT_OK_AND_ASSIGN(p, link_profile_from_name("constrained"));
  EXPECT_EQ(p.latency, milliseconds(30));
  EXPECT_EQ(p.bandwidth_bits_per_s, 50'000'000u);
  ASSERT_OK_AND_ASSIGN(p, link_profile_from_name("local"));
  EXPECT_EQ(p.latency, microseconds(0));
  const Status s = link_profile_from_name("5g").status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("'5g'"), std::string::npos);
}

TEST(LinkProfileTest, ShaperSerializesBackToBackFramesThenAddsLatency) {
  ASSERT_OK_AND_ASSIGN(const LinkProfile wifi, link_profile_from_name("wifi"));
  LinkShaper shaper(wifi);
  const auto t0 = SteadyClock::now();
  // 125,000 bytes at 1 Gbit/s = 1 ms on the wire, + 2 ms latency.
  EXPECT_EQ(shaper.schedule(125000, t0) - t0, microseconds(3000));
  // Handed over at the same time: waits for the first to leave the wire.
  EXPECT_EQ(shaper.schedule(125000, t0) - t0, microseconds(4000));
  shaper.reset();
  EXPECT_EQ(shaper.schedule(125000, t0) - t0, microseconds(3000));
}

}  // namespace
}  // namespace zl
