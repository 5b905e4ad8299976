// Link profiles: emulation of a network between two stages, applied by the
// end that writes (docs/design#data-plane-link): the Sender shapes DATA going down, the
// Receiver the GRADs going up. A profile adds a one-way latency and serializes
// frames at a bandwidth, so a run on loopback or USB behaves like Wi-Fi or mobile.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "zl/status.h"

namespace zl {

using SteadyClock = std::chrono::steady_clock;

/// One-way latency and bandwidth; bandwidth 0 means unlimited.
struct LinkProfile {
  std::string name = "local";
  std::chrono::microseconds latency{0};
  uint64_t bandwidth_bits_per_s = 0;
};

/// `local` (no shaping), `wifi` 2 ms / 1000 Mbps, `mobile` 10 ms / 200 Mbps,
/// `constrained` 30 ms / 50 Mbps. kInvalidArgument names the known profiles.
Result<LinkProfile> link_profile_from_name(const std::string& name);

/// Computes when a frame would arrive over the emulated link. Frames queue
/// behind each other on the wire (serialization at the bandwidth), then each
/// travels `latency`. Not thread-safe; one per link, used by its sender thread.
class LinkShaper {
 public:
  explicit LinkShaper(LinkProfile profile = {}) : profile_(std::move(profile)) {}

  /// Arrival time of a frame of `bytes` handed to the link at `now`.
  SteadyClock::time_point schedule(size_t bytes, SteadyClock::time_point now);

  /// Forgets the queue (after a reconnect the wire is empty).
  void reset() { wire_free_at_ = SteadyClock::time_point{}; }

  const LinkProfile& profile() const { return profile_; }

 private:
  LinkProfile profile_;
  SteadyClock::time_point wire_free_at_{};
};

}  // namespace zl
