#include "zl/durable_file.h"

#include <atomic>

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace zl {
namespace {

Status io_error(const std::string& what, const std::string& path, int err) {
  if (err == ENOSPC || err == EDQUOT) {
    return Status(StatusCode::kIoError, what + " '" + path + "': the disk is full (" + std::strerror(err) +
                                            "); free space on this device");
  }
  return Status(err == ENOENT ? StatusCode::kNotFound : StatusCode::kIoError,
                what + " '" + path + "': " + std::strerror(err));
}

Status write_all(int fd, const std::string& path, const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::write(fd, p, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return io_error("cannot write", path, errno);
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
  return Status();
}

}  // namespace

Status write_file_synced(const std::string& path, const void* data, size_t size) {
  return write_file_synced(path, std::vector<std::pair<const void*, size_t>>{{data, size}});
}

Status write_file_synced(const std::string& path,
                         const std::vector<std::pair<const void*, size_t>>& parts) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return io_error("cannot create", path, errno);
  Status status;
  for (const auto& part : parts) {
    if (part.second == 0) continue;
    status = write_all(fd, path, part.first, part.second);
    if (!status.ok()) break;
  }
  if (status.ok() && ::fsync(fd) != 0) status = io_error("cannot fsync", path, errno);
  if (::close(fd) != 0 && status.ok()) status = io_error("cannot close", path, errno);
  return status;
}

std::atomic<uint64_t>& directories_synced_after_create() {
  static std::atomic<uint64_t> count{0};
  return count;
}

Status fsync_directory(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return io_error("cannot open directory", path, errno);
  Status status;
  if (::fsync(fd) != 0) status = io_error("cannot fsync directory", path, errno);
  ::close(fd);
  return status;
}

Result<std::string> read_file(const std::string& path) {
  std::string out;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return io_error("cannot open", path, errno);
  char buffer[1 << 16];
  Status status;
  while (true) {
    ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0) {
      if (errno == EINTR) continue;
      status = io_error("cannot read", path, errno);
      break;
    }
    if (n == 0) break;
    out.append(buffer, static_cast<size_t>(n));
  }
  ::close(fd);
  if (!status.ok()) return status;
  return out;
}

Result<std::vector<std::string>> list_directory(const std::string& path) {
  std::vector<std::string> names;
  DIR* dir = ::opendir(path.c_str());
  if (dir == nullptr) return io_error("cannot list directory", path, errno);
  while (dirent* entry = ::readdir(dir)) {
    std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(std::move(name));
  }
  ::closedir(dir);
  return names;
}

bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

Status remove_tree(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    return errno == ENOENT ? Status() : io_error("cannot stat", path, errno);
  }
  if (S_ISDIR(st.st_mode)) {
    ZL_ASSIGN_OR_RETURN(const std::vector<std::string> names, list_directory(path));
    for (const auto& name : names) {
      ZL_RETURN_IF_ERROR(remove_tree(path + "/" + name));
    }
    if (::rmdir(path.c_str()) != 0 && errno != ENOENT) return io_error("cannot remove directory", path, errno);
    return Status();
  }
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) return io_error("cannot remove", path, errno);
  return Status();
}

Status make_directories(const std::string& path) {
  if (path.empty()) return Status(StatusCode::kInvalidArgument, "make_directories: empty path");
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = path.find('/', pos + 1);
    std::string prefix = path.substr(0, pos);
    if (prefix.empty()) continue;
    if (::mkdir(prefix.c_str(), 0755) != 0) {
      if (errno == EEXIST) continue;
      return io_error("cannot create directory", prefix, errno);
    }
    // A new directory survives a crash only once its parent's entry is on disk.
    ZL_RETURN_IF_ERROR(fsync_directory(dir_of(prefix)));
    directories_synced_after_create().fetch_add(1);
  }
  if (!is_directory(path)) {
    return Status(StatusCode::kIoError, "'" + path + "' exists but is not a directory");
  }
  return Status();
}

std::string dir_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::string base_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

}  // namespace zl
