#include "zl/input_log.h"

#include "zl/durable_file.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <algorithm>
#include <cstring>

#include "zl/log.h"

namespace zl {
namespace {

Status errno_status(const std::string& what) {
  if (errno == ENOSPC || errno == EDQUOT) {
    return Status(StatusCode::kIoError, what + ": the disk is full (" + std::strerror(errno) +
                                            "); free space on this device for the input log");
  }
  return Status(StatusCode::kIoError, what + ": " + std::strerror(errno));
}

Status make_dirs(const std::string& dir) { return make_directories(dir); }

Status fsync_path(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  if (fd < 0) return errno_status("open " + path);
  const int rc = ::fsync(fd);
  const int saved = errno;
  ::close(fd);
  errno = saved;
  if (rc != 0) return errno_status("fsync " + path);
  return Status();
}

std::string parent_dir(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Parses "entry-<mb>-w<window>.zlf".
bool parse_entry_name(const std::string& name, uint64_t* mb, uint64_t* window) {
  unsigned long long a = 0, b = 0;
  int consumed = 0;
  if (std::sscanf(name.c_str(), "entry-%20llu-w%20llu.zlf%n", &a, &b, &consumed) != 2) return false;
  if (static_cast<size_t>(consumed) != name.size()) return false;
  *mb = a;
  *window = b;
  return true;
}

}  // namespace

Result<std::vector<uint8_t>> read_file_bytes(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return Status(StatusCode::kNotFound, path + " does not exist");
    return errno_status("open " + path);
  }
  std::vector<uint8_t> out;
  uint8_t chunk[64 * 1024];
  for (;;) {
    const ssize_t n = ::read(fd, chunk, sizeof(chunk));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int saved = errno;
      ::close(fd);
      errno = saved;
      return errno_status("read " + path);
    }
    if (n == 0) break;
    out.insert(out.end(), chunk, chunk + n);
  }
  ::close(fd);
  return out;
}

Status write_file_durably(const std::string& path, const uint8_t* bytes, size_t size) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return errno_status("open " + tmp);
  size_t written = 0;
  while (written < size) {
    const ssize_t n = ::write(fd, bytes + written, size - written);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int saved = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      errno = saved;
      return errno_status("write " + tmp);
    }
    written += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    const int saved = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    errno = saved;
    return errno_status("fsync " + tmp);
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int saved = errno;
    ::unlink(tmp.c_str());
    errno = saved;
    return errno_status("rename " + tmp + " -> " + path);
  }
  // The rename is durable only once the directory entry is on disk.
  return fsync_path(parent_dir(path), O_RDONLY | O_DIRECTORY);
}

InputLog::InputLog(std::string dir, FrameKey key, FrameExpectation expect)
    : dir_(std::move(dir)), key_(key), expect_(std::move(expect)) {
  while (dir_.size() > 1 && dir_.back() == '/') dir_.pop_back();
}

std::string InputLog::path_for(uint64_t window, uint64_t micro_batch) const {
  char name[80];
  std::snprintf(name, sizeof(name), "entry-%020" PRIu64 "-w%020" PRIu64 ".zlf", micro_batch, window);
  return dir_ + "/" + name;
}

Status InputLog::sync_dir() const { return fsync_path(dir_, O_RDONLY | O_DIRECTORY); }

