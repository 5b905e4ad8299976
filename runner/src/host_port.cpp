#include "zl/host_port.h"

#include <algorithm>

namespace zl {

Result<HostPort> parse_host_port(const std::string& address, PortZero port_zero) {
  auto bad = [&](const std::string& why) {
    return Status(StatusCode::kInvalidArgument, "address \"" + address + "\" is not host:port: " + why);
  };
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return bad("no ':port'");
  std::string host = address.substr(0, colon);
  const std::string digits = address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  if (host.empty()) return bad("the host is empty");
  if (digits.empty() || digits.size() > 5 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return bad("the port must be 1 to 5 decimal digits");
  }
  const unsigned long port = std::stoul(digits);  // digits only, at most 5: cannot throw
  const unsigned long lowest = port_zero == PortZero::kAllowed ? 0 : 1;
  if (port < lowest || port > 65535) {
    return bad("port " + digits + " is outside " + std::to_string(lowest) + "..65535");
  }
  return HostPort{host, static_cast<uint16_t>(port)};
}

Result<std::string> with_port(const std::string& address, uint16_t port) {
  ZL_RETURN_IF_ERROR(parse_host_port(address, PortZero::kAllowed));
  return address.substr(0, address.rfind(':') + 1) + std::to_string(port);
}

}  // namespace zl
