// Durable input log: entries survive a reopen, deletion by window, and
// corrupt/truncated/leftover files are detected and reported, not replayed.
#include "zl/input_log.h"

#include <sys/stat.h>
#include <unistd.h>

#include <fstream>

#include <gtest/gtest.h>

#include "net_test_support.h"
#include "zl/durable_file.h"

namespace zl {
namespace {

using testing::data_frame;
using testing::TempDir;
using testing::test_key;
using testing::value_or_fail;

std::vector<uint8_t> encoded(uint64_t window, uint64_t mb) {
  return value_or_fail(encode_frame(data_frame(window, mb), test_key()));
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

TEST(InputLogTest, AppendedEntriesSurviveReopenInMicroBatchOrder) {
  TempDir dir;
  const std::string log_dir = dir.path() + "/stage1/inbox";  // created on open
  {
    InputLog log(log_dir, test_key());
    ASSERT_TRUE(log.open().ok());
    for (uint64_t mb : {2, 0, 1, 3}) ASSERT_TRUE(log.append(mb / 2, mb, encoded(mb / 2, mb)).ok());
    EXPECT_TRUE(exists(log.path_for(1, 3)));
  }
  InputLog reopened(log_dir, test_key());
  ASSERT_TRUE(reopened.open().ok());
  const auto entries = reopened.entries();
  ASSERT_EQ(entries.size(), 4u);
  for (uint64_t i = 0; i < 4; ++i) {
    EXPECT_EQ(entries[i].micro_batch, i);
    EXPECT_EQ(entries[i].window, i / 2);
  }
  ASSERT_OK_AND_ASSIGN(const Frame f, reopened.read(3));
  EXPECT_EQ(f.micro_batch, 3u);
  EXPECT_EQ(f.find("hidden")->data, data_frame(1, 3).find("hidden")->data);
  EXPECT_EQ(reopened.read(9).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(reopened.corrupt().empty());
}

TEST(InputLogTest, DeleteThroughRemovesCommittedWindowsOnly) {
  TempDir dir;
  InputLog log(dir.path(), test_key());
  ASSERT_TRUE(log.open().ok());
  for (uint64_t mb = 0; mb < 6; ++mb) ASSERT_TRUE(log.append(mb / 2, mb, encoded(mb / 2, mb)).ok());
  ASSERT_TRUE(log.delete_through(1).ok());
  EXPECT_FALSE(log.contains(3));
  EXPECT_TRUE(log.contains(4));
  EXPECT_FALSE(exists(log.path_for(0, 0)));
  EXPECT_FALSE(exists(log.path_for(1, 3)));
  EXPECT_TRUE(exists(log.path_for(2, 5)));
  InputLog reopened(dir.path(), test_key());
  ASSERT_TRUE(reopened.open().ok());
  EXPECT_EQ(reopened.size(), 2u);
}

TEST(InputLogTest, CorruptAndTruncatedFilesAreReportedAndSetAside) {
  TempDir dir;
  std::string flipped_path, truncated_path;
  {
    InputLog log(dir.path(), test_key());
    ASSERT_TRUE(log.open().ok());
    for (uint64_t mb = 0; mb < 3; ++mb) ASSERT_TRUE(log.append(0, mb, encoded(0, mb)).ok());
    flipped_path = log.path_for(0, 1);
    truncated_path = log.path_for(0, 2);
  }
  {
    std::fstream f(flipped_path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x5a');
  }
  ASSERT_EQ(::truncate(truncated_path.c_str(), 50), 0);
  // A crash between write and rename leaves a temp file behind.
  std::ofstream(dir.path() + "/entry-00000000000000000009-w00000000000000000000.zlf.tmp") << "x";

  InputLog log(dir.path(), test_key());
  ASSERT_TRUE(log.open().ok());
  EXPECT_EQ(log.size(), 1u);
  EXPECT_TRUE(log.contains(0));
  const auto corrupt = log.corrupt();
  ASSERT_EQ(corrupt.size(), 2u);
  std::string reasons = corrupt[0].reason + " | " + corrupt[1].reason;
  EXPECT_NE(reasons.find("bad_mac"), std::string::npos) << reasons;
  EXPECT_NE(reasons.find("truncated"), std::string::npos) << reasons;
  EXPECT_TRUE(exists(flipped_path + ".corrupt"));
  EXPECT_FALSE(exists(dir.path() + "/entry-00000000000000000009-w00000000000000000000.zlf.tmp"));

  // Set aside means not reported again.
  InputLog again(dir.path(), test_key());
  ASSERT_TRUE(again.open().ok());
  EXPECT_TRUE(again.corrupt().empty());
}

// Issue 12 item 13: files set aside as .corrupt used to accumulate forever.
TEST(InputLogTest, CorruptFilesDoNotAccumulate) {
  TempDir dir;
  // 20 corrupt entries in windows 0..19 (one micro-batch each).
  for (uint64_t mb = 0; mb < 20; ++mb) {
    InputLog log(dir.path(), test_key());
    ASSERT_TRUE(log.open().ok());
    ASSERT_TRUE(log.append(mb, mb, encoded(mb, mb)).ok());
    ASSERT_EQ(::truncate(log.path_for(mb, mb).c_str(), 50), 0);
  }
  InputLog log(dir.path(), test_key());
  ASSERT_TRUE(log.open().ok());
  auto count_corrupt = [&] {
    size_t n = 0;
    for (uint64_t mb = 0; mb < 20; ++mb) n += exists(log.path_for(mb, mb) + ".corrupt");
    return n;
  };
  EXPECT_EQ(count_corrupt(), kMaxCorruptFilesKept);
  EXPECT_TRUE(exists(log.path_for(19, 19) + ".corrupt"));  // the newest stay
  EXPECT_FALSE(exists(log.path_for(0, 0) + ".corrupt"));
  // Committing a window removes what was set aside of it.
  ASSERT_TRUE(log.delete_through(15).ok());
  EXPECT_EQ(count_corrupt(), 4u);
}

TEST(InputLogTest, CreatingTheFolderMakesItDurable) {
  TempDir dir;
  const uint64_t before = directories_synced_after_create().load();
  InputLog log(dir.path() + "/inputs/stage_1", test_key());
  ASSERT_TRUE(log.open().ok());
  EXPECT_GE(directories_synced_after_create().load() - before, 2u);
}

TEST(InputLogTest, FileWhoseIdsDisagreeWithItsNameIsCorrupt) {
  TempDir dir;
  InputLog log(dir.path(), test_key());
  ASSERT_TRUE(log.open().ok());
  const auto bytes = encoded(0, 5);
  ASSERT_TRUE(write_file_durably(log.path_for(0, 6), bytes.data(), bytes.size()).ok());
  InputLog reopened(dir.path(), test_key());
  ASSERT_TRUE(reopened.open().ok());
  EXPECT_EQ(reopened.size(), 0u);
  ASSERT_EQ(reopened.corrupt().size(), 1u);
  EXPECT_NE(reopened.corrupt()[0].reason.find("differ from the file name"), std::string::npos);
}

TEST(InputLogTest, ReadDetectsCorruptionAfterOpen) {
  TempDir dir;
  InputLog log(dir.path(), test_key());
  ASSERT_TRUE(log.open().ok());
  ASSERT_TRUE(log.append(0, 0, encoded(0, 0)).ok());
  ASSERT_EQ(::truncate(log.path_for(0, 0).c_str(), 80), 0);
  const Status s = log.read(0).status();
  EXPECT_EQ(s.code(), StatusCode::kCorrupt);
  EXPECT_NE(s.message().find("truncated"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace zl
