// Helpers shared by the transport tests (frame, input log, peer link).
#pragma once

#include <dirent.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "zl/frame.h"
#include "status_test_support.h"

namespace zl::testing {

inline FrameKey test_key(uint8_t seed = 7) {
  FrameKey k{};
  for (size_t i = 0; i < k.size(); ++i) k[i] = static_cast<uint8_t>(seed + 13 * i);
  return k;
}

inline RunId test_run(uint8_t seed = 1) {
  RunId r{};
  for (size_t i = 0; i < r.size(); ++i) r[i] = static_cast<uint8_t>(seed * 31 + i);
  return r;
}

/// A DATA frame with recognisable values: hidden[i] = mb + i / 8,
/// mask alternates 1/0, labels[i] = i - 1.
inline Frame data_frame(uint64_t window, uint64_t mb, int64_t b = 1, int64_t s = 3,
                        int64_t d = 4, uint32_t stage = 0, RunId run = test_run()) {
  std::vector<float> hidden(static_cast<size_t>(b * s * d));
  std::vector<int64_t> mask(static_cast<size_t>(b * s)), labels(mask.size());
  for (size_t i = 0; i < hidden.size(); ++i) hidden[i] = static_cast<float>(mb) + i / 8.0f;
  for (size_t i = 0; i < mask.size(); ++i) {
    mask[i] = (i + 1) % 2;
    labels[i] = static_cast<int64_t>(i) - 1;
  }
  return make_data_frame(run, stage, window, mb, b, s, d, hidden.data(), mask.data(), labels.data());
}

/// A frame's plaintext form (encoded, then opened): a test edits it, then
/// reseal()s it -- a frame altered by a holder of the key.
inline std::vector<uint8_t> plain_frame(const Frame& f, const FrameKey& key = test_key()) {
  std::vector<uint8_t> bytes = value_or_fail(encode_frame(f, key));
  EXPECT_TRUE(open_frame(bytes.data(), bytes.size(), key));
  return bytes;
}

/// Seals a plaintext form again after a test edited it on purpose.
inline void reseal(std::vector<uint8_t>* bytes, const FrameKey& key) {
  seal_frame(bytes->data(), bytes->size(), key);
}

/// A fresh directory under $TMPDIR (or /tmp), removed by the destructor.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base ? base : "/tmp") + "/zl-net-test-XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    path_ = ::mkdtemp(buf.data()) ? std::string(buf.data()) : std::string();
  }
  ~TempDir() { remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  static void remove_all(const std::string& path) {
    if (path.empty()) return;
    if (DIR* d = ::opendir(path.c_str())) {
      while (dirent* e = ::readdir(d)) {
        const std::string name = e->d_name;
        if (name == "." || name == "..") continue;
        const std::string child = path + "/" + name;
        struct stat st {};
        if (::lstat(child.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
          remove_all(child);
        } else {
          ::unlink(child.c_str());
        }
      }
      ::closedir(d);
    }
    ::rmdir(path.c_str());
  }
  std::string path_;
};

}  // namespace zl::testing
