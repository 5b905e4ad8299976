// "host:port" addresses of the stage config (listen, downstream,
// coordinator): one parser, so the config check and the sockets agree on
// what an address is.
#pragma once

#include <cstdint>
#include <string>

#include "zl/status.h"

namespace zl {

struct HostPort {
  std::string host;  ///< name or IP literal, brackets of "[v6]" removed; never empty
  uint16_t port = 0;
};

/// Whether port 0 ("any free port", for a listen address) is accepted.
enum class PortZero { kRejected, kAllowed };

/// Parses "host:port" or "[v6-literal]:port". The port is the decimal digits
/// after the last ':' (1..65535, or 0 where allowed; no sign, at most 5
/// digits); the host is everything before it and must not be empty.
/// kInvalidArgument otherwise, naming the address and what is wrong; callers
/// that report a config field put their own message around it.
Result<HostPort> parse_host_port(const std::string& address, PortZero port_zero = PortZero::kRejected);

/// `address` ("host:port", as parse_host_port reads it) with its port
/// replaced by `port`, the host kept as written (brackets included): a
/// listen address of port 0 becomes the one the socket was bound to.
/// kInvalidArgument, as parse_host_port, when `address` is not host:port.
Result<std::string> with_port(const std::string& address, uint16_t port);

}  // namespace zl
