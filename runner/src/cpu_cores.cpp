// Usable and performance cores (zl/cpu_cores.h).
#include "zl/cpu_cores.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>

namespace zl {

std::vector<int> usable_cpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
      if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
    }
  }
  if (cpus.empty()) {
    const long online = sysconf(_SC_NPROCESSORS_ONLN);
    for (int cpu = 0; cpu < std::max(1L, online); ++cpu) cpus.push_back(cpu);
  }
  return cpus;
}

int64_t performance_cores(const std::vector<int>& cpus, const std::string& cpu_root) {
  std::vector<long long> freqs;
  for (int cpu : cpus) {
    std::ifstream in(cpu_root + "/cpu" + std::to_string(cpu) + "/cpufreq/cpuinfo_max_freq");
    long long khz = 0;
    if (!(in >> khz) || khz <= 0) return std::max<int64_t>(1, static_cast<int64_t>(cpus.size()));
    freqs.push_back(khz);
  }
  if (freqs.empty()) return 1;
  const long long slowest = *std::min_element(freqs.begin(), freqs.end());
  const int64_t above = std::count_if(freqs.begin(), freqs.end(), [&](long long f) { return f > slowest; });
  return above > 0 ? above : static_cast<int64_t>(freqs.size());
}

int64_t device_default_threads() {
  static const int64_t threads = performance_cores(usable_cpus());
  return threads;
}

}  // namespace zl
