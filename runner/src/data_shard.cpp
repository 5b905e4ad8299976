#include "zl/data_shard.h"

#include <vector>

namespace zl {

Result<DataShard> DataShard::load(const std::string& path, int64_t batch, int64_t seq_len) {
  Result<SafetensorsFile> read = read_safetensors(path);
  ZL_RETURN_IF_ERROR_WITH_PREFIX(read, "data shard: ");
  DataShard out;
  out.file_ = std::move(read).value();
  const int64_t* ptrs[3] = {nullptr, nullptr, nullptr};
  const char* names[3] = {"input_ids", "attention_mask", "labels"};
  std::vector<int64_t> shape;
  for (int i = 0; i < 3; ++i) {
    auto it = out.file_.tensors.find(names[i]);
    if (it == out.file_.tensors.end()) {
      return Status(StatusCode::kInvalidArgument, "data shard " + path + " has no tensor '" + names[i] +
                                                      "'; make it with `zl data`");
    }
    const SafetensorsTensor& t = it->second;
    if (t.dtype != SafetensorsDtype::kI64 || t.shape.size() != 2 || (i > 0 && t.shape != shape)) {
      return Status(StatusCode::kInvalidArgument, "data shard " + path + ": '" + names[i] +
                                                      "' must be I64 [N, S] like input_ids");
    }
    shape = t.shape;
    ptrs[i] = reinterpret_cast<const int64_t*>(t.bytes.data());
  }
  if (shape[1] != seq_len) {
    return Status(StatusCode::kInvalidArgument, "data shard " + path + " has seq_len " + std::to_string(shape[1]) +
                                                    ", the program expects " + std::to_string(seq_len) +
                                                    "; rebuild it with `zl data --seq-len " + std::to_string(seq_len) + "`");
  }
  if (shape[0] < batch) {
    return Status(StatusCode::kInvalidArgument, "data shard " + path + " has " + std::to_string(shape[0]) +
                                                    " rows, fewer than one micro-batch of " + std::to_string(batch));
  }
  out.ids_ = ptrs[0];
  out.mask_ = ptrs[1];
  out.labels_ = ptrs[2];
  out.rows_ = shape[0];
  out.seq_len_ = shape[1];
  out.batch_ = batch;
  return out;
}

void DataShard::micro_batch(int64_t mb, StageInputs* inputs) const {
  const int64_t j = mb % (rows_ / batch_);
  const int64_t offset = j * batch_ * seq_len_;
  inputs->input_ids = ids_ + offset;
  inputs->attention_mask = mask_ + offset;
  inputs->labels = labels_ + offset;
}

}  // namespace zl
