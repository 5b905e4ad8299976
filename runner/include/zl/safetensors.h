// Minimal safetensors reader/writer for checkpoints (format:
// https://github.com/huggingface/safetensors): 8-byte little-endian header
// length N, N bytes of JSON header {"name": {"dtype", "shape", "data_offsets"},
// "__metadata__": {str: str}}, then the raw tensor bytes. Files written here
// load with `safetensors.torch.load_file`, so per-stage adapters merge into a
// PEFT `adapter_model.safetensors` without conversion.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "zl/status.h"

namespace zl {

/// Element types this runner reads and writes (safetensors dtype strings).
enum class SafetensorsDtype { kF32, kF64, kI64, kI32, kF16, kBF16, kU8 };

/// "F32", "I64", ... as written in the header.
const char* safetensors_dtype_name(SafetensorsDtype dtype);
/// Bytes per element (4 for F32).
size_t safetensors_dtype_size(SafetensorsDtype dtype);

/// One tensor to write; `data` is borrowed and must hold
/// numel(shape) * dtype size bytes, little-endian, row-major.
struct SafetensorsTensorRef {
  std::string name;
  SafetensorsDtype dtype = SafetensorsDtype::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
};

/// One tensor read back; owns its bytes.
struct SafetensorsTensor {
  SafetensorsDtype dtype = SafetensorsDtype::kF32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;

  /// Product of `shape` (1 for a scalar).
  int64_t numel() const;
  /// `bytes` viewed as float32; only valid when dtype == kF32.
  const float* f32() const { return reinterpret_cast<const float*>(bytes.data()); }
};

/// A whole file read back: tensors by name plus the string metadata.
struct SafetensorsFile {
  std::map<std::string, SafetensorsTensor> tensors;
  std::map<std::string, std::string> metadata;
};

/// Writes `tensors` (sorted by name in the file, data laid out in that order)
/// to `path` and fsyncs it before returning, so a caller that renames the
/// file (or its directory) afterwards publishes complete bytes.
/// Fails on duplicate or empty names, null data, or negative dimensions.
Status write_safetensors(const std::string& path, const std::vector<SafetensorsTensorRef>& tensors,
                         const std::map<std::string, std::string>& metadata = {});

/// Reads and validates `path`: header length within the file, JSON parses,
/// every entry has a known dtype, a non-negative shape, and data_offsets
/// matching numel * dtype size; the entries tile the data region exactly
/// (a truncated or padded file fails). Errors name the file and the entry.
Result<SafetensorsFile> read_safetensors(const std::string& path);

}  // namespace zl
