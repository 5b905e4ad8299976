// How many threads a stage's kernels get when the config leaves it to the
// device ("threads": 0): the cores outside the device's slowest cluster.
//
// A phone's cores come in clusters of one maximum frequency each (e.g. 1
// prime + 3 big + 4 little). zl's GEMM splits its panels evenly over the
// pool's threads (docs/design#kernels), so a step takes as long as its
// slowest thread: a little core would set the pace, while the lone prime
// core alone would leave the big cores idle. So: every usable core whose
// cpufreq/cpuinfo_max_freq is above the lowest one (4 on 1+3+4, 2 on 2+6,
// 4 on 4+4 of two frequencies), or every usable core where all have one
// frequency or cpufreq cannot be read (a desktop, qemu, a container).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zl {

/// The CPUs this process may run on (sched_getaffinity), ascending; {0..n-1}
/// from the online count where the mask cannot be read.
std::vector<int> usable_cpus();

/// The cores of `cpus` outside the slowest cluster, read from
/// `<cpu_root>/cpu<N>/cpufreq/cpuinfo_max_freq` (see above); at least 1.
int64_t performance_cores(const std::vector<int>& cpus, const std::string& cpu_root = "/sys/devices/system/cpu");

/// The thread count "threads": 0 resolves to on this device:
/// performance_cores(usable_cpus()).
int64_t device_default_threads();

}  // namespace zl
