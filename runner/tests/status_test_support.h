// GoogleTest helpers for Status / Result<T> (the absl idiom): a test reads a
// Result's value in one line and fails, naming the error, when there is none.
#pragma once

#include <utility>

#include <gtest/gtest.h>

#include "zl/status.h"

/// `lhs = value of expr` (a Result<T>), or fails the test with the error's
/// message and returns from the enclosing void function (as ASSERT_TRUE).
#define ASSERT_OK_AND_ASSIGN(lhs, expr) \
  ZL_ASSERT_OK_AND_ASSIGN_IMPL_(ZL_STATUS_CONCAT_(zl_test_result_, __LINE__), lhs, expr)
#define ZL_ASSERT_OK_AND_ASSIGN_IMPL_(result, lhs, expr)            \
  auto result = (expr);                                            \
  ASSERT_TRUE(result.ok()) << result.status().message();           \
  lhs = std::move(result).value()

namespace zl::testing {

/// The value of `result`; where there is none, records a test failure (as
/// EXPECT_TRUE, naming the error) and returns T{}. For helpers that cannot
/// use ASSERT_* (constructors, non-void functions).
template <typename T>
T value_or_fail(Result<T> result) {
  EXPECT_TRUE(result.ok()) << result.status().message();
  if (!result.ok()) return T{};
  return std::move(result).value();
}

}  // namespace zl::testing
