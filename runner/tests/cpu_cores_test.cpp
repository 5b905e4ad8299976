// The thread count a device picks for "threads": 0 (zl/cpu_cores.h), on
// fake cpufreq trees shaped like real phones.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "temp_dir_support.h"
#include "zl/cpu_cores.h"

namespace zl {
namespace {

using zl_test::TempDir;

// <root>/cpu<N>/cpufreq/cpuinfo_max_freq for each frequency (kHz) in order.
std::string fake_cpus(const TempDir& dir, const std::vector<long long>& khz) {
  const std::string root = dir.file("cpu");
  for (size_t i = 0; i < khz.size(); ++i) {
    zl_test::write_text(root + "/cpu" + std::to_string(i) + "/cpufreq/cpuinfo_max_freq", std::to_string(khz[i]) + "\n");
  }
  return root;
}

std::vector<int> first(int n) {
  std::vector<int> cpus;
  for (int i = 0; i < n; ++i) cpus.push_back(i);
  return cpus;
}

TEST(CpuCoresTest, ThePerformanceCoresAreThoseOutsideTheSlowestCluster) {
  TempDir dir;
  // 4 little (A55 1.8 GHz) + 3 big (A78 2.4 GHz) + 1 prime (X1 2.8 GHz): the big and the prime.
  const std::string phone = fake_cpus(dir, {1800000, 1800000, 1800000, 1800000, 2400000, 2400000, 2400000, 2840000});
  EXPECT_EQ(performance_cores(first(8), phone), 4);
  // Only the little cores usable (an affinity mask): they are all there is.
  EXPECT_EQ(performance_cores(first(4), phone), 4);
  EXPECT_EQ(performance_cores({0, 1, 7}, phone), 1);
}

TEST(CpuCoresTest, OneFrequencyOrNoCpufreqMeansEveryUsableCore) {
  TempDir dir;
  const std::string same = fake_cpus(dir, {2000000, 2000000, 2000000, 2000000});
  EXPECT_EQ(performance_cores(first(4), same), 4);
  EXPECT_EQ(performance_cores(first(3), dir.path() + "/no-such-root"), 3);
  EXPECT_EQ(performance_cores({}, same), 1);
}

TEST(CpuCoresTest, TheDeviceDefaultIsAtLeastOneAndAtMostTheUsableCpus) {
  const int64_t threads = device_default_threads();
  EXPECT_GE(threads, 1);
  EXPECT_LE(threads, static_cast<int64_t>(usable_cpus().size()));
}

}  // namespace
}  // namespace zl
