// Versioned, authenticated binary frames: the one wire format of the data
// plane (stage -> stage) and of the control channel (stage <-> coordinator).
//
// Layout (little-endian, byte offsets) is specified in PROTOCOL.md; the
// Python twin is zl_device/run/frames.py. A frame is
//   [64-byte header][JSON payload][tensor records][32-byte MAC]
// where the MAC is keyed BLAKE2b-256 (libsodium crypto_generichash, the
// per-run 32-byte key) over every byte before it. Decoding never trusts a
// length field before bounds-checking it and never reads past `size`.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "zl/status.h"

namespace zl {

/// "ZLFR" as the first four bytes on the wire.
constexpr std::array<uint8_t, 4> kFrameMagic = {'Z', 'L', 'F', 'R'};
constexpr uint16_t kFrameVersion = 1;
constexpr size_t kFrameHeaderSize = 64;
constexpr size_t kTensorRecordHeaderSize = 16;
constexpr size_t kFrameMacSize = 32;
constexpr size_t kFrameKeySize = 32;
constexpr size_t kRunIdSize = 16;
constexpr size_t kMaxTensorRank = 8;
/// Default upper bound on one frame, MAC included. A TinyLlama hidden state
/// for B=1, S=128, D=2048 is 1 MiB; 64 MiB leaves room for B=8, S=1024.
constexpr size_t kDefaultMaxFrameBytes = size_t{64} << 20;
/// The payload rule (PROTOCOL.md §5): at most 1 MiB of JSON ...
constexpr size_t kMaxFrameJsonBytes = size_t{1} << 20;
/// ... nested at most 32 arrays/objects deep (the top-level object is 1).
constexpr int kMaxFrameJsonDepth = 32;

/// Data-plane and control types share one numbering (u16 on the wire).
enum class FrameType : uint16_t {
  kData = 1,             ///< upstream -> downstream: hidden, attention_mask, labels
  kAck = 2,              ///< downstream -> upstream: entry (window, micro_batch) is durable
  kRegister = 16,        ///< stage -> coordinator: JSON {device, pid, listen port, ...}
  kHeartbeat = 17,       ///< stage -> coordinator: JSON {micro_batches_done, window, phase, pss_mib, temperature_c, t_unix_ms}
  kStart = 18,           ///< coordinator -> stage: JSON run settings
  kStop = 19,            ///< coordinator -> stage
  kWindowCommitted = 20, ///< stage -> coordinator: window's checkpoint is in place
  kError = 21,           ///< either direction: JSON {reason}
};

/// Returns "DATA", "ACK", ... or nullptr for a value outside the enum.
const char* frame_type_name(uint16_t type);
/// Parses "DATA"/"data" etc.; false if unknown.
[[nodiscard]] bool parse_frame_type(const std::string& name, FrameType* out);

/// Tensor element types (u8 on the wire).
enum class DType : uint8_t {
  kFloat32 = 1,
  kInt64 = 2,
  kInt32 = 3,
  kFloat16 = 4,
  kBFloat16 = 5,
  kUInt8 = 6,
};

/// Bytes per element, or 0 for a value outside the enum.
size_t dtype_size(uint8_t dtype);
/// "float32", "int64", ... or nullptr.
const char* dtype_name(uint8_t dtype);
[[nodiscard]] bool parse_dtype(const std::string& name, DType* out);

using RunId = std::array<uint8_t, kRunIdSize>;
using FrameKey = std::array<uint8_t, kFrameKeySize>;

/// One named tensor; `data` holds numel * dtype_size bytes, little-endian,
/// row-major.
struct TensorRecord {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;

  int64_t numel() const;
};

/// A decoded (or to-be-encoded) frame. `stage` is the sender's stage index
/// (the coordinator uses 0xFFFFFFFF, see PROTOCOL.md).
struct Frame {
  FrameType type = FrameType::kData;
  RunId run_id{};
  uint32_t stage = 0;
  uint64_t window = 0;
  uint64_t micro_batch = 0;
  std::string json;  ///< empty, or a JSON object that passes check_frame_json
  std::vector<TensorRecord> tensors;