Status InputLog::open() {
  ZL_RETURN_IF_ERROR(make_dirs(dir_));
  std::vector<std::string> names;
  DIR* d = ::opendir(dir_.c_str());
  if (!d) return errno_status("opendir " + dir_);
  while (dirent* e = ::readdir(d)) names.emplace_back(e->d_name);
  ::closedir(d);

  std::lock_guard<std::mutex> lock(mutex_);
  entries_.clear();
  corrupt_.clear();
  for (const std::string& name : names) {
    const std::string path = dir_ + "/" + name;
    if (ends_with(name, ".tmp")) {
      // An append that crashed before its rename: it was never acknowledged.
      ::unlink(path.c_str());
      continue;
    }
    uint64_t mb = 0, window = 0;
    if (!parse_entry_name(name, &mb, &window)) continue;  // .corrupt and foreign files
    const Result<std::vector<uint8_t>> bytes = read_file_bytes(path);
    std::string reason;
    if (!bytes.ok()) {
      reason = bytes.status().message();
    } else {
      const DecodeResult r = decode_frame(bytes->data(), bytes->size(), key_, expect_);
      if (!r.ok()) {
        reason = r.reason;
      } else if (r.frame.micro_batch != mb || r.frame.window != window) {
        reason = "frame ids (window " + std::to_string(r.frame.window) + ", micro-batch " +
                 std::to_string(r.frame.micro_batch) + ") differ from the file name";
      }
    }
    if (!reason.empty()) {
      log(LogLevel::kError, "input log: %s is corrupt (%s); moved aside", path.c_str(),
          reason.c_str());
      ::rename(path.c_str(), (path + ".corrupt").c_str());
      corrupt_.push_back({path, reason});
      continue;
    }
    entries_[mb] = InputLogEntry{mb, window, path, bytes->size()};
  }
  // Files moved aside are kept for a post-mortem, but not forever: the newest
  // kMaxCorruptFilesKept stay (names order by micro-batch).
  std::vector<std::string> aside;
  if (DIR* d2 = ::opendir(dir_.c_str())) {
    while (dirent* e = ::readdir(d2)) {
      if (ends_with(e->d_name, ".corrupt")) aside.emplace_back(e->d_name);
    }
    ::closedir(d2);
  }
  std::sort(aside.begin(), aside.end());
  for (size_t i = 0; i + kMaxCorruptFilesKept < aside.size(); ++i) {
    ::unlink((dir_ + "/" + aside[i]).c_str());
  }
  return sync_dir();
}

Status InputLog::append(uint64_t window, uint64_t micro_batch,
                        const std::vector<uint8_t>& frame_bytes) {
  const std::string path = path_for(window, micro_batch);
  ZL_RETURN_IF_ERROR(write_file_durably(path, frame_bytes.data(), frame_bytes.size()));
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find(micro_batch);
  if (it != entries_.end() && it->second.path != path) ::unlink(it->second.path.c_str());
  entries_[micro_batch] = InputLogEntry{micro_batch, window, path, frame_bytes.size()};
  return Status();
}

Status InputLog::append_frame(const Frame& frame) {
  Frame entry = frame;
  entry.session = SessionId{};
  entry.seq = 0;
  ZL_ASSIGN_OR_RETURN(const std::vector<uint8_t> bytes, encode_frame(entry, key_, expect_.max_frame_bytes));
  return append(frame.window, frame.micro_batch, bytes);
}

bool InputLog::contains(uint64_t micro_batch) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return entries_.count(micro_batch) != 0;
}

Result<Frame> InputLog::read(uint64_t micro_batch) const {
  std::string path;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(micro_batch);
    if (it == entries_.end()) {
      return Status(StatusCode::kNotFound,
                    "micro-batch " + std::to_string(micro_batch) + " is not in " + dir_);
    }
    path = it->second.path;
  }
  ZL_ASSIGN_OR_RETURN(const std::vector<uint8_t> bytes, read_file_bytes(path));
  DecodeResult r = decode_frame(bytes.data(), bytes.size(), key_, expect_);
  if (!r.ok()) return Status(StatusCode::kCorrupt, path + ": " + r.reason);
  return std::move(r.frame);
}

std::vector<InputLogEntry> InputLog::entries() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<InputLogEntry> out;
  out.reserve(entries_.size());
  for (const auto& kv : entries_) out.push_back(kv.second);
  return out;
}

std::vector<CorruptLogFile> InputLog::corrupt() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return corrupt_;
}

Status InputLog::delete_through(uint64_t window) {
  // Entries moved aside as corrupt go with their window.
  if (DIR* d = ::opendir(dir_.c_str())) {
    std::vector<std::string> done;
    while (dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      uint64_t mb = 0, w = 0;
      if (ends_with(name, ".corrupt") && parse_entry_name(name.substr(0, name.size() - 8), &mb, &w) &&
          w <= window) {
        done.push_back(dir_ + "/" + name);
      }
    }
    ::closedir(d);
    for (const auto& path : done) ::unlink(path.c_str());
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (it->second.window <= window) {
        if (::unlink(it->second.path.c_str()) != 0 && errno != ENOENT) {
          return errno_status("unlink " + it->second.path);
        }
        it = entries_.erase(it);
      } else {
        ++it;
      }
    }
  }
  return sync_dir();
}

size_t InputLog::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return entries_.size();
}

}  // namespace zl
