// Frame codec; see include/zl/frame.h and runner/PROTOCOL.md for the layout.
#include "zl/frame.h"

#include <sodium.h>

#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>


// Tensor payloads are copied as host memory; every target (x86-64, arm64) is
// little-endian, which is what the wire format says.
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "zl frames assume a little-endian host"
#endif

namespace zl {
namespace {

// Header field offsets (PROTOCOL.md §2).
constexpr size_t kOffVersion = 4;
constexpr size_t kOffType = 6;
constexpr size_t kOffTotalLength = 8;
constexpr size_t kOffFlags = 12;
constexpr size_t kOffRunId = 16;
constexpr size_t kOffStage = 32;
constexpr size_t kOffTensorCount = 36;
constexpr size_t kOffWindow = 40;
constexpr size_t kOffMicroBatch = 48;
constexpr size_t kOffJsonLength = 56;
constexpr size_t kOffReserved = 60;
constexpr size_t kOffSession = 64;
constexpr size_t kOffSeq = 96;
constexpr size_t kOffNonce = 104;
static_assert(kOffNonce + kFrameNonceSize == kFrameHeaderSize, "header layout");
static_assert(kFrameTagSize == crypto_aead_xchacha20poly1305_ietf_ABYTES, "tag size");
static_assert(kFrameNonceSize == crypto_aead_xchacha20poly1305_ietf_NPUBBYTES, "nonce size");
static_assert(kFrameKeySize == crypto_aead_xchacha20poly1305_ietf_KEYBYTES, "key size");
constexpr size_t kMinFrameSize = kFrameHeaderSize + kFrameTagSize;
/// crypto_kdf context of every frame key (exactly crypto_kdf_CONTEXTBYTES).
constexpr char kKdfContext[crypto_kdf_CONTEXTBYTES + 1] = "zl-frame";

void put_u16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}
void put_u32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void put_u64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint16_t get_u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
uint32_t get_u32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
uint64_t get_u64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

void ensure_sodium() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Nonces come from randombytes_buf: without a working entropy source no
    // frame may be sealed, so this is fatal rather than a silent weak nonce.
    if (sodium_init() < 0) {
      std::fprintf(stderr, "zl: sodium_init failed (no entropy source?); cannot seal frames\n");
      std::abort();
    }
  });
}

// numel of `shape`, or -1 on a negative dim or when a partial product (left
// to right, PROTOCOL.md §5) exceeds 2^63-1.
int64_t checked_numel(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  const uint64_t limit = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  for (int64_t d : shape) {
    if (d < 0) return -1;
    if (d != 0 && n > limit / static_cast<uint64_t>(d)) return -1;
    n *= static_cast<uint64_t>(d);
  }
  return static_cast<int64_t>(n);
}

// PROTOCOL.md §5: the bytes of a tensor of `shape` (numel times `elem`), or
// -1 when a dim is negative or `elem` times the non-zero dims exceeds 2^63-1.
int64_t wire_bytes(const std::vector<int64_t>& shape, size_t elem) {
  const uint64_t limit = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  uint64_t bytes = elem;
  bool any_zero = false;
  for (int64_t d : shape) {
    if (d < 0) return -1;
    const uint64_t u = static_cast<uint64_t>(d);
    if (u == 0) {
      any_zero = true;
    } else if (bytes > limit / u) {
      return -1;
    } else {
      bytes *= u;
    }
  }
  return any_zero ? 0 : static_cast<int64_t>(bytes);
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ",";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

DecodeResult fail(FrameError error, std::string reason) {
  DecodeResult r;
  r.error = error;
  r.reason = std::string(frame_error_name(error)) + ": " + reason;
  return r;
}

// Checks one expected DATA tensor; empty string when it matches.
std::string check_tensor(const Frame& f, const char* name, DType dtype,
                         const std::vector<int64_t>& shape) {
  const TensorRecord* t = f.find(name);
  if (!t) return std::string("DATA frame has no tensor '") + name + "'";
  if (t->dtype != dtype) {
    const char* seen = dtype_name(static_cast<uint8_t>(t->dtype));
    return std::string("tensor '") + name + "' has dtype " + (seen ? seen : "?") +
           ", expected " + dtype_name(static_cast<uint8_t>(dtype));
  }
  if (t->shape != shape) {
    return std::string("tensor '") + name + "' has shape " + shape_str(t->shape) +
           ", expected " + shape_str(shape);
  }
  return {};
}

// A GRAD frame's tensors against [B,S,D]: exactly grad_hidden, bfloat16 or
// float32 (the record's dtype says which). Empty string when they match.
std::string check_grad_tensor(const Frame& f, int64_t b, int64_t s, int64_t d) {
  const TensorRecord* t = f.find(kGradTensorName);
  if (!t) return "GRAD frame has no tensor 'grad_hidden'";
  if (t->dtype != DType::kBFloat16 && t->dtype != DType::kFloat32) {
    const char* seen = dtype_name(static_cast<uint8_t>(t->dtype));
    return std::string("tensor 'grad_hidden' has dtype ") + (seen ? seen : "?") + ", expected bfloat16 or float32";
  }
  if (t->shape != std::vector<int64_t>{b, s, d}) {
    return "tensor 'grad_hidden' has shape " + shape_str(t->shape) + ", expected " + shape_str({b, s, d});
  }
  if (f.tensors.size() != 1) return "GRAD frame has " + std::to_string(f.tensors.size()) + " tensors, expected 1";
  return {};
}

}  // namespace

