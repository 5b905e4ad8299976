// Status / Result<T> and the propagation macros: an error leaves the
// function with its code and message (plus a prefix where asked), success
// falls through, and the prefix is built only on the error path.
#include "zl/status.h"

#include <string>

#include <gtest/gtest.h>

namespace zl {
namespace {

Status fail_io() { return Status(StatusCode::kIoError, "disk gone"); }
Result<int> answer(bool good) {
  if (!good) return Status(StatusCode::kNotFound, "no answer");
  return 42;
}

Status propagate(bool good, int* steps) {
  ZL_RETURN_IF_ERROR(good ? Status() : fail_io());
  ++*steps;
  ZL_RETURN_IF_ERROR(answer(good));  // a Result works where a Status does
  ++*steps;
  return Status();
}

TEST(StatusTest, ReturnIfErrorStopsAtTheFirstError) {
  int steps = 0;
  EXPECT_TRUE(propagate(true, &steps).ok());
  EXPECT_EQ(steps, 2);
  steps = 0;
  const Status status = propagate(false, &steps);
  EXPECT_EQ(steps, 0);
  EXPECT_EQ(status.code(), StatusCode::kIoError);
  EXPECT_EQ(status.message(), "disk gone");
}

Status with_prefix(bool good, int* prefixes_built) {
  auto prefix = [&] {
    ++*prefixes_built;
    return std::string("checkpoint: ");
  };
  ZL_RETURN_IF_ERROR_WITH_PREFIX(good ? Status() : fail_io(), prefix());
  return Status();
}

TEST(StatusTest, PrefixIsAddedOnlyOnError) {
  int built = 0;
  EXPECT_TRUE(with_prefix(true, &built).ok());
  EXPECT_EQ(built, 0);
  const Status status = with_prefix(false, &built);
  EXPECT_EQ(built, 1);
  EXPECT_EQ(status.code(), StatusCode::kIoError);
  EXPECT_EQ(status.message(), "checkpoint: disk gone");
}

TEST(StatusTest, WithContextKeepsTheCode) {
  const Status status = Status(StatusCode::kCorrupt, "bad MAC").with_context("input log: ", " (entry 3)");
  EXPECT_EQ(status.code(), StatusCode::kCorrupt);
  EXPECT_EQ(status.message(), "input log: bad MAC (entry 3)");
}

Result<int> doubled(bool good) {
  ZL_ASSIGN_OR_RETURN(const int value, answer(good));
  return 2 * value;
}

TEST(StatusTest, AssignOrReturn) {
  Result<int> good = doubled(true);
  ASSERT_TRUE(good.ok()) << good.status().message();
  EXPECT_EQ(*good, 84);
  Result<int> bad = doubled(false);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(bad.status().message(), "no answer");
}

TEST(StatusTest, ResultFromAnOkStatusIsAnError) {
  // A value-less Result must never read as ok.
  Result<int> r = Status();
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

TEST(StatusTest, ValueOrFallsBackOnlyOnError) {
  EXPECT_EQ(answer(true).value_or(7), 42);
  EXPECT_EQ(answer(false).value_or(7), 7);
  const Result<std::string> bad = Status(StatusCode::kNotFound, "none");
  EXPECT_EQ(bad.value_or("fallback"), "fallback");
}

TEST(StatusTest, ResultMovesItsValueOut) {
  Result<std::string> r = std::string(1000, 'x');
  ASSERT_TRUE(r.ok());
  const std::string taken = std::move(r).value();
  EXPECT_EQ(taken.size(), 1000u);
}

}  // namespace
}  // namespace zl
