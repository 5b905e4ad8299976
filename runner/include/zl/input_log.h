// Durable inbound log of a stage (docs/design#runner): every DATA entry from
// upstream is stored here before it is acknowledged, and stays until the
// window it belongs to is committed. After a crash the stage restores its
// checkpoint and replays the entries after it from this log.
//
// One file per entry, `entry-<micro_batch>-w<window>.zlf` (decimal, zero
// padded to 20 digits), holding the frame as received, sealed again under the
// stage's input log key (KeyPurpose::kInputLog) outside any session: it is
// encrypted at rest, its tag detects corruption on disk, and a restarted
// stage (a new session) can still open it. Writes go to `.tmp`, are fsynced, renamed
// into place, then the directory is fsynced.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "zl/frame.h"
#include "zl/status.h"

namespace zl {

/// One durable entry (the frame's window and micro-batch ids).
struct InputLogEntry {
  uint64_t micro_batch = 0;
  uint64_t window = 0;
  std::string path;
  size_t bytes = 0;
};

/// A file found on open() that failed validation; it is renamed to
/// `<name>.corrupt` so it is neither replayed nor re-reported.
/// At most this many `.corrupt` files stay in a log folder (the newest); the
/// ones of committed windows go with them.
constexpr size_t kMaxCorruptFilesKept = 8;

struct CorruptLogFile {
  std::string path;
  std::string reason;
};

/// Thread-safe; all methods may be called from the receiver and the consumer.
class InputLog {
 public:
  /// `key` is the log key (derive_frame_key(run key, kInputLog, stage));
  /// `expect` is applied to every stored frame on open() and read().
  InputLog(std::string dir, FrameKey key, FrameExpectation expect = {});

  /// Creates the directory if needed, removes leftover `.tmp` files and
  /// indexes (and verifies) the entries already there.
  Status open();

  /// Stores one encoded frame durably; returns once it is fsynced and renamed.
  /// An existing entry for `micro_batch` is overwritten.
  Status append(uint64_t window, uint64_t micro_batch, const std::vector<uint8_t>& frame_bytes);

  /// Seals `frame` under this log's key (no session, sequence 0) and stores
  /// it as append() does.
  Status append_frame(const Frame& frame);

  bool contains(uint64_t micro_batch) const;

  /// Reads and re-verifies one entry. kNotFound if absent, kCorrupt if the
  /// file no longer verifies.
  Result<Frame> read(uint64_t micro_batch) const;

  /// Entries ordered by micro-batch id.
  std::vector<InputLogEntry> entries() const;

  /// Files rejected by the last open().
  std::vector<CorruptLogFile> corrupt() const;

  /// Deletes every entry whose window is <= `window` (it is committed).
  Status delete_through(uint64_t window);

  size_t size() const;
  const std::string& dir() const { return dir_; }
  /// Path an entry has (or would have) on disk.
  std::string path_for(uint64_t window, uint64_t micro_batch) const;

 private:
  Status sync_dir() const;

  std::string dir_;
  FrameKey key_;
  FrameExpectation expect_;
  mutable std::mutex mutex_;
  std::map<uint64_t, InputLogEntry> entries_;  // by micro_batch
  std::vector<CorruptLogFile> corrupt_;
};

/// Reads a whole file; kNotFound / kIoError on failure.
Result<std::vector<uint8_t>> read_file_bytes(const std::string& path);

/// Writes `bytes` to `path` atomically: temp file, fsync, rename, fsync dir.
Status write_file_durably(const std::string& path, const uint8_t* bytes, size_t size);

}  // namespace zl
