#include "zl/safetensors.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <set>
#include <tuple>

#include <nlohmann/json.hpp>

#include "zl/durable_file.h"

// Tensor bytes are copied as they sit in memory; safetensors is little-endian,
// and so are every host and phone this runner targets (x86_64, arm64).
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors I/O here assumes a little-endian target"
#endif

namespace zl {
namespace {

using nlohmann::json;

// A header larger than this is not a checkpoint of LoRA parameters; refusing
// it keeps a corrupt length field from allocating gigabytes.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

struct DtypeInfo {
  SafetensorsDtype dtype;
  const char* name;
  size_t size;
};

constexpr DtypeInfo kDtypes[] = {
    {SafetensorsDtype::kF32, "F32", 4}, {SafetensorsDtype::kF64, "F64", 8},
    {SafetensorsDtype::kI64, "I64", 8}, {SafetensorsDtype::kI32, "I32", 4},
    {SafetensorsDtype::kF16, "F16", 2}, {SafetensorsDtype::kBF16, "BF16", 2},
    {SafetensorsDtype::kU8, "U8", 1},
};

bool parse_dtype(const std::string& name, SafetensorsDtype* out) {
  for (const auto& info : kDtypes) {
    if (name == info.name) {
      *out = info.dtype;
      return true;
    }
  }
  return false;
}

// numel * element size, or false on a negative dimension or overflow.
bool byte_size(const std::vector<int64_t>& shape, size_t element, uint64_t* out) {
  uint64_t n = element;
  for (int64_t d : shape) {
    if (d < 0) return false;
    if (d != 0 && n > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(d)) return false;
    n *= static_cast<uint64_t>(d);
  }
  *out = n;
  return true;
}

Status corrupt(const std::string& path, const std::string& what) {
  return Status(StatusCode::kCorrupt, "safetensors file '" + path + "': " + what);
}

}  // namespace

const char* safetensors_dtype_name(SafetensorsDtype dtype) {
  for (const auto& info : kDtypes) {
    if (info.dtype == dtype) return info.name;
  }
  return "?";
}

size_t safetensors_dtype_size(SafetensorsDtype dtype) {
  for (const auto& info : kDtypes) {
    if (info.dtype == dtype) return info.size;
  }
  return 0;
}

int64_t SafetensorsTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Status write_safetensors(const std::string& path, const std::vector<SafetensorsTensorRef>& tensors,
                         const std::map<std::string, std::string>& metadata) {
  std::vector<const SafetensorsTensorRef*> sorted;
  sorted.reserve(tensors.size());
  for (const auto& t : tensors) sorted.push_back(&t);
  std::sort(sorted.begin(), sorted.end(),
            [](const SafetensorsTensorRef* a, const SafetensorsTensorRef* b) { return a->name < b->name; });

  json header = json::object();
  std::vector<std::pair<const void*, size_t>> parts;
  uint64_t offset = 0;
  for (size_t i = 0; i < sorted.size(); ++i) {
    const SafetensorsTensorRef& t = *sorted[i];
    if (t.name.empty() || t.name == "__metadata__") {
      return Status(StatusCode::kInvalidArgument,
                    "write_safetensors('" + path + "'): invalid tensor name '" + t.name + "'");
    }
    if (i > 0 && sorted[i - 1]->name == t.name) {
      return Status(StatusCode::kInvalidArgument,
                    "write_safetensors('" + path + "'): duplicate tensor name '" + t.name + "'");
    }
    uint64_t nbytes = 0;
    if (!byte_size(t.shape, safetensors_dtype_size(t.dtype), &nbytes)) {
      return Status(StatusCode::kInvalidArgument,
                    "write_safetensors('" + path + "'): tensor '" + t.name + "' has an invalid shape");
    }
    if (nbytes > 0 && t.data == nullptr) {
      return Status(StatusCode::kInvalidArgument,
                    "write_safetensors('" + path + "'): tensor '" + t.name + "' has no data");
    }
    header[t.name] = {{"dtype", safetensors_dtype_name(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + nbytes}}};
    parts.emplace_back(t.data, static_cast<size_t>(nbytes));
    offset += nbytes;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;

  std::string header_text = header.dump();
  // The reference implementation pads the header with spaces so the data
  // region starts 8-byte aligned; do the same for zero-copy readers.
  header_text.append((8 - header_text.size() % 8) % 8, ' ');
  uint8_t length_bytes[8];
  uint64_t length = header_text.size();
  for (int i = 0; i < 8; ++i) length_bytes[i] = static_cast<uint8_t>(length >> (8 * i));

  parts.insert(parts.begin(), {header_text.data(), header_text.size()});
  parts.insert(parts.begin(), {length_bytes, sizeof(length_bytes)});
  return write_file_synced(path, parts);
}

namespace {

// The parts of a safetensors file once its length field and JSON header are
// read: `data` points into the caller's buffer.
struct SafetensorsLayout {
  json header;
  const char* data = nullptr;
  uint64_t data_size = 0;
};

// Step 1: the 8-byte header length, the JSON header after it, and where the
// data region starts.
Result<SafetensorsLayout> read_layout(const std::string& path, const std::string& content) {
  if (content.size() < 8) {
    return corrupt(path, "file is " + std::to_string(content.size()) +
                             " bytes, shorter than the 8-byte header length (truncated?)");
  }
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= static_cast<uint64_t>(static_cast<uint8_t>(content[i])) << (8 * i);
  if (header_len > kMaxHeaderBytes || header_len > content.size() - 8) {
    return corrupt(path, "header length " + std::to_string(header_len) + " exceeds the " +
                             std::to_string(content.size() - 8) + " bytes after the length field (truncated?)");
  }
  SafetensorsLayout layout;
  layout.header = json::parse(content.begin() + 8, content.begin() + 8 + static_cast<std::ptrdiff_t>(header_len),
                              nullptr, /*allow_exceptions=*/false);
  if (layout.header.is_discarded() || !layout.header.is_object()) {
    return corrupt(path, "header is not a valid JSON object");
  }
  layout.data_size = content.size() - 8 - header_len;
  layout.data = content.data() + 8 + header_len;
  return layout;
}

// The "__metadata__" entry: string values only.
Status read_metadata(const std::string& path, const json& entry, std::map<std::string, std::string>* metadata) {
  if (!entry.is_object()) return corrupt(path, "__metadata__ is not an object");
  for (auto m = entry.begin(); m != entry.end(); ++m) {
    if (!m.value().is_string()) return corrupt(path, "__metadata__ value '" + m.key() + "' is not a string");
    (*metadata)[m.key()] = m.value().get<std::string>();
  }
  return Status();
}

// A tensor entry checked against the data region, and its bytes copied out;
// `*begin` / `*end` get its data_offsets for the tiling check.
Result<SafetensorsTensor> read_entry(const std::string& path, const std::string& name, const json& entry,
                                     const SafetensorsLayout& layout, uint64_t* begin, uint64_t* end) {
  if (!entry.is_object()) return corrupt(path, "entry '" + name + "' is not an object");
  auto dtype_it = entry.find("dtype");
  auto shape_it = entry.find("shape");
  auto offsets_it = entry.find("data_offsets");
  if (dtype_it == entry.end() || shape_it == entry.end() || offsets_it == entry.end()) {
    return corrupt(path, "entry '" + name + "' lacks dtype, shape or data_offsets");
  }
  SafetensorsTensor tensor;
  if (!dtype_it->is_string() || !parse_dtype(dtype_it->get<std::string>(), &tensor.dtype)) {
    return corrupt(path, "entry '" + name + "' has unsupported dtype " + dtype_it->dump());
  }
  if (!shape_it->is_array()) return corrupt(path, "entry '" + name + "' shape is not an array");
  for (const json& d : *shape_it) {
    if (!d.is_number_unsigned()) return corrupt(path, "entry '" + name + "' shape " + shape_it->dump() + " is invalid");
    tensor.shape.push_back(d.get<int64_t>());
  }
  if (!offsets_it->is_array() || offsets_it->size() != 2 || !(*offsets_it)[0].is_number_unsigned() ||
      !(*offsets_it)[1].is_number_unsigned()) {
    return corrupt(path, "entry '" + name + "' data_offsets " + offsets_it->dump() + " is not [begin, end]");
  }
  *begin = (*offsets_it)[0].get<uint64_t>();
  *end = (*offsets_it)[1].get<uint64_t>();
  uint64_t expected = 0;
  if (!byte_size(tensor.shape, safetensors_dtype_size(tensor.dtype), &expected) || *end < *begin ||
      *end - *begin != expected) {
    return corrupt(path, "entry '" + name + "' data_offsets " + offsets_it->dump() + " do not match dtype " +
                             dtype_it->get<std::string>() + " and shape " + shape_it->dump());
  }
  if (*end > layout.data_size) {
    return corrupt(path, "entry '" + name + "' ends at byte " + std::to_string(*end) + " but the data region has " +
                             std::to_string(layout.data_size) + " bytes (truncated?)");
  }
  tensor.bytes.assign(layout.data + *begin, layout.data + *end);
  return tensor;
}

// Entries must tile the data region: no gaps, no overlaps, no tail.
Status check_tiling(const std::string& path, std::vector<std::tuple<uint64_t, uint64_t, std::string>> ranges,
                    uint64_t data_size) {
  std::sort(ranges.begin(), ranges.end());
  uint64_t cursor = 0;
  for (const auto& r : ranges) {
    if (std::get<0>(r) != cursor) {
      return corrupt(path, "entry '" + std::get<2>(r) + "' starts at byte " + std::to_string(std::get<0>(r)) +
                               ", expected " + std::to_string(cursor) + " (gap or overlap)");
    }
    cursor = std::get<1>(r);
  }
  if (cursor != data_size) {
    return corrupt(path, "data region has " + std::to_string(data_size) + " bytes but entries cover " +
                             std::to_string(cursor));
  }
  return Status();
}

}  // namespace

Result<SafetensorsFile> read_safetensors(const std::string& path) {
  ZL_ASSIGN_OR_RETURN(const std::string content, read_file(path));
  ZL_ASSIGN_OR_RETURN(const SafetensorsLayout layout, read_layout(path, content));
  SafetensorsFile out;
  std::vector<std::tuple<uint64_t, uint64_t, std::string>> ranges;
  for (auto it = layout.header.begin(); it != layout.header.end(); ++it) {
    const std::string& name = it.key();
    if (name == "__metadata__") {
      ZL_RETURN_IF_ERROR(read_metadata(path, it.value(), &out.metadata));
      continue;
    }
    uint64_t begin = 0, end = 0;
    ZL_ASSIGN_OR_RETURN(SafetensorsTensor tensor, read_entry(path, name, it.value(), layout, &begin, &end));
    ranges.emplace_back(begin, end, name);
    out.tensors.emplace(name, std::move(tensor));
  }
  ZL_RETURN_IF_ERROR(check_tiling(path, std::move(ranges), layout.data_size));
  return out;
}

}  // namespace zl
