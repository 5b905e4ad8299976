// parse_host_port: the one reader of listen / downstream / coordinator
// addresses; good forms, IPv6 brackets, and each way an address can be bad.
#include "zl/host_port.h"

#include <string>

#include <gtest/gtest.h>

namespace zl {
namespace {

// Parses `address` and checks both parts.
void expect_parses(const std::string& address, const std::string& host, uint16_t port) {
  Result<HostPort> r = parse_host_port(address);
  ASSERT_TRUE(r.ok()) << address << ": " << r.status().message();
  EXPECT_EQ(r->host, host) << address;
  EXPECT_EQ(r->port, port) << address;
}

TEST(HostPortTest, NameAndNumericHosts) {
  expect_parses("192.168.1.12:7001", "192.168.1.12", 7001);
  expect_parses("pixel-7.local:1", "pixel-7.local", 1);
  expect_parses("h:65535", "h", 65535);
}

TEST(HostPortTest, Ipv6InBracketsLosesTheBrackets) {
  expect_parses("[::1]:7100", "::1", 7100);
  expect_parses("[fe80::1%wlan0]:80", "fe80::1%wlan0", 80);
}

TEST(HostPortTest, PortIsAfterTheLastColon) {
  // Unbracketed IPv6: the last ':' separates the port, as it always has.
  expect_parses("::1:7001", "::1", 7001);
}

TEST(HostPortTest, LeadingZerosWithinFiveDigitsAreTheSamePort) {
  // The config check has always read "07001" as 7001; keep it so.
  expect_parses("h:07001", "h", 7001);
}

TEST(HostPortTest, PortZeroOnlyWhereAllowed) {
  EXPECT_FALSE(parse_host_port("127.0.0.1:0").ok());
  Result<HostPort> listen = parse_host_port("127.0.0.1:0", PortZero::kAllowed);
  ASSERT_TRUE(listen.ok()) << listen.status().message();
  EXPECT_EQ(listen->port, 0);
}

TEST(HostPortTest, MissingParts) {
  for (const char* address : {"", "127.0.0.1", "127.0.0.1:", ":7001", "[]:7001", ":"}) {
    Result<HostPort> r = parse_host_port(address, PortZero::kAllowed);
    EXPECT_FALSE(r.ok()) << "'" << address << "' parsed";
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(std::string("\"") + address + "\""), std::string::npos)
        << r.status().message();
  }
}

TEST(HostPortTest, PortOutOfRangeOrNotDecimal) {
  for (const char* address : {"h:65536", "h:99999", "h:123456", "h:000007001", "h:-1", "h:+80", "h:7a", "h:0x1F",
                              "h: 80", "[::1]"}) {
    EXPECT_FALSE(parse_host_port(address, PortZero::kAllowed).ok()) << "'" << address << "' parsed";
  }
  const Status status = parse_host_port("h:70000").status();
  EXPECT_NE(status.message().find("70000"), std::string::npos) << status.message();
  EXPECT_NE(status.message().find("1..65535"), std::string::npos) << status.message();
}

TEST(HostPortTest, WithPortKeepsTheHostAsWritten) {
  Result<std::string> v4 = with_port("0.0.0.0:0", 7001);
  ASSERT_TRUE(v4.ok()) << v4.status().message();
  EXPECT_EQ(*v4, "0.0.0.0:7001");
  Result<std::string> v6 = with_port("[::1]:0", 40123);
  ASSERT_TRUE(v6.ok()) << v6.status().message();
  EXPECT_EQ(*v6, "[::1]:40123");
  Result<std::string> bare_v6 = with_port("::1:7001", 7002);
  ASSERT_TRUE(bare_v6.ok()) << bare_v6.status().message();
  EXPECT_EQ(*bare_v6, "::1:7002");
  EXPECT_EQ(with_port("no-port", 7001).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace zl
