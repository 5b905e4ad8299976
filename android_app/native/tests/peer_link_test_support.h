// The receiver every peer-link test starts from: stage 1 of a link 0 -> 1 with (kB, kS, kD) hidden states.
#pragma once

#include <cstdint>
#include <string>

#include "net_test_support.h"
#include "zl/peer_link.h"

namespace zl::testing {

constexpr int64_t kB = 1, kS = 3, kD = 4;  // batch, sequence length, hidden size of the test frames

inline ReceiverOptions receiver_options(const std::string& log_dir, uint16_t port = 0) {
  ReceiverOptions o;
  o.port = port;
  o.key = test_key();
  o.expect.run_id = test_run();
  o.expect.stage = 0;  // frames come from stage 0
  o.expect.batch = kB;
  o.expect.seq_len = kS;
  o.expect.hidden_size = kD;
  o.stage = 1;
  o.log_dir = log_dir;
  return o;
}

}  // namespace zl::testing