  /// The tensor named `name`, or nullptr.
  const TensorRecord* find(const std::string& name) const;
};

/// Why a frame was rejected. Stable names (frame_error_name) are shared with
/// the Python twin so logs and tests can compare them.
enum class FrameError : int {
  kNone = 0,
  kTruncated,        ///< fewer bytes than the header or than total_length says
  kBadMagic,         ///< first four bytes are not "ZLFR"
  kBadVersion,       ///< version field != kFrameVersion
  kOversize,         ///< total_length > the receiver's maximum
  kLengthMismatch,   ///< buffer longer than total_length, or sections do not add up
  kBadMac,           ///< MAC does not verify under the key (corrupt or wrong key)
  kUnknownType,      ///< type field outside FrameType
  kBadHeader,        ///< reserved field not zero
  kBadPayload,       ///< JSON payload breaks the payload rule (check_frame_json)
  kBadTensor,        ///< unknown dtype, rank > 8, bad or duplicate name, dims overflow, payload size != numel * size
  kUnexpectedTensor, ///< DATA tensors differ from the expected names/dtypes/shapes
  kWrongRun,         ///< run id differs from the expected one
  kWrongStage,       ///< stage index differs from the expected one
};

/// "truncated", "bad_magic", ... (same strings as zl_device/run/frames.py).
const char* frame_error_name(FrameError error);

/// What the decoder checks beyond well-formedness. Unset fields are not checked.
struct FrameExpectation {
  std::optional<RunId> run_id;
  std::optional<uint32_t> stage;
  /// When all three are > 0, a DATA frame must carry exactly
  /// hidden float32 [B,S,D], attention_mask int64 [B,S], labels int64 [B,S].
  int64_t batch = 0;
  int64_t seq_len = 0;
  int64_t hidden_size = 0;
  size_t max_frame_bytes = kDefaultMaxFrameBytes;
};

/// Outcome of decode_frame: `error == kNone` and a filled `frame`, or the
/// error with a reason that names the offending value.
struct [[nodiscard]] DecodeResult {
  FrameError error = FrameError::kNone;
  std::string reason;
  Frame frame;

  bool ok() const { return error == FrameError::kNone; }
};

/// Serializes `frame` and appends the MAC under `key`.
/// Fails with kInvalidArgument for a tensor whose data size does not match
/// its shape, a rank > 8, a JSON payload or tensor names the decoder would
/// reject, or a result larger than `max_frame_bytes`.
Status encode_frame(const Frame& frame, const FrameKey& key, std::vector<uint8_t>* out,
                    size_t max_frame_bytes = kDefaultMaxFrameBytes);

/// Validates and decodes `size` bytes that should hold exactly one frame.
DecodeResult decode_frame(const uint8_t* data, size_t size, const FrameKey& key,
                          const FrameExpectation& expect = {});

/// For stream readers: inspects the first kFrameHeaderSize bytes and yields
/// the total frame length (MAC included) so the caller knows how much more to
/// read. Checks magic, version, minimum length and `max_frame_bytes` only.
FrameError peek_frame_length(const uint8_t* header, size_t size, size_t max_frame_bytes,
                             size_t* total_length, std::string* reason);

/// Builds a DATA frame: hidden float32 [B,S,D], attention_mask int64 [B,S],
/// labels int64 [B,S]. Pointers must hold B*S*D resp. B*S elements.
Frame make_data_frame(const RunId& run_id, uint32_t stage, uint64_t window, uint64_t micro_batch,
                      int64_t batch, int64_t seq_len, int64_t hidden_size, const float* hidden,
                      const int64_t* attention_mask, const int64_t* labels);

/// A header-only frame (ACK, STOP, ...) with an optional JSON payload.
Frame make_control_frame(FrameType type, const RunId& run_id, uint32_t stage, uint64_t window,
                         uint64_t micro_batch, std::string json = {});

/// The payload rule of PROTOCOL.md §5, shared with zl_device/run/frames.py:
/// empty, or at most kMaxFrameJsonBytes of strict UTF-8 holding exactly one
/// RFC 8259 JSON object (whitespace around it allowed) with no NaN/Infinity,
/// integers in [-2^63, 2^64-1], other numbers finite as doubles, no lone
/// surrogate escapes, no duplicate keys in an object and at most
/// kMaxFrameJsonDepth levels of nesting. Returns "" when `data` obeys it,
/// else why not (untrusted bytes escaped).
std::string check_frame_json(const char* data, size_t size);

/// "" for a valid tensor name (non-empty strict UTF-8 without C0 controls or
/// DEL), else why not.
std::string check_tensor_name(const std::string& name);

/// Untrusted bytes made safe for reasons, logs and JSON: printable ASCII is
/// kept, every other byte (and \\, ', ") becomes \xNN; at most `max_bytes`
/// are shown, then "...".
std::string escape_bytes(const std::string& raw, size_t max_bytes = 64);

/// Keyed BLAKE2b-256 of `data` (what the frame MAC is).
std::array<uint8_t, kFrameMacSize> frame_mac(const uint8_t* data, size_t size, const FrameKey& key);

/// Parses 32 bytes of hex (64 chars) into a key; 16 bytes into a run id.
[[nodiscard]] bool parse_hex_key(const std::string& hex, FrameKey* out);
[[nodiscard]] bool parse_hex_run_id(const std::string& hex, RunId* out);
std::string to_hex(const uint8_t* data, size_t size);

}  // namespace zl
