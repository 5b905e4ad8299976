#include "zl/link_profile.h"

#include <gtest/gtest.h>

namespace zl {
namespace {

using std::chrono::microseconds;
using std::chrono::milliseconds;

TEST(LinkProfileTest, NamedProfilesHaveTheDesignedNumbers) {
  LinkProfile p;
  ASSERT_TRUE(link_profile_from_name("mobile", &p).ok());
  EXPECT_EQ(p.latency, milliseconds(10));
  EXPECT_EQ(p.bandwidth_bits_per_s, 200'000'000u);
  ASSERT_TRUE(link_profile_from_name("constrained", &p).ok());
  EXPECT_EQ(p.latency, milliseconds(30));
  EXPECT_EQ(p.bandwidth_bits_per_s, 50'000'000u);
  ASSERT_TRUE(link_profile_from_name("local", &p).ok());
  EXPECT_EQ(p.latency, microseconds(0));
  const Status s = link_profile_from_name("5g", &p);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("'5g'"), std::string::npos);
}

TEST(LinkProfileTest, ShaperSerializesBackToBackFramesThenAddsLatency) {
  LinkProfile wifi;
  ASSERT_TRUE(link_profile_from_name("wifi", &wifi).ok());
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