const char* frame_type_name(uint16_t type) {
  switch (static_cast<FrameType>(type)) {
    case FrameType::kData: return "DATA";
    case FrameType::kAck: return "ACK";
    case FrameType::kHello: return "HELLO";
    case FrameType::kGrad: return "GRAD";
    case FrameType::kRegister: return "REGISTER";
    case FrameType::kHeartbeat: return "HEARTBEAT";
    case FrameType::kStart: return "START";
    case FrameType::kStop: return "STOP";
    case FrameType::kWindowCommitted: return "WINDOW_COMMITTED";
    case FrameType::kError: return "ERROR";
  }
  return nullptr;
}

bool parse_frame_type(const std::string& name, FrameType* out) {
  std::string upper;
  for (char c : name) upper += static_cast<char>(c >= 'a' && c <= 'z' ? c - 32 : c);
  for (uint16_t v : {1, 2, 3, 4, 16, 17, 18, 19, 20, 21}) {
    if (upper == frame_type_name(v)) {
      *out = static_cast<FrameType>(v);
      return true;
    }
  }
  return false;
}

size_t dtype_size(uint8_t dtype) {
  switch (static_cast<DType>(dtype)) {
    case DType::kFloat32: return 4;
    case DType::kInt64: return 8;
    case DType::kInt32: return 4;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kUInt8: return 1;
  }
  return 0;
}

const char* dtype_name(uint8_t dtype) {
  switch (static_cast<DType>(dtype)) {
    case DType::kFloat32: return "float32";
    case DType::kInt64: return "int64";
    case DType::kInt32: return "int32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kUInt8: return "uint8";
  }
  return nullptr;
}

bool parse_dtype(const std::string& name, DType* out) {
  for (uint8_t v = 1; v <= 6; ++v) {
    if (name == dtype_name(v)) {
      *out = static_cast<DType>(v);
      return true;
    }
  }
  return false;
}

const char* frame_error_name(FrameError error) {
  switch (error) {
    case FrameError::kNone: return "ok";
    case FrameError::kTruncated: return "truncated";
    case FrameError::kBadMagic: return "bad_magic";
    case FrameError::kBadVersion: return "bad_version";
    case FrameError::kOversize: return "oversize";
    case FrameError::kLengthMismatch: return "length_mismatch";
    case FrameError::kBadMac: return "bad_mac";
    case FrameError::kUnknownType: return "unknown_type";
    case FrameError::kBadHeader: return "bad_header";
    case FrameError::kBadPayload: return "bad_payload";
    case FrameError::kBadTensor: return "bad_tensor";
    case FrameError::kUnexpectedTensor: return "unexpected_tensor";
    case FrameError::kWrongRun: return "wrong_run";
    case FrameError::kWrongStage: return "wrong_stage";
    case FrameError::kWrongSession: return "wrong_session";
    case FrameError::kReplay: return "replay";
  }
  return "unknown";
}

int64_t TensorRecord::numel() const {
  return checked_numel(shape);
}

