#include "zl/link_profile.h"

#include <algorithm>

namespace zl {

Result<LinkProfile> link_profile_from_name(const std::string& name) {
  using std::chrono::milliseconds;
  LinkProfile p;
  p.name = name;
  if (name == "local") {
    // no shaping
  } else if (name == "wifi") {
    p.latency = milliseconds(2);
    p.bandwidth_bits_per_s = 1000ull * 1000 * 1000;
  } else if (name == "mobile") {
    p.latency = milliseconds(10);
    p.bandwidth_bits_per_s = 200ull * 1000 * 1000;
  } else if (name == "constrained") {
    p.latency = milliseconds(30);
    p.bandwidth_bits_per_s = 50ull * 1000 * 1000;
  } else {
    return Status(StatusCode::kInvalidArgument,
                  "link profile '" + name + "' is unknown; use local, wifi, mobile or constrained");
  }
  return p;
}

SteadyClock::time_point LinkShaper::schedule(size_t bytes, SteadyClock::time_point now) {
  if (profile_.bandwidth_bits_per_s == 0) return now + profile_.latency;
  const auto serialize = std::chrono::nanoseconds(static_cast<int64_t>(
      static_cast<double>(bytes) * 8.0 * 1e9 / static_cast<double>(profile_.bandwidth_bits_per_s)));
  const auto start = std::max(now, wire_free_at_);
  wire_free_at_ = start + serialize;
  return wire_free_at_ + profile_.latency;
}

}  // namespace zl
