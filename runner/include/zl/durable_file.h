// POSIX file helpers for crash-safe writes (checkpoints): write everything,
// fsync files and directories, read a whole file. Plain open/write/fsync so
// they behave the same on Linux and Android (bionic).
#pragma once

#include <cstddef>
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "zl/status.h"

namespace zl {

/// Writes `size` bytes to a fresh file `path` (O_TRUNC), retrying short
/// writes and EINTR, then fsyncs and closes it. Does not fsync the directory.
Status write_file_synced(const std::string& path, const void* data, size_t size);

/// Writes several buffers back to back into a fresh file, then fsyncs it.
/// Avoids concatenating a large tensor payload in memory.
Status write_file_synced(const std::string& path, const std::vector<std::pair<const void*, size_t>>& parts);

/// fsyncs a directory so that entries created, renamed or removed in it
/// survive power loss.
Status fsync_directory(const std::string& path);

/// The whole of `path`; kNotFound if it does not exist.
Result<std::string> read_file(const std::string& path);

/// The names in directory `path` (without "." and ".."), in readdir order;
/// kNotFound if the directory does not exist.
Result<std::vector<std::string>> list_directory(const std::string& path);

/// Removes `path` and, if it is a directory, everything below it.
/// A missing path is not an error.
Status remove_tree(const std::string& path);

/// True if `path` exists and is a directory.
[[nodiscard]] bool is_directory(const std::string& path);

/// mkdir -p; existing directories are fine.
Status make_directories(const std::string& path);

/// How many directories make_directories created and made durable (their
/// parent fsynced), process-wide; for tests.
std::atomic<uint64_t>& directories_synced_after_create();

/// "a/b/c.pte" -> "a/b"; "c.pte" -> "."; "/c" -> "/".
std::string dir_of(const std::string& path);

/// "a/b/c.pte" -> "c.pte".
std::string base_of(const std::string& path);

}  // namespace zl