const TensorRecord* Frame::find(const std::string& name) const {
  for (const auto& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

std::array<uint8_t, 32> keyed_digest(const uint8_t* data, size_t size, const FrameKey& key) {
  ensure_sodium();
  std::array<uint8_t, 32> digest{};
  crypto_generichash(digest.data(), digest.size(), data, size, key.data(), key.size());
  return digest;
}

FrameKey derive_frame_key(const FrameKey& run_key, KeyPurpose purpose, uint32_t link) {
  ensure_sodium();
  FrameKey out{};
  const uint64_t id = (static_cast<uint64_t>(purpose) << 32) | link;
  crypto_kdf_derive_from_key(out.data(), out.size(), id, kKdfContext, run_key.data());
  return out;
}

void random_bytes(uint8_t* out, size_t size) {
  ensure_sodium();
  randombytes_buf(out, size);
}

LinkKeys link_keys(const FrameKey& run_key, Channel channel, uint32_t link, LinkEnd end) {
  const bool data = channel == Channel::kData;
  const FrameKey up = derive_frame_key(run_key, data ? KeyPurpose::kDataDown : KeyPurpose::kControlUp, link);
  const FrameKey down = derive_frame_key(run_key, data ? KeyPurpose::kDataUp : KeyPurpose::kControlDown, link);
  LinkKeys keys;
  keys.send = end == LinkEnd::kClient ? up : down;
  keys.receive = end == LinkEnd::kClient ? down : up;
  return keys;
}

void seal_frame(uint8_t* frame, size_t size, const FrameKey& key) {
  ensure_sodium();
  const size_t body = size - kFrameHeaderSize - kFrameTagSize;
  crypto_aead_xchacha20poly1305_ietf_encrypt_detached(
      frame + kFrameHeaderSize, frame + size - kFrameTagSize, nullptr, frame + kFrameHeaderSize, body, frame,
      kFrameHeaderSize, nullptr, frame + kOffNonce, key.data());
}

bool open_frame(uint8_t* frame, size_t size, const FrameKey& key) {
  ensure_sodium();
  const size_t body = size - kFrameHeaderSize - kFrameTagSize;
  return crypto_aead_xchacha20poly1305_ietf_decrypt_detached(
             frame + kFrameHeaderSize, nullptr, frame + kFrameHeaderSize, body, frame + size - kFrameTagSize,
             frame, kFrameHeaderSize, frame + kOffNonce, key.data()) == 0;
}

Result<size_t> encoded_frame_size(const Frame& frame, size_t max_frame_bytes) {
  if (frame_type_name(static_cast<uint16_t>(frame.type)) == nullptr) {
    return Status(StatusCode::kInvalidArgument,
                  "frame type " + std::to_string(static_cast<int>(frame.type)) + " is unknown");
  }
  if (const std::string bad = check_frame_json(frame.json.data(), frame.json.size()); !bad.empty()) {
    return Status(StatusCode::kInvalidArgument, bad);
  }
  uint64_t total = kFrameHeaderSize + frame.json.size() + kFrameTagSize;
  for (size_t i = 0; i < frame.tensors.size(); ++i) {
    const TensorRecord& t = frame.tensors[i];
    if (const std::string bad = check_tensor_name(t.name); !bad.empty()) {
      return Status(StatusCode::kInvalidArgument, bad);
    }
    for (size_t j = 0; j < i; ++j) {
      if (frame.tensors[j].name == t.name) {
        return Status(StatusCode::kInvalidArgument, "two tensors named '" + escape_bytes(t.name) + "'");
      }
    }
    const size_t elem = dtype_size(static_cast<uint8_t>(t.dtype));
    if (elem == 0) {
      return Status(StatusCode::kInvalidArgument, "tensor '" + escape_bytes(t.name) + "' has an unknown dtype");
    }
    if (t.shape.size() > kMaxTensorRank) {
      return Status(StatusCode::kInvalidArgument,
                    "tensor '" + escape_bytes(t.name) + "' has rank " + std::to_string(t.shape.size()) +
                        ", the maximum is 8");
    }
    if (t.name.size() > 0xFFFF) {
      return Status(StatusCode::kInvalidArgument, "tensor name longer than 65535 bytes");
    }
    const int64_t n = wire_bytes(t.shape, elem);
    if (n < 0 || static_cast<uint64_t>(n) != t.data.size()) {
      return Status(StatusCode::kInvalidArgument,
                    "tensor '" + escape_bytes(t.name) + "' has shape " + shape_str(t.shape) + " but " +
                        std::to_string(t.data.size()) + " data bytes");
    }
    total += kTensorRecordHeaderSize + t.name.size() + 8 * t.shape.size() + t.data.size();
  }
  if (total > max_frame_bytes || total > std::numeric_limits<uint32_t>::max()) {
    return Status(StatusCode::kInvalidArgument,
                  "frame of " + std::to_string(total) + " bytes exceeds the maximum of " +
                      std::to_string(max_frame_bytes));
  }
  return static_cast<size_t>(total);
}

Result<std::vector<uint8_t>> encode_frame(const Frame& frame, const FrameKey& key, size_t max_frame_bytes) {
  ZL_ASSIGN_OR_RETURN(const size_t total, encoded_frame_size(frame, max_frame_bytes));
  std::vector<uint8_t> out(total, 0);
  uint8_t* p = out.data();
  std::memcpy(p, kFrameMagic.data(), 4);
  put_u16(p + kOffVersion, kFrameVersion);
  put_u16(p + kOffType, static_cast<uint16_t>(frame.type));
  put_u32(p + kOffTotalLength, static_cast<uint32_t>(total));
  put_u32(p + kOffFlags, 0);
  std::memcpy(p + kOffRunId, frame.run_id.data(), kRunIdSize);
  put_u32(p + kOffStage, frame.stage);
  put_u32(p + kOffTensorCount, static_cast<uint32_t>(frame.tensors.size()));
  put_u64(p + kOffWindow, frame.window);
  put_u64(p + kOffMicroBatch, frame.micro_batch);
  put_u32(p + kOffJsonLength, static_cast<uint32_t>(frame.json.size()));
  put_u32(p + kOffReserved, 0);
  std::memcpy(p + kOffSession, frame.session.data(), kSessionSize);
  put_u64(p + kOffSeq, frame.seq);
  ensure_sodium();
  randombytes_buf(p + kOffNonce, kFrameNonceSize);  // 192 random bits: never reused, restarts included
  size_t pos = kFrameHeaderSize;
  std::memcpy(p + pos, frame.json.data(), frame.json.size());
  pos += frame.json.size();
  for (const auto& t : frame.tensors) {
    p[pos] = static_cast<uint8_t>(t.dtype);
    p[pos + 1] = static_cast<uint8_t>(t.shape.size());
    put_u16(p + pos + 2, static_cast<uint16_t>(t.name.size()));
    put_u32(p + pos + 4, 0);
    put_u64(p + pos + 8, t.data.size());
    pos += kTensorRecordHeaderSize;
    std::memcpy(p + pos, t.name.data(), t.name.size());
    pos += t.name.size();
    for (int64_t d : t.shape) {
      put_u64(p + pos, static_cast<uint64_t>(d));
      pos += 8;
    }
    if (!t.data.empty()) std::memcpy(p + pos, t.data.data(), t.data.size());
    pos += t.data.size();
  }
  seal_frame(p, total, key);
  return out;
}

FrameError peek_frame_length(const uint8_t* header, size_t size, size_t max_frame_bytes,
                             size_t* total_length, std::string* reason) {
  if (size < 4) {
    *reason = "only " + std::to_string(size) + " bytes, a frame header has 128";
    return FrameError::kTruncated;
  }
  if (std::memcmp(header, kFrameMagic.data(), 4) != 0) {
    *reason = "first bytes are " + to_hex(header, 4) + ", expected 5a4c4652 (\"ZLFR\")";
    return FrameError::kBadMagic;
  }
  if (size < kFrameHeaderSize) {
    *reason = "only " + std::to_string(size) + " bytes, a frame header has 128";
    return FrameError::kTruncated;
  }
  const uint16_t version = get_u16(header + kOffVersion);
  if (version != kFrameVersion) {
    *reason = "version " + std::to_string(version) + ", this build speaks version " +
              std::to_string(kFrameVersion) +
              (version == 1 ? " (version 1 frames are only MACed, not encrypted; update the sender)" : "");
    return FrameError::kBadVersion;
  }
  const uint32_t total = get_u32(header + kOffTotalLength);
  if (total > max_frame_bytes) {
    *reason = "total_length " + std::to_string(total) + " exceeds the maximum of " +
              std::to_string(max_frame_bytes) + " bytes";
    return FrameError::kOversize;
  }
  if (total < kMinFrameSize) {
    *reason = "total_length " + std::to_string(total) + " is below the minimum of " +
              std::to_string(kMinFrameSize);
    return FrameError::kLengthMismatch;
  }
  *total_length = total;
  return FrameError::kNone;
}

namespace {

// A failed decode step: the error and its reason; decode_frame turns it into
// a DecodeResult. nullopt: the step passed.
struct DecodeError {
  FrameError error;
  std::string reason;
};
using DecodeStep = std::optional<DecodeError>;

// The authenticated plaintext of a frame while it is read: `body` is the
// offset of the tag (the end of what may be read), `pos` the next unread byte.
struct PlainReader {
  const uint8_t* data;
  size_t body;
  size_t pos;
};

// Step 1, open: checks the length against the header and `size`, then
// authenticates and decrypts into `plain` (header copied as is). Nothing else
// is interpreted before this passes: past it every byte was written by a
// holder of this frame key.
DecodeStep open_sealed_frame(const uint8_t* data, size_t size, const FrameKey& key, size_t max_frame_bytes,
                             std::vector<uint8_t>* plain) {
  size_t total = 0;
  std::string reason;
  const FrameError peeked = peek_frame_length(data, size, max_frame_bytes, &total, &reason);
  if (peeked != FrameError::kNone) return DecodeError{peeked, reason};
  if (size < total) {
    return DecodeError{FrameError::kTruncated,
                       "have " + std::to_string(size) + " bytes, total_length is " + std::to_string(total)};
  }
  if (size > total) {
    return DecodeError{FrameError::kLengthMismatch,
                       "have " + std::to_string(size) + " bytes, total_length is " + std::to_string(total)};
  }
  plain->assign(data, data + kFrameHeaderSize);
  plain->resize(total);
  const size_t body = total - kFrameTagSize;
  ensure_sodium();
  if (crypto_aead_xchacha20poly1305_ietf_decrypt_detached(
          plain->data() + kFrameHeaderSize, nullptr, data + kFrameHeaderSize, body - kFrameHeaderSize, data + body,
          data, kFrameHeaderSize, data + kOffNonce, key.data()) != 0) {
    return DecodeError{FrameError::kBadMac,
                       "authentication tag does not verify (frame corrupted in transit, sent under another run "
                       "key, or for another link or direction)"};
  }
  return std::nullopt;
}

// Step 2, header: the fixed header fields and the JSON payload into `f`;
// `tensor_count` as the header claims it (bounded by the records step).
DecodeStep decode_header(PlainReader& in, Frame* f, uint32_t* tensor_count) {
  const uint8_t* data = in.data;
  const uint16_t type = get_u16(data + kOffType);
  if (frame_type_name(type) == nullptr) {
    return DecodeError{FrameError::kUnknownType, "type " + std::to_string(type) + " is not a known frame type"};
  }
  f->type = static_cast<FrameType>(type);
  if (get_u32(data + kOffFlags) != 0 || get_u32(data + kOffReserved) != 0) {
    return DecodeError{FrameError::kBadHeader, "flags/reserved header fields must be 0"};
  }
  std::memcpy(f->run_id.data(), data + kOffRunId, kRunIdSize);
  f->stage = get_u32(data + kOffStage);
  f->window = get_u64(data + kOffWindow);
  f->micro_batch = get_u64(data + kOffMicroBatch);
  std::memcpy(f->session.data(), data + kOffSession, kSessionSize);
  f->seq = get_u64(data + kOffSeq);
  *tensor_count = get_u32(data + kOffTensorCount);
  const uint32_t json_length = get_u32(data + kOffJsonLength);

  in.pos = kFrameHeaderSize;
  if (json_length > in.body - in.pos) {
    return DecodeError{FrameError::kLengthMismatch,
                       "json_length " + std::to_string(json_length) + " runs past the end of the frame"};
  }
  f->json.assign(reinterpret_cast<const char*>(data + in.pos), json_length);
  in.pos += json_length;
  if (const std::string bad = check_frame_json(f->json.data(), f->json.size()); !bad.empty()) {
    return DecodeError{FrameError::kBadPayload, bad};
  }
  return std::nullopt;
}

// Reads `rank` u64 dims into `t->shape`, then checks the payload length
// against shape x dtype. `where` names the record.
DecodeStep decode_shape(PlainReader& in, uint8_t dtype, uint8_t rank, uint64_t payload_length, TensorRecord* t) {
  t->shape.resize(rank);
  std::string dims;  // as on the wire (u64), for the reason
  bool dim_too_big = false;
  for (uint8_t d = 0; d < rank; ++d) {
    const uint64_t v = get_u64(in.data + in.pos);
    dims += (d ? "," : "") + std::to_string(v);
    dim_too_big |= v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
    t->shape[d] = static_cast<int64_t>(v);
    in.pos += 8;
  }
  const int64_t bytes = dim_too_big ? -1 : wire_bytes(t->shape, dtype_size(dtype));
  if (bytes < 0 || static_cast<uint64_t>(bytes) != payload_length) {
    return DecodeError{FrameError::kBadTensor, "tensor '" + escape_bytes(t->name) + "' has shape [" + dims +
                                                   "] and dtype " + dtype_name(dtype) + " but " +
                                                   std::to_string(payload_length) + " payload bytes"};
  }
  return std::nullopt;
}

// One tensor record (16-byte header, name, dims, payload) appended to `f`.
DecodeStep decode_record(PlainReader& in, uint32_t index, Frame* f) {
  const std::string where = "tensor record " + std::to_string(index);
  const uint8_t* data = in.data;
  if (in.body - in.pos < kTensorRecordHeaderSize) {
    return DecodeError{FrameError::kLengthMismatch, where + " header runs past the end of the frame"};
  }
  const uint8_t dtype = data[in.pos];
  const uint8_t rank = data[in.pos + 1];
  const uint16_t name_length = get_u16(data + in.pos + 2);
  const uint32_t reserved = get_u32(data + in.pos + 4);
  const uint64_t payload_length = get_u64(data + in.pos + 8);
  in.pos += kTensorRecordHeaderSize;
  if (dtype_size(dtype) == 0) {
    return DecodeError{FrameError::kBadTensor, where + " has unknown dtype " + std::to_string(dtype)};
  }
  if (rank > kMaxTensorRank) {
    return DecodeError{FrameError::kBadTensor, where + " has rank " + std::to_string(rank) + " > 8"};
  }
  if (reserved != 0) return DecodeError{FrameError::kBadHeader, where + " reserved field must be 0"};
  const uint64_t fixed = static_cast<uint64_t>(name_length) + 8ull * rank;
  if (fixed > in.body - in.pos || payload_length > in.body - in.pos - fixed) {
    return DecodeError{FrameError::kLengthMismatch, where + " runs past the end of the frame"};
  }
  TensorRecord t;
  t.dtype = static_cast<DType>(dtype);
  t.name.assign(reinterpret_cast<const char*>(data + in.pos), name_length);
  in.pos += name_length;
  if (const std::string bad = check_tensor_name(t.name); !bad.empty()) {
    return DecodeError{FrameError::kBadTensor, where + ": " + bad};
  }
  if (f->find(t.name) != nullptr) {
    return DecodeError{FrameError::kBadTensor, where + ": a second tensor named '" + escape_bytes(t.name) + "'"};
  }
  if (DecodeStep bad = decode_shape(in, dtype, rank, payload_length, &t)) return bad;
  t.data.assign(data + in.pos, data + in.pos + payload_length);
  in.pos += payload_length;
  f->tensors.push_back(std::move(t));
  return std::nullopt;
}

// Step 3, records: `tensor_count` records, which must end exactly at the tag.
DecodeStep decode_records(PlainReader& in, uint32_t tensor_count, Frame* f) {
  // Each record needs at least its 16-byte header, which bounds tensor_count
  // before anything is allocated for it.
  if (tensor_count > (in.body - in.pos) / kTensorRecordHeaderSize) {
    return DecodeError{FrameError::kLengthMismatch,
                       "tensor_count " + std::to_string(tensor_count) + " does not fit in the frame"};
  }
  f->tensors.reserve(tensor_count);
  for (uint32_t i = 0; i < tensor_count; ++i) {
    if (DecodeStep bad = decode_record(in, i, f)) return bad;
  }
  if (in.pos != in.body) {
    return DecodeError{FrameError::kLengthMismatch,
                       std::to_string(in.body - in.pos) + " unaccounted bytes before the tag"};
  }
  return std::nullopt;
}

// Step 4, checks: the well-formed frame against what this reader expects
// (run, stage, session, sequence number, the DATA tensors).
DecodeStep check_expectation(const Frame& f, const FrameExpectation& expect) {
  if (expect.run_id && *expect.run_id != f.run_id) {
    return DecodeError{FrameError::kWrongRun, "run id " + to_hex(f.run_id.data(), kRunIdSize) + ", expected " +
                                                  to_hex(expect.run_id->data(), kRunIdSize)};
  }
  if (expect.stage && *expect.stage != f.stage) {
    return DecodeError{FrameError::kWrongStage,
                       "stage " + std::to_string(f.stage) + ", expected " + std::to_string(*expect.stage)};
  }
  if (expect.session && *expect.session != f.session) {
    return DecodeError{FrameError::kWrongSession, "session " + to_hex(f.session.data(), kSessionSize) +
                                                      ", expected this connection's " +
                                                      to_hex(expect.session->data(), kSessionSize)};
  }
  if (f.seq < expect.min_seq) {
    return DecodeError{FrameError::kReplay, "sequence number " + std::to_string(f.seq) +
                                                " was used already on this connection (the next new one is at "
                                                "least " +
                                                std::to_string(expect.min_seq) + ")"};
  }
  if (f.type == FrameType::kData && expect.batch > 0 && expect.seq_len > 0 && expect.hidden_size > 0) {
    const int64_t b = expect.batch, s = expect.seq_len, d = expect.hidden_size;
    std::string bad = check_tensor(f, "hidden", DType::kFloat32, {b, s, d});
    if (bad.empty()) bad = check_tensor(f, "attention_mask", DType::kInt64, {b, s});
    if (bad.empty()) bad = check_tensor(f, "labels", DType::kInt64, {b, s});
    if (bad.empty() && f.tensors.size() != 3) {
      bad = "DATA frame has " + std::to_string(f.tensors.size()) + " tensors, expected 3";
    }
    if (!bad.empty()) return DecodeError{FrameError::kUnexpectedTensor, bad};
  }
  if (f.type == FrameType::kGrad && expect.batch > 0 && expect.seq_len > 0 && expect.hidden_size > 0) {
    const std::string bad = check_grad_tensor(f, expect.batch, expect.seq_len, expect.hidden_size);
    if (!bad.empty()) return DecodeError{FrameError::kUnexpectedTensor, bad};
  }
  return std::nullopt;
}

}  // namespace

DecodeResult decode_frame(const uint8_t* data, size_t size, const FrameKey& key,
                          const FrameExpectation& expect) {
  std::vector<uint8_t> plain;
  DecodeStep step = open_sealed_frame(data, size, key, expect.max_frame_bytes, &plain);
  DecodeResult r;
  if (!step) {
    PlainReader in{plain.data(), plain.size() - kFrameTagSize, kFrameHeaderSize};
    uint32_t tensor_count = 0;
    step = decode_header(in, &r.frame, &tensor_count);
    if (!step) step = decode_records(in, tensor_count, &r.frame);
    if (!step) step = check_expectation(r.frame, expect);
  }
  if (step) return fail(step->error, std::move(step->reason));
  return r;
}

Frame make_data_frame(const RunId& run_id, uint32_t stage, uint64_t window, uint64_t micro_batch,
                      int64_t batch, int64_t seq_len, int64_t hidden_size, const float* hidden,
                      const int64_t* attention_mask, const int64_t* labels) {
  Frame f = make_control_frame(FrameType::kData, run_id, stage, window, micro_batch);
  const size_t bs = static_cast<size_t>(batch * seq_len);
  auto bytes_of = [](const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    return std::vector<uint8_t>(b, b + n);
  };
  f.tensors.push_back({"hidden", DType::kFloat32, {batch, seq_len, hidden_size},
                       bytes_of(hidden, bs * static_cast<size_t>(hidden_size) * sizeof(float))});
  f.tensors.push_back(
      {"attention_mask", DType::kInt64, {batch, seq_len}, bytes_of(attention_mask, bs * 8)});
  f.tensors.push_back({"labels", DType::kInt64, {batch, seq_len}, bytes_of(labels, bs * 8)});
  return f;
}

Result<Frame> make_grad_frame(const RunId& run_id, uint32_t stage, uint64_t window, uint64_t micro_batch,
                              int64_t batch, int64_t seq_len, int64_t hidden_size, const float* grad_hidden,
                              DType wire_dtype) {
  if (wire_dtype != DType::kBFloat16 && wire_dtype != DType::kFloat32) {
    const char* seen = dtype_name(static_cast<uint8_t>(wire_dtype));
    return Status(StatusCode::kInvalidArgument, std::string("GRAD wire dtype ") + (seen ? seen : "?") +
                                                    " is not supported; use bfloat16 (default) or float32");
  }
  const std::vector<int64_t> shape{batch, seq_len, hidden_size};
  if (batch <= 0 || seq_len <= 0 || hidden_size <= 0 || checked_numel(shape) < 0) {
    return Status(StatusCode::kInvalidArgument,
                  "GRAD shape " + shape_str(shape) + " is not a (B,S,D) of positive dims");
  }
  const size_t n = static_cast<size_t>(checked_numel(shape));
  Frame f = make_control_frame(FrameType::kGrad, run_id, stage, window, micro_batch);
  TensorRecord t{kGradTensorName, wire_dtype, shape, {}};
  if (wire_dtype == DType::kFloat32) {
    const auto* b = reinterpret_cast<const uint8_t*>(grad_hidden);
    t.data.assign(b, b + n * sizeof(float));
  } else {
    std::vector<uint16_t> narrow(n);
    narrow_to_bf16(grad_hidden, narrow.data(), n);
    const auto* b = reinterpret_cast<const uint8_t*>(narrow.data());
    t.data.assign(b, b + n * sizeof(uint16_t));
  }
  f.tensors.push_back(std::move(t));
  return f;
}

std::string check_grad_frame(const Frame& frame, int64_t batch, int64_t seq_len, int64_t hidden_size) {
  return check_grad_tensor(frame, batch, seq_len, hidden_size);
}

std::string non_finite_grad(const std::vector<float>& grad, uint32_t from_stage, uint64_t micro_batch) {
  for (size_t i = 0; i < grad.size(); ++i) {
    if (std::isfinite(grad[i])) continue;
    const std::string sender = "stage " + std::to_string(from_stage);
    return "the gradient " + sender + " sent for micro-batch " + std::to_string(micro_batch) + " holds " +
           std::to_string(grad[i]) + " at element " + std::to_string(i) + " (" + sender +
           " diverged; refused on receipt)";
  }
  return {};
}

Result<std::vector<float>> grad_hidden_f32(const Frame& frame, int64_t batch, int64_t seq_len,
                                           int64_t hidden_size) {
  if (frame.type != FrameType::kGrad) {
    const char* seen = frame_type_name(static_cast<uint16_t>(frame.type));
    return Status(StatusCode::kInvalidArgument,
                  std::string("expected a GRAD frame, got ") + (seen ? seen : "an unknown type"));
  }
  if (const std::string bad = check_grad_tensor(frame, batch, seq_len, hidden_size); !bad.empty()) {
    return Status(StatusCode::kInvalidArgument, bad + " (window " + std::to_string(frame.window) +
                                                    ", micro-batch " + std::to_string(frame.micro_batch) + ")");
  }
  const TensorRecord& t = *frame.find(kGradTensorName);
  const size_t n = static_cast<size_t>(batch * seq_len * hidden_size);
  std::vector<float> out(n);
  if (t.dtype == DType::kFloat32) {
    std::memcpy(out.data(), t.data.data(), n * sizeof(float));
  } else {
    std::vector<uint16_t> narrow(n);  // t.data has no alignment to offer uint16_t
    std::memcpy(narrow.data(), t.data.data(), n * sizeof(uint16_t));
    widen_from_bf16(narrow.data(), out.data(), n);
  }
  return out;
}

Frame make_control_frame(FrameType type, const RunId& run_id, uint32_t stage, uint64_t window,
                         uint64_t micro_batch, std::string json) {
  Frame f;
  f.type = type;
  f.run_id = run_id;
  f.stage = stage;
  f.window = window;
  f.micro_batch = micro_batch;
  f.json = std::move(json);
  return f;
}

namespace {
bool parse_hex(const std::string& hex, uint8_t* out, size_t n) {
  if (hex.size() != 2 * n) return false;
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  for (size_t i = 0; i < n; ++i) {
    const int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    out[i] = static_cast<uint8_t>(hi * 16 + lo);
  }
  return true;
}
}  // namespace

bool parse_hex_key(const std::string& hex, FrameKey* out) {
  return parse_hex(hex, out->data(), out->size());
}
bool parse_hex_run_id(const std::string& hex, RunId* out) {
  return parse_hex(hex, out->data(), out->size());
}

std::string to_hex(const uint8_t* data, size_t size) {
  static const char* const kDigits = "0123456789abcdef";
  std::string s;
  s.reserve(2 * size);
  for (size_t i = 0; i < size; ++i) {
    s += kDigits[data[i] >> 4];
    s += kDigits[data[i] & 15];
  }
  return s;
}

}  // namespace zl
