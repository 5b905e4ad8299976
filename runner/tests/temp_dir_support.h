// A scratch directory for one test, removed with everything in it at scope
// exit. Lives under $TMPDIR (or /tmp).
#pragma once

#include <cstdlib>
#include <fstream>
#include <string>

#include "zl/durable_file.h"

namespace zl_test {

class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string pattern = std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/zl_test_XXXXXX";
    if (::mkdtemp(&pattern[0]) != nullptr) path_ = pattern;
  }
  ~TempDir() {
    if (!path_.empty()) (void)zl::remove_tree(path_);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  /// Absolute path of the directory (empty if mkdtemp failed).
  const std::string& path() const { return path_; }
  /// path() + "/" + relative.
  std::string file(const std::string& relative) const { return path_ + "/" + relative; }

 private:
  std::string path_;
};

/// Writes `text` to `path` (creating parent directories), for fake trees.
inline void write_text(const std::string& path, const std::string& text) {
  const size_t slash = path.rfind('/');
  if (slash != std::string::npos && slash > 0) (void)zl::make_directories(path.substr(0, slash));
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

}  // namespace zl_test
