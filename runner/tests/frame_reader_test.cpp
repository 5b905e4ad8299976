// FrameReader: splitting a byte stream into frames (issue 12 item 12: popping
// used to erase from the front of the buffer, quadratic in buffered frames).
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>

#include <gtest/gtest.h>

#include "net_test_support.h"
#include "zl/tcp_socket.h"

namespace zl {
namespace {

using testing::test_key;
using testing::test_run;

TEST(FrameReaderTest, PopsManyBufferedFramesInLinearTime) {
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  Socket writer(fds[0]), reader_fd(fds[1]);
  constexpr int kFrames = 40000;
  std::vector<uint8_t> stream;
  for (int i = 0; i < kFrames; ++i) {
    // ~500-byte frames: 20 MB buffered; erasing from the front moved ~400 GB.
    ASSERT_OK_AND_ASSIGN(const std::vector<uint8_t> one,
                         encode_frame(make_control_frame(FrameType::kHeartbeat, test_run(), 1, 0, static_cast<uint64_t>(i),
                                                         "{\"pad\":\"" + std::string(400, 'p') + "\"}"),
                                      test_key()));
    stream.insert(stream.end(), one.begin(), one.end());
  }
  ::fcntl(writer.fd(), F_SETFL, O_NONBLOCK);
  FrameReader reader;
  size_t sent = 0;
  while (sent < stream.size()) {  // everything buffered before the first pop
    const ssize_t n = ::send(writer.fd(), stream.data() + sent, stream.size() - sent, MSG_DONTWAIT);
    if (n > 0) sent += static_cast<size_t>(n);
    ASSERT_TRUE(reader.fill(reader_fd.fd()).ok());
  }
  ASSERT_TRUE(reader.fill(reader_fd.fd()).ok());
  ASSERT_EQ(reader.buffered(), stream.size());
  std::vector<std::vector<uint8_t>> popped(kFrames);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kFrames; ++i) {
    FrameError error = FrameError::kNone;
    std::string reason;
    ASSERT_EQ(reader.next(&popped[i], &error, &reason), FrameReader::Next::kFrame) << i;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 1.0) << "popping " << kFrames << " buffered frames took " << seconds << " s";
  EXPECT_EQ(reader.pop().next, FrameReader::Next::kNeedMore);
  EXPECT_EQ(reader.buffered(), 0u);
  for (int i = 0; i < kFrames; i += 997) {
    const DecodeResult r = decode_frame(popped[i].data(), popped[i].size(), test_key());
    ASSERT_TRUE(r.ok()) << r.reason;
    ASSERT_EQ(r.frame.micro_batch, static_cast<uint64_t>(i));
  }
}

TEST(FrameReaderTest, FramesSplitAcrossFillsAndPopsInterleave) {
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  Socket writer(fds[0]), reader_fd(fds[1]);
  FrameReader reader;
  std::vector<uint8_t> stream;
  for (int i = 0; i < 50; ++i) {
    ASSERT_OK_AND_ASSIGN(const std::vector<uint8_t> one,
                         encode_frame(make_control_frame(FrameType::kHeartbeat, test_run(), 1, 0, static_cast<uint64_t>(i),
                                                         "{\"i\":" + std::to_string(i) + "}"),
                                      test_key()));
    stream.insert(stream.end(), one.begin(), one.end());
  }
  uint64_t next = 0;
  for (size_t pos = 0; pos < stream.size(); pos += 37) {  // 37-byte pieces: frames straddle fills
    const size_t n = std::min<size_t>(37, stream.size() - pos);
    ASSERT_EQ(::send(writer.fd(), stream.data() + pos, n, 0), static_cast<ssize_t>(n));
    ASSERT_TRUE(reader.fill(reader_fd.fd()).ok());
    for (;;) {
      const FrameReader::Popped p = reader.pop();
      if (p.next == FrameReader::Next::kNeedMore) break;
      ASSERT_EQ(p.next, FrameReader::Next::kFrame);
      const DecodeResult r = decode_frame(p.frame.data(), p.frame.size(), test_key());
      ASSERT_TRUE(r.ok()) << r.reason;
      EXPECT_EQ(r.frame.micro_batch, next++);
    }
  }
  EXPECT_EQ(next, 50u);
  // Garbage after good frames is reported once it is recognisable.
  ASSERT_EQ(::send(writer.fd(), "JUNKJUNK", 8, 0), 8);
  ASSERT_TRUE(reader.fill(reader_fd.fd()).ok());
  EXPECT_EQ(reader.pop().next, FrameReader::Next::kBroken);
}

// Issue 28 item 2: memory follows the bytes that arrived, bounded by the cap,
// never the length a header announces.
TEST(FrameReaderTest, BuffersNoMoreThanItsCapWhateverAHeaderAnnounces) {
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> stream,
                       encode_frame(make_control_frame(FrameType::kHello, test_run(), 0, 0, 0), test_key()));
  stream.resize(kFrameHeaderSize);
  const uint32_t announced = 64u << 20;
  std::memcpy(stream.data() + 8, &announced, sizeof(announced));  // total_length, little-endian
  stream.resize(kFrameHeaderSize + 100 * 1024, 0xa5);
  // A connection that sent that header and 100 KiB of the 64 MiB it announced.
  auto connection = [&](Socket* writer, Socket* reader_end) {
    int fds[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
    *writer = Socket(fds[0]);
    *reader_end = Socket(fds[1]);
    ASSERT_EQ(::send(writer->fd(), stream.data(), stream.size(), 0), static_cast<ssize_t>(stream.size()));
  };

  Socket w1, r1;
  connection(&w1, &r1);
  FrameReader small(1024);  // a pre-auth reader: a HELLO's worth, then it says why not more
  ASSERT_TRUE(small.fill(r1.fd()).ok());
  EXPECT_LE(small.buffered(), 1024u + kFrameHeaderSize);
  const FrameReader::Popped refused = small.pop();
  EXPECT_EQ(refused.next, FrameReader::Next::kBroken);
  EXPECT_EQ(refused.error, FrameError::kOversize);

  Socket w2, r2;
  connection(&w2, &r2);
  FrameReader full;  // 64 MiB: the announcement fits; only the bytes that came are held
  ASSERT_TRUE(full.fill(r2.fd()).ok());
  EXPECT_EQ(full.buffered(), stream.size());
  EXPECT_EQ(full.pop().next, FrameReader::Next::kNeedMore);
}

}  // namespace
}  // namespace zl
