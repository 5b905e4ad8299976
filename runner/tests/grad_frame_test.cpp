// GRAD frames (issue 39 item 2): bf16 narrowing (round to nearest even) and
// widening, the (B,S,D) check on both the decoder and the accessor side.
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include "net_test_support.h"
#include "zl/frame.h"

namespace zl {
namespace {

using testing::test_key;
using testing::test_run;
using testing::value_or_fail;

float bits_to_float(uint32_t bits) {
  float f = 0;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

TEST(GradFrameTest, Bf16RoundsToNearestEvenAndWidensExactly) {
  EXPECT_EQ(bf16_from_f32(1.0f), 0x3F80);
  EXPECT_EQ(bf16_from_f32(1.00390625f), 0x3F80);  // a tie: down to the even 0x3F80
  EXPECT_EQ(bf16_from_f32(1.01171875f), 0x3F82);  // a tie: up to the even 0x3F82
  EXPECT_EQ(bf16_from_f32(bits_to_float(0x3F808001)), 0x3F81);  // just above the tie
  EXPECT_EQ(bf16_from_f32(-1.00390625f), 0xBF80);
  EXPECT_EQ(bf16_from_f32(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(bf16_from_f32(3.4e38f), 0x7F80);  // past bf16's largest finite
  EXPECT_TRUE(std::isnan(f32_from_bf16(bf16_from_f32(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(f32_from_bf16(bf16_from_f32(bits_to_float(0x7F800001)))));  // a NaN never rounds to inf
  for (uint32_t h = 0; h < 0x10000; h += 7) {  // widen then narrow is the identity on bf16 values
    if ((h & 0x7FFF) > 0x7F80) continue;  // NaNs
    EXPECT_EQ(bf16_from_f32(f32_from_bf16(static_cast<uint16_t>(h))), static_cast<uint16_t>(h));
  }
}

TEST(GradFrameTest, RoundTripsInBothWireDtypes) {
  constexpr int64_t b = 2, s = 3, d = 4;
  std::vector<float> grad(b * s * d);
  for (size_t i = 0; i < grad.size(); ++i) grad[i] = (static_cast<float>(i) - 11.3f) * 1.0e-3f;
  for (const DType wire : {DType::kBFloat16, DType::kFloat32}) {
    const Frame f = value_or_fail(make_grad_frame(test_run(), 2, 5, 17, b, s, d, grad.data(), wire));
    const std::vector<uint8_t> bytes = value_or_fail(encode_frame(f, test_key()));
    EXPECT_EQ(bytes.size(), 195 + grad.size() * dtype_size(static_cast<uint8_t>(wire)));
    FrameExpectation expect;
    expect.batch = b;
    expect.seq_len = s;
    expect.hidden_size = d;
    const DecodeResult r = decode_frame(bytes.data(), bytes.size(), test_key(), expect);
    ASSERT_TRUE(r.ok()) << r.reason;
    EXPECT_EQ(r.frame.type, FrameType::kGrad);
    EXPECT_EQ(r.frame.window, 5u);
    EXPECT_EQ(r.frame.micro_batch, 17u);
    const std::vector<float> got = value_or_fail(grad_hidden_f32(r.frame, b, s, d));
    for (size_t i = 0; i < grad.size(); ++i) {
      const float want = wire == DType::kFloat32 ? grad[i] : f32_from_bf16(bf16_from_f32(grad[i]));
      EXPECT_EQ(got[i], want) << i;
      EXPECT_LE(std::fabs(got[i] - grad[i]), std::fabs(grad[i]) / 256) << i;  // half a bf16 ulp
    }
  }
}

TEST(GradFrameTest, AGradThatIsNotBSDFloatIsRefused) {
  constexpr int64_t b = 1, s = 3, d = 4;
  std::vector<float> grad(b * s * d, 0.5f);
  const Frame good = value_or_fail(make_grad_frame(test_run(), 1, 0, 0, b, s, d, grad.data()));
  FrameExpectation expect;
  expect.batch = b;
  expect.seq_len = s;
  expect.hidden_size = d;
  struct Case {
    const char* words;
    Frame frame;
  };
  std::vector<Case> cases;
  Frame f = good;
  f.tensors[0].dtype = DType::kInt32;
  f.tensors[0].data.resize(b * s * d * 4);
  cases.push_back({"dtype int32, expected bfloat16 or float32", f});
  f = good;
  f.tensors[0].shape = {1, 4, 3};
  cases.push_back({"shape [1,4,3], expected [1,3,4]", f});
  f = good;
  f.tensors[0].shape = {3, 4};
  cases.push_back({"shape [3,4], expected [1,3,4]", f});
  f = good;
  f.tensors[0].name = "hidden";
  cases.push_back({"no tensor 'grad_hidden'", f});
  f = good;
  f.tensors.push_back({"labels", DType::kInt64, {1, 3}, std::vector<uint8_t>(24)});
  cases.push_back({"2 tensors, expected 1", f});
  for (const Case& c : cases) {
    const std::vector<uint8_t> bytes = value_or_fail(encode_frame(c.frame, test_key()));
    const DecodeResult r = decode_frame(bytes.data(), bytes.size(), test_key(), expect);
    EXPECT_EQ(r.error, FrameError::kUnexpectedTensor) << c.words;
    EXPECT_NE(r.reason.find(c.words), std::string::npos) << r.reason;
    const Result<std::vector<float>> widened = grad_hidden_f32(c.frame, b, s, d);
    ASSERT_FALSE(widened.ok()) << c.words;
    EXPECT_NE(widened.status().message().find(c.words), std::string::npos) << widened.status().message();
  }
  const Result<std::vector<float>> not_grad = grad_hidden_f32(testing::data_frame(0, 0), b, s, d);
  EXPECT_NE(not_grad.status().message().find("expected a GRAD frame, got DATA"), std::string::npos);
  const Result<Frame> f16 = make_grad_frame(test_run(), 1, 0, 0, b, s, d, grad.data(), DType::kFloat16);
  EXPECT_NE(f16.status().message().find("GRAD wire dtype float16 is not supported"), std::string::npos);
  EXPECT_FALSE(make_grad_frame(test_run(), 1, 0, 0, 0, s, d, grad.data()).ok());
}

// Issue 56 item 5: a gradient that is not finite is refused on receipt, blaming its sender; a finite float32
// past bfloat16's range (which the sender's own check lets through) arrives as inf on the bf16 wire.
TEST(GradFrameTest, ANonFiniteGradientIsRefusedOnReceiptNamingTheSender) {
  constexpr int64_t b = 1, s = 2, d = 4;
  std::vector<float> grad(b * s * d, 1.0e-3f);
  const auto received = [&](DType wire) {
    const Frame f = value_or_fail(make_grad_frame(test_run(), 2, 0, 9, b, s, d, grad.data(), wire));
    FrameExpectation expect;
    expect.batch = b;
    expect.seq_len = s;
    expect.hidden_size = d;
    const std::vector<uint8_t> bytes = value_or_fail(encode_frame(f, test_key()));
    const DecodeResult r = decode_frame(bytes.data(), bytes.size(), test_key(), expect);
    EXPECT_TRUE(r.ok()) << r.reason;  // a valid frame: its values are the receiver's business
    return value_or_fail(grad_hidden_f32(r.frame, b, s, d));
  };
  for (const DType wire : {DType::kBFloat16, DType::kFloat32}) EXPECT_EQ(non_finite_grad(received(wire), 2, 9), "");
  grad[5] = std::numeric_limits<float>::quiet_NaN();
  for (const DType wire : {DType::kBFloat16, DType::kFloat32}) {
    const std::string why = non_finite_grad(received(wire), 2, 9);
    EXPECT_NE(why.find("the gradient stage 2 sent for micro-batch 9 holds "), std::string::npos) << why;
    EXPECT_NE(why.find("nan at element 5 (stage 2 diverged; refused on receipt)"), std::string::npos) << why;
  }
  grad[5] = 3.4e38f;  // finite in float32
  EXPECT_EQ(non_finite_grad(received(DType::kFloat32), 2, 9), "");
  EXPECT_NE(non_finite_grad(received(DType::kBFloat16), 2, 9).find("holds inf at element 5"), std::string::npos);
  grad[5] = -std::numeric_limits<float>::infinity();
  EXPECT_NE(non_finite_grad(received(DType::kFloat32), 2, 9).find("holds -inf at element 5"), std::string::npos);
}

}  // namespace
}  // namespace zl
