// A small status type for runner-core boundaries that need a reason string
// (ExecuTorch's `Error` is an enum without one). No exceptions: callers test
// `ok()` and read `message()`.
#pragma once

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
};

/// Success, or a code plus a human-readable reason naming the bad value.
class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status ok_status() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

}  // namespace zl
