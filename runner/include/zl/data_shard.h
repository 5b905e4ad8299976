// Stage 0's input: a tokenized shard written by `zl data` (safetensors with
// three int64 [N, S] tensors: input_ids, attention_mask, labels), sliced into
// micro-batches of B rows.
#pragma once

#include <cstdint>
#include <string>

#include "zl/safetensors.h"
#include "zl/stage_program.h"
#include "zl/status.h"

namespace zl {

class DataShard {
 public:
  DataShard() = default;
  // The row pointers point into file_: a copy would point into the original.
  // A move keeps them valid: moving the std::map hands over its nodes, and
  // the tensors' bytes with them, without moving those.
  DataShard(const DataShard&) = delete;
  DataShard& operator=(const DataShard&) = delete;
  DataShard(DataShard&&) = default;
  DataShard& operator=(DataShard&&) = default;

  /// Reads `path` and checks it against the program: every tensor I64 [N, S]
  /// with S == `seq_len`, and N >= `batch` (one micro-batch at least). Errors
  /// name the file and say how to rebuild it.
  static Result<DataShard> load(const std::string& path, int64_t batch, int64_t seq_len);

  /// Micro-batch `mb` takes rows [j*B, (j+1)*B) with j = mb mod floor(N/B):
  /// shard order, wrapping around for more than one epoch. Sets input_ids,
  /// attention_mask and labels of `*inputs`, pointing into the shard.
  void micro_batch(int64_t mb, StageInputs* inputs) const;

  int64_t rows() const { return rows_; }

 private:
  SafetensorsFile file_;
  const int64_t* ids_ = nullptr;
  const int64_t* mask_ = nullptr;
  const int64_t* labels_ = nullptr;
  int64_t rows_ = 0;
  int64_t seq_len_ = 0;
  int64_t batch_ = 0;
};

}  // namespace zl
