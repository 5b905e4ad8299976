// Frame codec: round trips and one test per rejection reason; the reason
// code and the reason text are both checked.
#include "zl/frame.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>

#include "net_test_support.h"

namespace zl {
namespace {

using testing::data_frame;
using testing::plain_frame;
using testing::reseal;
using testing::test_key;
using testing::test_run;
using testing::value_or_fail;

std::vector<uint8_t> encode(const Frame& f, const FrameKey& key = test_key()) {
  return value_or_fail(encode_frame(f, key));
}

FrameExpectation shape_expectation(int64_t b, int64_t s, int64_t d) {
  FrameExpectation e;
  e.batch = b;
  e.seq_len = s;
  e.hidden_size = d;
  return e;
}

TEST(FrameTest, DataRoundTripKeepsIdsAndTensors) {
  const Frame f = data_frame(/*window=*/3, /*mb=*/17, 2, 5, 8, /*stage=*/1);
  const auto bytes = encode(f);
  const DecodeResult r = decode_frame(bytes.data(), bytes.size(), test_key(),
                                      shape_expectation(2, 5, 8));
  ASSERT_TRUE(r.ok()) << r.reason;
  EXPECT_EQ(r.frame.type, FrameType::kData);
  EXPECT_EQ(r.frame.run_id, test_run());
  EXPECT_EQ(r.frame.stage, 1u);
  EXPECT_EQ(r.frame.window, 3u);
  EXPECT_EQ(r.frame.micro_batch, 17u);
  ASSERT_EQ(r.frame.tensors.size(), 3u);
  const TensorRecord* hidden = r.frame.find("hidden");
  ASSERT_NE(hidden, nullptr);
  EXPECT_EQ(hidden->shape, (std::vector<int64_t>{2, 5, 8}));
  EXPECT_EQ(hidden->data, f.find("hidden")->data);
  const float* h = reinterpret_cast<const float*>(hidden->data.data());
  EXPECT_FLOAT_EQ(h[9], 17.0f + 9 / 8.0f);
  const TensorRecord* labels = r.frame.find("labels");
  ASSERT_NE(labels, nullptr);
  EXPECT_EQ(labels->dtype, DType::kInt64);
  EXPECT_EQ(reinterpret_cast<const int64_t*>(labels->data.data())[0], -1);
  // Header 128 + tag 16 + 3 records (16 + name + 8 * rank + payload).
  const size_t expected = 128 + 16 + (16 + 6 + 24 + 2 * 5 * 8 * 4) + (16 + 14 + 16 + 80) +
                          (16 + 6 + 16 + 80);
  EXPECT_EQ(bytes.size(), expected);
}

TEST(FrameTest, ControlFrameCarriesJson) {
  const Frame f = make_control_frame(FrameType::kHeartbeat, test_run(), 2, 4, 40,
                                     R"({"progress":0.5,"pss_kib":123456,"temperature_c":null})");
  const auto bytes = encode(f);
  const DecodeResult r = decode_frame(bytes.data(), bytes.size(), test_key());
  ASSERT_TRUE(r.ok()) << r.reason;
  EXPECT_EQ(r.frame.type, FrameType::kHeartbeat);
  EXPECT_EQ(r.frame.json, f.json);
  EXPECT_TRUE(r.frame.tensors.empty());
  EXPECT_EQ(bytes.size(), kFrameHeaderSize + f.json.size() + kFrameTagSize);
}

TEST(FrameTest, HeaderLayoutMatchesProtocolDoc) {
  Frame f = data_frame(0x0102, 0x0a0b, 1, 1, 1, 0x33);
  for (size_t i = 0; i < kSessionSize; ++i) f.session[i] = static_cast<uint8_t>(0xc0 + i);
  f.seq = 0x0605;
  const auto bytes = plain_frame(f);
  EXPECT_EQ(std::string(bytes.begin(), bytes.begin() + 4), "ZLFR");
  EXPECT_EQ(bytes[4], 2);     // version
  EXPECT_EQ(bytes[6], 1);     // type DATA
  EXPECT_EQ(bytes[8] | (bytes[9] << 8), static_cast<int>(bytes.size()));  // total_length
  EXPECT_EQ(bytes[32], 0x33);  // stage
  EXPECT_EQ(bytes[36], 3);     // tensor_count
  EXPECT_EQ(bytes[40], 0x02);  // window, little-endian
  EXPECT_EQ(bytes[41], 0x01);
  EXPECT_EQ(bytes[48], 0x0b);  // micro_batch
  EXPECT_EQ(bytes[64], 0xc0);  // session
  EXPECT_EQ(bytes[95], 0xc0 + 31);
  EXPECT_EQ(bytes[96], 0x05);  // seq
  EXPECT_EQ(bytes[97], 0x06);
  EXPECT_EQ(bytes[128], static_cast<uint8_t>(DType::kFloat32));  // first record's dtype (in the plaintext)
  EXPECT_EQ(bytes[129], 3);                                       // rank
}

TEST(FrameTest, CorruptByteFailsTheTag) {
  const auto good = encode(data_frame(0, 1));
  // The header (associated data), the nonce, the ciphertext, the tag.
  for (size_t pos : {size_t{20}, size_t{70}, size_t{100}, size_t{110}, kFrameHeaderSize + 40, good.size() - 1}) {
    auto bytes = good;
    bytes[pos] ^= 0x01;
    const DecodeResult r = decode_frame(bytes.data(), bytes.size(), test_key());
    EXPECT_EQ(r.error, FrameError::kBadMac) << pos;
    EXPECT_NE(r.reason.find("authentication tag does not verify"), std::string::npos) << r.reason;
  }
}

// Issue 12 item 1: hidden states, labels and payloads are not on the wire in
// clear (a MAC-only frame carried them verbatim).
TEST(FrameTest, PayloadAndTensorsAreEncrypted) {
  Frame f = data_frame(0, 1, 1, 3, 4);
  f.json = R"({"secret":"the prompt"})";
  const std::vector<uint8_t> labels = f.find("labels")->data;
  const std::vector<uint8_t> hidden(f.find("hidden")->data.begin(), f.find("hidden")->data.begin() + 16);
  const auto bytes = encode(f);
  const auto contains = [&](const std::vector<uint8_t>& needle) {
    return std::search(bytes.begin(), bytes.end(), needle.begin(), needle.end()) != bytes.end();
  };
  EXPECT_FALSE(contains(labels));
  EXPECT_FALSE(contains(hidden));
  EXPECT_FALSE(contains(std::vector<uint8_t>{'p', 'r', 'o', 'm', 'p', 't'}));
  EXPECT_FALSE(contains(std::vector<uint8_t>{'l', 'a', 'b', 'e', 'l', 's'}));
  // A fresh nonce per frame: the same frame never encrypts the same way twice.
  const auto again = encode(f);
  EXPECT_NE(std::vector<uint8_t>(again.begin() + 104, again.end()), std::vector<uint8_t>(bytes.begin() + 104, bytes.end()));
  const DecodeResult r = decode_frame(again.data(), again.size(), test_key());
  ASSERT_TRUE(r.ok()) << r.reason;
  EXPECT_EQ(r.frame.find("labels")->data, labels);
  EXPECT_EQ(r.frame.json, f.json);
}

TEST(FrameTest, KeysDifferPerChannelLinkAndDirection) {
  // libsodium crypto_kdf_derive_from_key(32, 3 << 32 | 7, "zl-frame", 00 01 .. 1f): the vector
  // tests/test_frames.py checks the Python twin against.
  FrameKey run{};
  for (size_t i = 0; i < run.size(); ++i) run[i] = static_cast<uint8_t>(i);
  const FrameKey k = derive_frame_key(run, KeyPurpose::kControlUp, 7);
  EXPECT_EQ(to_hex(k.data(), k.size()), "5376c0db9442a4e9d170008194efb27793ca068d71379deced2c16d1dcf6667d");
  const LinkKeys client = link_keys(run, Channel::kData, 2, LinkEnd::kClient);
  const LinkKeys server = link_keys(run, Channel::kData, 2, LinkEnd::kServer);
  EXPECT_EQ(client.send, server.receive);
  EXPECT_EQ(client.receive, server.send);
  EXPECT_NE(client.send, client.receive);
  EXPECT_EQ(client.send, derive_frame_key(run, KeyPurpose::kDataDown, 2));
  const auto bytes = encode(data_frame(0, 1), client.send);
  EXPECT_TRUE(decode_frame(bytes.data(), bytes.size(), server.receive).ok());
  for (const FrameKey& other : {client.receive, link_keys(run, Channel::kData, 1, LinkEnd::kServer).receive,
                                link_keys(run, Channel::kControl, 2, LinkEnd::kServer).receive,
                                derive_frame_key(run, KeyPurpose::kInputLog, 3), run}) {
    EXPECT_EQ(decode_frame(bytes.data(), bytes.size(), other).error, FrameError::kBadMac);
  }
}

// Issue 12 item 3: a frame of another connection (session) or with a
// sequence number already used is rejected, and neither can be rewritten.
TEST(FrameTest, SessionAndSequenceAreChecked) {
  Frame f = make_control_frame(FrameType::kHeartbeat, test_run(), 0, 0, 0, "{}");
  f.session.fill(0x11);
  f.seq = 5;
  auto bytes = encode(f);
  FrameExpectation e;
  e.session = f.session;
  e.min_seq = 5;
  DecodeResult r = decode_frame(bytes.data(), bytes.size(), test_key(), e);
  ASSERT_TRUE(r.ok()) << r.reason;
  EXPECT_EQ(r.frame.session, f.session);
  EXPECT_EQ(r.frame.seq, 5u);
  e.min_seq = 6;
  r = decode_frame(bytes.data(), bytes.size(), test_key(), e);
  EXPECT_EQ(r.error, FrameError::kReplay);
  EXPECT_NE(r.reason.find("sequence number 5 was used already"), std::string::npos) << r.reason;
  e.min_seq = 0;
  e.session->fill(0x22);
  r = decode_frame(bytes.data(), bytes.size(), test_key(), e);
  EXPECT_EQ(r.error, FrameError::kWrongSession);
  bytes[96] = 9;  // the sequence number is authenticated
  EXPECT_EQ(decode_frame(bytes.data(), bytes.size(), test_key()).error, FrameError::kBadMac);
}

TEST(FrameTest, CorruptTagFails) {
  auto bytes = encode(data_frame(0, 1));
  bytes.back() ^= 0x80;
  EXPECT_EQ(decode_frame(bytes.data(), bytes.size(), test_key()).error, FrameError::kBadMac);
}

TEST(FrameTest, WrongKeyFailsMac) {
  const auto bytes = encode(data_frame(0, 1), test_key(7));
  const DecodeResult r = decode_frame(bytes.data(), bytes.size(), test_key(8));
  EXPECT_EQ(r.error, FrameError::kBadMac);
  EXPECT_EQ(r.reason.rfind("bad_mac:", 0), 0u) << r.reason;
}

TEST(FrameTest, TruncatedFramesAreRejected) {
  const auto bytes = encode(data_frame(0, 1));
  for (size_t n : {size_t{0}, size_t{3}, size_t{10}, size_t{127}, bytes.size() - 1}) {
    const DecodeResult r = decode_frame(bytes.data(), n, test_key());
    EXPECT_EQ(r.error, FrameError::kTruncated) << "size " << n << ": " << r.reason;
  }
  const DecodeResult r = decode_frame(bytes.data(), bytes.size() - 1, test_key());
  EXPECT_NE(r.reason.find("total_length is " + std::to_string(bytes.size())), std::string::npos)
      << r.reason;
}

TEST(FrameTest, TrailingBytesAreALengthMismatch) {
  auto bytes = encode(data_frame(0, 1));
  bytes.push_back(0);
  EXPECT_EQ(decode_frame(bytes.data(), bytes.size(), test_key()).error,
            FrameError::kLengthMismatch);
}

TEST(FrameTest, BadMagicIsRejected) {
  auto bytes = encode(data_frame(0, 1));
  bytes[0] = 'X';
  const DecodeResult r = decode_frame(bytes.data(), bytes.size(), test_key());
  EXPECT_EQ(r.error, FrameError::kBadMagic);
  EXPECT_NE(r.reason.find("ZLFR"), std::string::npos) << r.reason;
}

TEST(FrameTest, WrongVersionIsRejectedEvenWithAValidTag) {
  auto bytes = plain_frame(data_frame(0, 1));
  bytes[4] = 3;
  reseal(&bytes, test_key());
  DecodeResult r = decode_frame(bytes.data(), bytes.size(), test_key());
  EXPECT_EQ(r.error, FrameError::kBadVersion);
  EXPECT_NE(r.reason.find("version 3, this build speaks version 2"), std::string::npos) << r.reason;
  bytes[4] = 1;  // the MAC-only format before issue 12
  r = decode_frame(bytes.data(), bytes.size(), test_key());
  EXPECT_EQ(r.error, FrameError::kBadVersion);
  EXPECT_NE(r.reason.find("only MACed, not encrypted"), std::string::npos) << r.reason;
}

TEST(FrameTest, UnknownTypeIsRejected) {
  auto bytes = plain_frame(data_frame(0, 1));
  bytes[6] = 99;
  reseal(&bytes, test_key());
  const DecodeResult r = decode_frame(bytes.data(), bytes.size(), test_key());
  EXPECT_EQ(r.error, FrameError::kUnknownType);
  EXPECT_NE(r.reason.find("99"), std::string::npos) << r.reason;
}

TEST(FrameTest, OversizeIsRejectedFromTheHeaderAlone) {
  const auto bytes = encode(data_frame(0, 1, 1, 16, 64));
  FrameExpectation e;
  e.max_frame_bytes = 1024;
  // Only the header is passed: the limit must apply before the body is read.
  const DecodeResult r = decode_frame(bytes.data(), kFrameHeaderSize, test_key(), e);
  EXPECT_EQ(r.error, FrameError::kOversize);
  EXPECT_NE(r.reason.find("maximum of 1024"), std::string::npos) << r.reason;
  EXPECT_EQ(encode_frame(data_frame(0, 1, 1, 16, 64), test_key(), 1024).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(FrameTest, UnexpectedShapeIsRejected) {
  const auto bytes = encode(data_frame(0, 1, 1, 3, 4));
  const DecodeResult r = decode_frame(bytes.data(), bytes.size(), test_key(),
                                      shape_expectation(1, 3, 8));
  EXPECT_EQ(r.error, FrameError::kUnexpectedTensor);
  EXPECT_NE(r.reason.find("'hidden' has shape [1,3,4], expected [1,3,8]"), std::string::npos)
      << r.reason;
}

TEST(FrameTest, UnexpectedDtypeOrMissingTensorIsRejected) {
  Frame f = data_frame(0, 1, 1, 3, 4);
  f.tensors[2].dtype = DType::kInt32;  // labels int32: 3 elements need 12 bytes
  f.tensors[2].data.resize(12);
  auto bytes = encode(f);
  DecodeResult r = decode_frame(bytes.data(), bytes.size(), test_key(), shape_expectation(1, 3, 4));
  EXPECT_EQ(r.error, FrameError::kUnexpectedTensor);
  EXPECT_NE(r.reason.find("'labels' has dtype int32, expected int64"), std::string::npos)
      << r.reason;

  f = data_frame(0, 1, 1, 3, 4);
  f.tensors.pop_back();
  bytes = encode(f);
  r = decode_frame(bytes.data(), bytes.size(), test_key(), shape_expectation(1, 3, 4));
  EXPECT_EQ(r.error, FrameError::kUnexpectedTensor);
  EXPECT_NE(r.reason.find("no tensor 'labels'"), std::string::npos) << r.reason;
}

TEST(FrameTest, PayloadSizeThatContradictsTheShapeIsABadTensor) {
  auto bytes = plain_frame(data_frame(0, 1, 1, 3, 4));
  // First record: shape dim 2 at 128 + 16 + 6 ("hidden") + 16; make it 5.
  bytes[kFrameHeaderSize + 16 + 6 + 16] = 5;
  reseal(&bytes, test_key());
  const DecodeResult r = decode_frame(bytes.data(), bytes.size(), test_key());
  EXPECT_EQ(r.error, FrameError::kBadTensor);
  EXPECT_NE(r.reason.find("[1,3,5]"), std::string::npos) << r.reason;
}

TEST(FrameTest, LyingInnerLengthsAreRejectedWithoutOverreading) {
  auto bytes = plain_frame(data_frame(0, 1));
  bytes[56] = 0xff;  // json_length = 0xff... past the end
  bytes[57] = 0xff;
  reseal(&bytes, test_key());
  EXPECT_EQ(decode_frame(bytes.data(), bytes.size(), test_key()).error,
            FrameError::kLengthMismatch);

  bytes = plain_frame(data_frame(0, 1));
  bytes[36] = 200;  // tensor_count
  reseal(&bytes, test_key());
  EXPECT_EQ(decode_frame(bytes.data(), bytes.size(), test_key()).error,
            FrameError::kLengthMismatch);

  bytes = plain_frame(data_frame(0, 1));
  bytes[kFrameHeaderSize + 15] = 0x7f;  // payload_length of record 0: huge
  reseal(&bytes, test_key());
  EXPECT_EQ(decode_frame(bytes.data(), bytes.size(), test_key()).error,
            FrameError::kLengthMismatch);
}

TEST(FrameTest, InvalidJsonPayloadIsRejected) {
  // The encoder refuses it; a key holder could still sign it.
  const Frame f = make_control_frame(FrameType::kError, test_run(), 0, 0, 0, "{not json");
  EXPECT_EQ(encode_frame(f, test_key()).status().code(), StatusCode::kInvalidArgument);
  std::vector<uint8_t> bytes = plain_frame(make_control_frame(FrameType::kError, test_run(), 0, 0, 0, "{\"a\":\"xx\"}"));
  std::memcpy(bytes.data() + kFrameHeaderSize, "{not json", 9);
  reseal(&bytes, test_key());
  EXPECT_EQ(decode_frame(bytes.data(), bytes.size(), test_key()).error, FrameError::kBadPayload);
}

TEST(FrameTest, WrongRunAndWrongStageAreRejected) {
  const auto bytes = encode(data_frame(0, 1, 1, 3, 4, /*stage=*/0, test_run(5)));
  FrameExpectation e;
  e.run_id = test_run(6);
  DecodeResult r = decode_frame(bytes.data(), bytes.size(), test_key(), e);
  EXPECT_EQ(r.error, FrameError::kWrongRun);
  e.run_id = test_run(5);
  e.stage = 1;
  r = decode_frame(bytes.data(), bytes.size(), test_key(), e);
  EXPECT_EQ(r.error, FrameError::kWrongStage);
  EXPECT_NE(r.reason.find("stage 0, expected 1"), std::string::npos) << r.reason;
}

TEST(FrameTest, EncodeRejectsDataThatDoesNotMatchTheShape) {
  Frame f = data_frame(0, 1);
  f.tensors[0].data.pop_back();
  const Status s = encode_frame(f, test_key()).status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("'hidden'"), std::string::npos) << s.message();
}

// Random single-byte edits and truncations: the decoder must reject every
// altered frame and never read out of bounds (run under ASan to see it).
TEST(FrameTest, RandomCorruptionNeverCrashesAndIsAlwaysRejected) {
  const auto good = encode(data_frame(1, 2, 1, 4, 4));
  const auto good_plain = plain_frame(data_frame(1, 2, 1, 4, 4));
  std::mt19937 rng(1234);
  for (int i = 0; i < 3000; ++i) {
    // Every third edit is made to the plaintext and sealed again, to also exercise the parser.
    auto bytes = i % 3 == 0 ? good_plain : good;
    const size_t pos = rng() % (bytes.size() - (i % 3 == 0 ? kFrameTagSize : 0));
    const uint8_t flip = static_cast<uint8_t>(1 + rng() % 255);
    bytes[pos] ^= flip;
    if (i % 3 == 0) reseal(&bytes, test_key());
    const size_t size = (i % 5 == 0) ? rng() % bytes.size() : bytes.size();
    const DecodeResult r = decode_frame(bytes.data(), size, test_key());
    if (!r.ok()) {
      EXPECT_FALSE(r.reason.empty());
      continue;
    }
    // Only a re-sealed edit of a field without constraints may still decode.
    EXPECT_EQ(i % 3, 0) << "unsigned edit at " << pos << " was accepted";
  }
}

TEST(FrameTest, NamesAndHelpers) {
  EXPECT_STREQ(frame_type_name(20), "WINDOW_COMMITTED");
  EXPECT_STREQ(frame_type_name(3), "HELLO");
  EXPECT_STREQ(frame_type_name(4), "GRAD");
  EXPECT_EQ(frame_type_name(5), nullptr);
  FrameType t{};
  EXPECT_TRUE(parse_frame_type("heartbeat", &t));
  EXPECT_EQ(t, FrameType::kHeartbeat);
  EXPECT_STREQ(frame_error_name(FrameError::kUnexpectedTensor), "unexpected_tensor");
  EXPECT_STREQ(frame_error_name(FrameError::kWrongSession), "wrong_session");
  EXPECT_STREQ(frame_error_name(FrameError::kReplay), "replay");
  FrameKey k{};
  EXPECT_TRUE(parse_hex_key(std::string(64, 'a'), &k));
  EXPECT_EQ(k[0], 0xaa);
  EXPECT_FALSE(parse_hex_key("abc", &k));
  EXPECT_EQ(to_hex(k.data(), 2), "aaaa");
}


// --- The payload and tensor rule (PROTOCOL.md §5), issue 12 items 8 and 9 ---

constexpr size_t kMinFrameSizeForTests = kFrameHeaderSize + kFrameTagSize;

// A sealed frame from raw parts (the encoder refuses what the rule forbids).
std::vector<uint8_t> raw_frame(FrameType type, const std::string& json,
                               const std::vector<std::vector<uint8_t>>& records = {}) {
  Frame f = make_control_frame(type, test_run(), 0, 0, 0);
  std::vector<uint8_t> bytes = value_or_fail(encode_frame(f, test_key()));
  bytes.resize(kFrameHeaderSize);
  bytes.insert(bytes.end(), json.begin(), json.end());
  for (const auto& r : records) bytes.insert(bytes.end(), r.begin(), r.end());
  bytes.resize(bytes.size() + kFrameTagSize);
  const auto put32 = [&](size_t off, uint32_t v) {
    for (int i = 0; i < 4; ++i) bytes[off + i] = static_cast<uint8_t>(v >> (8 * i));
  };
  put32(8, static_cast<uint32_t>(bytes.size()));
  put32(36, static_cast<uint32_t>(records.size()));
  put32(56, static_cast<uint32_t>(json.size()));
  reseal(&bytes, test_key());
  return bytes;
}

std::vector<uint8_t> raw_record(uint8_t dtype, const std::string& name, const std::vector<uint64_t>& dims,
                                size_t payload) {
  std::vector<uint8_t> r(16, 0);
  r[0] = dtype;
  r[1] = static_cast<uint8_t>(dims.size());
  r[2] = static_cast<uint8_t>(name.size());
  r[3] = static_cast<uint8_t>(name.size() >> 8);
  for (int i = 0; i < 8; ++i) r[8 + i] = static_cast<uint8_t>(uint64_t{payload} >> (8 * i));
  r.insert(r.end(), name.begin(), name.end());
  for (uint64_t d : dims) {
    for (int i = 0; i < 8; ++i) r.push_back(static_cast<uint8_t>(d >> (8 * i)));
  }
  r.resize(r.size() + payload, 0x5a);
  return r;
}

FrameError decode_error(const std::vector<uint8_t>& bytes, std::string* reason = nullptr) {
  const DecodeResult r = decode_frame(bytes.data(), bytes.size(), test_key());
  if (reason) *reason = r.reason;
  return r.error;
}

TEST(FrameRuleTest, PayloadMustBeOneStrictJsonObject) {
  const std::vector<std::string> bad = {
      "[1]", "null", "1", "\"x\"", "{\"a\":NaN}", "{\"a\":Infinity}", "{\"a\":-Infinity}", "{\"a\":1e999}",
      "{\"a\":\"\\ud800\"}", "{\"a\":\"\\udc00\"}", "{\"a\":\"\\ud800\\u0041\"}", "{\"a\":\"\xed\xa0\x80\"}",
      "{\"a\":\"\xc0\x80\"}", "{\"a\":\"\xff\"}", std::string("{\"a\":1}\0", 8), "{\"a\":1} x",
      "\xef\xbb\xbf{}", "{\"a\":1,\"a\":2}", "{\"a\":1,\"\\u0061\":2}", "{\"a\":18446744073709551616}",
      "{\"a\":-9223372036854775809}", "{\"a\":\"x\x01\"}", "{\"a\":01}", "{\"a\":1.}", "{a:1}", "{\"a\":1,}"};
  for (const auto& json : bad) {
    std::string reason;
    EXPECT_EQ(decode_error(raw_frame(FrameType::kHeartbeat, json), &reason), FrameError::kBadPayload)
        << escape_bytes(json);
    EXPECT_EQ(check_frame_json(json.data(), json.size()).empty(), false) << escape_bytes(json);
    // Reasons never carry raw invalid bytes.
    for (unsigned char c : reason) EXPECT_TRUE(c >= 0x20 && c < 0x7f) << escape_bytes(reason);
  }
  const std::vector<std::string> good = {
      "", "{}", " {} ", "{\"a\":-0}", "{\"a\":1.5e-400}", "{\"a\":18446744073709551615}",
      "{\"a\":-9223372036854775808}", "{\"a\":\"\\ud83d\\ude00\"}", "{\"a\":\"\xf0\x9f\x98\x80\"}",
      "{\"a\":\"\\u0000\"}", "{\"a\":[1,2.5,\"x\",true,false,null,{}]}", "{\"A\":1,\"a\":2}"};
  for (const auto& json : good) {
    EXPECT_EQ(decode_error(raw_frame(FrameType::kHeartbeat, json)), FrameError::kNone) << json;
  }
}

TEST(FrameRuleTest, NestingIsLimited) {
  std::string ok, deep;
  for (int i = 0; i < kMaxFrameJsonDepth; ++i) ok += "{\"a\":";
  ok += "1" + std::string(kMaxFrameJsonDepth, '}');
  deep = "{\"a\":" + ok + "}";
  EXPECT_EQ(decode_error(raw_frame(FrameType::kHeartbeat, ok)), FrameError::kNone);
  EXPECT_EQ(decode_error(raw_frame(FrameType::kHeartbeat, deep)), FrameError::kBadPayload);
  // Far deeper than any stack: rejected, not a crash.
  const std::string very_deep = "{\"a\":" + std::string(200000, '[') + std::string(200000, ']') + "}";
  EXPECT_EQ(decode_error(raw_frame(FrameType::kHeartbeat, very_deep)), FrameError::kBadPayload);
  const std::string huge = "{\"a\":\"" + std::string(kMaxFrameJsonBytes, 'x') + "\"}";
  EXPECT_EQ(decode_error(raw_frame(FrameType::kHeartbeat, huge)), FrameError::kBadPayload);
}

TEST(FrameRuleTest, MalformedTensorNamesAreRejectedAndEscaped) {
  for (const std::string name : {std::string(""), std::string("\xff\xfe"), std::string("a\0b", 3),
                                 std::string("\x1b[31m"), std::string("\xed\xa0\x80")}) {
    std::string reason;
    EXPECT_EQ(decode_error(raw_frame(FrameType::kData, "", {raw_record(6, name, {1}, 1)}), &reason),
              FrameError::kBadTensor);
    for (unsigned char c : reason) EXPECT_TRUE(c >= 0x20 && c < 0x7f) << escape_bytes(reason);
  }
  // The name of a tensor with a bad shape used to go into the reason raw.
  std::string reason;
  EXPECT_EQ(decode_error(raw_frame(FrameType::kData, "", {raw_record(6, "ok\xc3", {2}, 1)}), &reason),
            FrameError::kBadTensor);
  EXPECT_NE(reason.find("ok\\xc3"), std::string::npos) << reason;
  EXPECT_EQ(escape_bytes(std::string("a\xff'\\\"", 5)), "a\\xff\\x27\\x5c\\x22");
  EXPECT_EQ(escape_bytes(std::string(100, 'x'), 4), "xxxx...");
}

TEST(FrameRuleTest, TwoTensorsWithOneNameAreRejected) {
  EXPECT_EQ(decode_error(raw_frame(FrameType::kData, "", {raw_record(6, "x", {1}, 1), raw_record(6, "x", {1}, 1)})),
            FrameError::kBadTensor);
  Frame f = data_frame(0, 1);
  f.tensors.push_back(f.tensors[0]);
  EXPECT_EQ(encode_frame(f, test_key()).status().code(), StatusCode::kInvalidArgument);
}

TEST(FrameRuleTest, ShapesThatOverflowAreRejected) {
  const uint64_t big = uint64_t{1} << 62;
  EXPECT_EQ(decode_error(raw_frame(FrameType::kData, "", {raw_record(6, "x", {big, big, 0}, 0)})),
            FrameError::kBadTensor);
  EXPECT_EQ(decode_error(raw_frame(FrameType::kData, "", {raw_record(1, "x", {big}, 0)})), FrameError::kBadTensor);
  EXPECT_EQ(decode_error(raw_frame(FrameType::kData, "", {raw_record(6, "x", {uint64_t{1} << 63, 0}, 0)})),
            FrameError::kBadTensor);
  // A zero dim makes numel 0 whatever the others are, within 2^63-1 bytes.
  EXPECT_EQ(decode_error(raw_frame(FrameType::kData, "", {raw_record(6, "x", {0, uint64_t{1} << 40}, 0)})),
            FrameError::kNone);
}

// 12,000 mutated frames (bit flips signed or not, truncations, extensions,
// lying length fields, spliced payloads): no crash (run it under
// -DZL_SANITIZE=ON), and every frame that decodes is exactly what the encoder
// writes for what was decoded, so nothing outside the rule gets through.
TEST(FrameRuleTest, FuzzedFramesDecodeOnlyWhenCanonical) {
  std::mt19937_64 rng(20261130);
  const std::vector<std::string> payloads = {"", "{}", "{\"a\":[1,2,{\"b\":null}],\"c\":\"\\u00e9\"}",
                                             "{\"micro_batches_done\":7,\"pss_mib\":12.5}"};
  std::vector<std::vector<uint8_t>> seeds;  // plaintext forms
  seeds.push_back(plain_frame(data_frame(1, 2, 1, 3, 4)));
  for (const auto& p : payloads) seeds.push_back(plain_frame(make_control_frame(FrameType::kHeartbeat, test_run(), 0, 1, 2, p)));
  size_t accepted = 0;
  for (int i = 0; i < 12000; ++i) {
    std::vector<uint8_t> bytes = seeds[rng() % seeds.size()];
    const size_t body = bytes.size() - kFrameTagSize;
    bool sign = true;
    switch (rng() % 6) {
      case 0:  // bit flips of the sealed frame
        reseal(&bytes, test_key());
        sign = false;
        [[fallthrough]];
      case 1:
        for (int k = 0, n = 1 + static_cast<int>(rng() % 4); k < n; ++k) bytes[rng() % body] ^= 1u << (rng() % 8);
        break;
      case 2:  // a length-like field set to something large or random
        for (size_t off : {size_t{8}, size_t{36}, size_t{56}}) {
          if (rng() % 2) continue;
          const uint32_t v = rng() % 2 ? 0xFFFFFFFFu : static_cast<uint32_t>(rng());
          for (int b = 0; b < 4; ++b) bytes[off + b] = static_cast<uint8_t>(v >> (8 * b));
        }
        break;
      case 3:  // truncated
        reseal(&bytes, test_key());
        bytes.resize(rng() % bytes.size());
        sign = false;
        break;
      case 4:  // extended
        reseal(&bytes, test_key());
        bytes.resize(bytes.size() + 1 + rng() % 64, static_cast<uint8_t>(rng()));
        sign = false;
        break;
      default:  // the payload bytes replaced by random printable-ish bytes
        for (size_t k = kFrameHeaderSize; k < body && k < kFrameHeaderSize + 40; ++k) {
          if (rng() % 4 == 0) bytes[k] = static_cast<uint8_t>("{}[]\",:0123456789.eE-+tfnul\\u\xff\x80"[rng() % 32]);
        }
        break;
    }
    if (sign && bytes.size() >= kMinFrameSizeForTests) reseal(&bytes, test_key());
    const DecodeResult r = decode_frame(bytes.data(), bytes.size(), test_key());
    if (!r.ok()) {
      ASSERT_FALSE(r.reason.empty());
      for (unsigned char c : r.reason) ASSERT_TRUE(c >= 0x20 && c < 0x7f) << escape_bytes(r.reason);
      continue;
    }
    ++accepted;
    Result<std::vector<uint8_t>> encoded = encode_frame(r.frame, test_key());
    ASSERT_TRUE(encoded.ok()) << i << ": " << encoded.status().message();
    std::vector<uint8_t> again = std::move(encoded).value();
    // The same plaintext sealed with the frame's nonce: byte for byte the frame.
    ASSERT_TRUE(open_frame(again.data(), again.size(), test_key()));
    std::copy(bytes.begin() + (kFrameHeaderSize - kFrameNonceSize), bytes.begin() + kFrameHeaderSize,
              again.begin() + (kFrameHeaderSize - kFrameNonceSize));
    reseal(&again, test_key());
    ASSERT_EQ(again, bytes) << "frame " << i << " decoded but is not what the encoder writes";
  }
  EXPECT_GT(accepted, 100u);
}

TEST(FrameRuleTest, EncoderRefusesWhatTheDecoderRejects) {
  EXPECT_EQ(encode_frame(make_control_frame(FrameType::kError, test_run(), 0, 0, 0, "[1]"), test_key()).status().code(),
            StatusCode::kInvalidArgument);
  Frame f = data_frame(0, 1);
  f.tensors[0].name = "\xff";
  EXPECT_EQ(encode_frame(f, test_key()).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace zl
