// A small status type for runner-core boundaries that need a reason string
// (ExecuTorch's `Error` is an enum without one), `Result<T>` for a value or
// that status, and the macros that propagate errors (the idiom of
// ExecuTorch's runtime/core/result.h, ET_UNWRAP / ET_CHECK_OK_OR_RETURN_ERROR,
// with our reason strings). No exceptions: callers test `ok()` and read
// `message()`. Both types are [[nodiscard]]: a dropped error is a compile
// warning; discard one on purpose with `(void)`.
#pragma once

#include <optional>
#include <string>
#include <utility>

namespace zl {

/// What went wrong, coarse enough for callers to branch on.
enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument,  ///< caller passed a bad value
  kNotFound,         ///< file / entry absent
  kIoError,          ///< read/write/fsync/rename/socket failure
  kCorrupt,          ///< stored or received bytes failed validation (MAC, size)
  kTimeout,          ///< a blocking call hit its deadline
  kClosed,           ///< the object was shut down
  kInternal,
  kUnrecoverable,    ///< a restart cannot fix it (the stage exits 2; the coordinator does not retry)
};

/// Success, or a code plus a human-readable reason naming the bad value.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status ok_status() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  /// The same code with `prefix` + message + `suffix`: adds the caller's
  /// context (a file, a peer) to an error from below.
  Status with_context(const std::string& prefix, const std::string& suffix = "") const {
    return Status(code_, prefix + message_ + suffix);
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

/// A value, or the Status saying why there is none.
template <typename T>
class [[nodiscard]] Result {
 public:
  /// Success.
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit, as ExecuTorch's Result
  /// Failure; `status` must not be ok (an ok one becomes kInternal).
  Result(Status status)  // NOLINT: implicit, so `return Status(...)` works
      : status_(status.ok() ? Status(StatusCode::kInternal, "Result built from an ok Status without a value")
                            : std::move(status)) {}

  bool ok() const { return value_.has_value(); }
  const Status& status() const& { return status_; }
  Status status() && { return std::move(status_); }

  /// The value; only after ok().
  const T& value() const& { return *value_; }
  T& value() & { return *value_; }
  T value() && { return std::move(*value_); }
  const T& operator*() const& { return *value_; }
  T& operator*() & { return *value_; }
  const T* operator->() const { return &*value_; }
  T* operator->() { return &*value_; }

  /// The value, or `fallback` when there is none (the error is dropped).
  T value_or(T fallback) const& { return value_.has_value() ? *value_ : std::move(fallback); }
  T value_or(T fallback) && { return value_.has_value() ? std::move(*value_) : std::move(fallback); }

 private:
  std::optional<T> value_;
  Status status_;
};

namespace internal {
inline const Status& status_of(const Status& status) { return status; }
template <typename T>
const Status& status_of(const Result<T>& result) { return result.status(); }
}  // namespace internal

}  // namespace zl

#define ZL_STATUS_CONCAT_INNER_(a, b) a##b
#define ZL_STATUS_CONCAT_(a, b) ZL_STATUS_CONCAT_INNER_(a, b)

/// Returns the Status of `expr` (a Status or a Result<T>) from the enclosing
/// function if it is an error.
#define ZL_RETURN_IF_ERROR(expr)                                          \
  do {                                                                    \
    const auto& zl_status_or_result_ = (expr);                            \
    if (!zl_status_or_result_.ok()) {                                     \
      return ::zl::internal::status_of(zl_status_or_result_);             \
    }                                                                     \
  } while (0)

/// As ZL_RETURN_IF_ERROR, with `prefix` put before the error's message
/// (evaluated only on error): ZL_RETURN_IF_ERROR_WITH_PREFIX(read_file(p, &t), "config: ").
#define ZL_RETURN_IF_ERROR_WITH_PREFIX(expr, prefix)                          \
  do {                                                                        \
    const auto& zl_status_or_result_ = (expr);                                \
    if (!zl_status_or_result_.ok()) {                                         \
      return ::zl::internal::status_of(zl_status_or_result_).with_context(prefix); \
    }                                                                         \
  } while (0)

/// `lhs = value of expr` (a Result<T>), or returns its Status from the
/// enclosing function: ZL_ASSIGN_OR_RETURN(const HostPort peer, parse_host_port(text)).
#define ZL_ASSIGN_OR_RETURN(lhs, expr) \
  ZL_ASSIGN_OR_RETURN_IMPL_(ZL_STATUS_CONCAT_(zl_result_, __LINE__), lhs, expr)
#define ZL_ASSIGN_OR_RETURN_IMPL_(result, lhs, expr) \
  auto result = (expr);                              \
  if (!result.ok()) return std::move(result).status(); \
  lhs = std::move(result).value()
