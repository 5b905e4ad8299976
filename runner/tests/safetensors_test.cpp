// safetensors writer/reader: round trip and each way a file can be damaged.
// (Python's safetensors reading these files: tests/test_checkpoint_format.py.)
#include "zl/safetensors.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "status_test_support.h"
#include "temp_dir_support.h"
#include "zl/durable_file.h"

namespace {

using zl::SafetensorsDtype;
using zl::SafetensorsFile;

std::string raw_file(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i));
  return out + header + data;
}

TEST(Safetensors, RoundTripKeepsNamesShapesValuesAndMetadata) {
  zl_test::TempDir dir;
  const std::vector<float> a = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f, 8.0f};
  const std::vector<int64_t> b = {-1, 1LL << 40};
  const std::string path = dir.file("t.safetensors");
  ASSERT_TRUE(zl::write_safetensors(path,
                                    {{"z.weight", SafetensorsDtype::kF32, {2, 3}, a.data()},
                                     {"a.ids", SafetensorsDtype::kI64, {2}, b.data()}},
                                    {{"format", "pt"}})
                  .ok());
  ASSERT_OK_AND_ASSIGN(const SafetensorsFile file, zl::read_safetensors(path));
  ASSERT_EQ(file.tensors.size(), 2u);
  const auto& z = file.tensors.at("z.weight");
  EXPECT_EQ(z.dtype, SafetensorsDtype::kF32);
  EXPECT_EQ(z.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(std::vector<float>(z.f32(), z.f32() + 6), a);
  const auto& ids = file.tensors.at("a.ids");
  EXPECT_EQ(ids.dtype, SafetensorsDtype::kI64);
  int64_t second = 0;
  std::memcpy(&second, ids.bytes.data() + 8, 8);
  EXPECT_EQ(second, 1LL << 40);
  EXPECT_EQ(file.metadata.at("format"), "pt");

  // Sorted names: "a.ids" data comes first, and the data region is 8-aligned.
  ASSERT_OK_AND_ASSIGN(const std::string bytes, zl::read_file(path));
  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes.data(), 8);
  EXPECT_EQ(header_len % 8, 0u);
  EXPECT_LT(bytes.find("a.ids"), bytes.find("z.weight"));
}

TEST(Safetensors, WriterRejectsDuplicateNames) {
  zl_test::TempDir dir;
  const float x = 1.0f;
  zl::Status s = zl::write_safetensors(dir.file("d.safetensors"), {{"x", SafetensorsDtype::kF32, {1}, &x},
                                                                   {"x", SafetensorsDtype::kF32, {1}, &x}});
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("duplicate"), std::string::npos) << s.message();
}

TEST(Safetensors, TruncatedDataIsDetected) {
  zl_test::TempDir dir;
  const std::vector<float> a(100, 1.0f);
  const std::string path = dir.file("t.safetensors");
  ASSERT_TRUE(zl::write_safetensors(path, {{"a", SafetensorsDtype::kF32, {100}, a.data()}}).ok());
  ASSERT_OK_AND_ASSIGN(const std::string bytes, zl::read_file(path));
  zl_test::write_text(path, bytes.substr(0, bytes.size() - 10));
  const zl::Status s = zl::read_safetensors(path).status();
  EXPECT_EQ(s.code(), zl::StatusCode::kCorrupt);
  EXPECT_NE(s.message().find(path), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("truncated"), std::string::npos) << s.message();
}

TEST(Safetensors, TruncatedHeaderIsDetected) {
  zl_test::TempDir dir;
  const std::string path = dir.file("h.safetensors");
  zl_test::write_text(path, raw_file("{\"a\": {\"dtype\": \"F32\"", "").substr(0, 12));
  const zl::Status s = zl::read_safetensors(path).status();
  EXPECT_EQ(s.code(), zl::StatusCode::kCorrupt);
  EXPECT_NE(s.message().find("header length"), std::string::npos) << s.message();

  zl_test::write_text(path, "abc");
  EXPECT_EQ(zl::read_safetensors(path).status().code(), zl::StatusCode::kCorrupt);
}

TEST(Safetensors, BadHeaderJsonIsDetected) {
  zl_test::TempDir dir;
  const std::string path = dir.file("j.safetensors");
  zl_test::write_text(path, raw_file("{\"a\": [1, 2", ""));
  const zl::Status s = zl::read_safetensors(path).status();
  EXPECT_EQ(s.code(), zl::StatusCode::kCorrupt);
  EXPECT_NE(s.message().find("JSON"), std::string::npos) << s.message();
}

TEST(Safetensors, OffsetsThatDisagreeWithShapeAreDetected) {
  zl_test::TempDir dir;
  const std::string path = dir.file("o.safetensors");
  zl_test::write_text(path, raw_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", std::string(8, '\0')));
  const zl::Status s = zl::read_safetensors(path).status();
  EXPECT_EQ(s.code(), zl::StatusCode::kCorrupt);
  EXPECT_NE(s.message().find("'a'"), std::string::npos) << s.message();
}

TEST(Safetensors, GapsAndTrailingBytesAreDetected) {
  zl_test::TempDir dir;
  const std::string path = dir.file("g.safetensors");
  zl_test::write_text(path, raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", std::string(8, '\0')));
  EXPECT_EQ(zl::read_safetensors(path).status().code(), zl::StatusCode::kCorrupt);
  zl_test::write_text(path, raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", std::string(8, '\0')));
  EXPECT_EQ(zl::read_safetensors(path).status().code(), zl::StatusCode::kCorrupt);
}

TEST(Safetensors, UnknownDtypeIsDetected) {
  zl_test::TempDir dir;
  const std::string path = dir.file("u.safetensors");
  zl_test::write_text(path, raw_file(R"({"a":{"dtype":"Q4","shape":[1],"data_offsets":[0,4]}})", std::string(4, '\0')));
  const zl::Status s = zl::read_safetensors(path).status();
  EXPECT_NE(s.message().find("Q4"), std::string::npos) << s.message();
}

TEST(Safetensors, MissingFileIsNotFound) {
  EXPECT_EQ(zl::read_safetensors("/nonexistent/zl/x.safetensors").status().code(), zl::StatusCode::kNotFound);
}

}  // namespace
