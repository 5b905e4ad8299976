// Versioned, encrypted binary frames: the one wire format of the data plane
// (stage -> stage), the control channel (stage <-> coordinator) and the
// input log on disk.
//
// Layout (little-endian, byte offsets) is specified in PROTOCOL.md; the
// Python twin is zl_device/formats/frames.py. A frame is
//   [128-byte header][JSON payload][tensor records][16-byte tag]
// where everything after the header is encrypted with XChaCha20-Poly1305
// (libsodium crypto_aead_xchacha20poly1305_ietf, the 24-byte nonce in the
// header) under a frame key derived from the run key (derive_frame_key: one
// per channel, link and direction), the header being the associated data.
// The header carries the session and sequence number that bind a frame to
// one connection (PROTOCOL.md §6). Decoding never trusts a length field
// before bounds-checking it and never reads past `size`.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "zl/bf16.h"  // bf16_from_f32, f32_from_bf16: the GRAD wire dtype
#include "zl/status.h"

namespace zl {

/// "ZLFR" as the first four bytes on the wire.
constexpr std::array<uint8_t, 4> kFrameMagic = {'Z', 'L', 'F', 'R'};
/// Version 2: encrypted frames with a session and sequence number (version 1
/// frames, MAC only, are rejected as bad_version).
constexpr uint16_t kFrameVersion = 2;
constexpr size_t kFrameHeaderSize = 128;
constexpr size_t kTensorRecordHeaderSize = 16;
constexpr size_t kFrameTagSize = 16;    ///< Poly1305 tag
constexpr size_t kFrameNonceSize = 24;  ///< XChaCha20 nonce, random per frame
constexpr size_t kFrameKeySize = 32;
constexpr size_t kRunIdSize = 16;
/// A session id: the client's 16 random bytes, then the server's (PROTOCOL.md §6).
constexpr size_t kSessionSize = 32;
constexpr size_t kSessionHalfSize = 16;
constexpr size_t kMaxTensorRank = 8;
/// Default upper bound on one frame, tag included. A TinyLlama hidden state
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
  kHello = 3,            ///< first frame each way on every connection: the session handshake
  kGrad = 4,             ///< downstream -> upstream: grad_hidden [B,S,D] (bf16 or f32) of DATA (window, micro_batch)
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
using SessionId = std::array<uint8_t, kSessionSize>;

/// What a frame key is for (PROTOCOL.md §1). With `link` = the upstream
/// stage k of a data link, the stage k of a control connection, or the stage
/// whose input log it is, each (purpose, link) has its own key, so a frame
/// sealed for one channel, link or direction never opens on another.
enum class KeyPurpose : uint32_t {
  kDataDown = 1,     ///< data link k -> k+1: DATA (and HELLO) from stage k
  kDataUp = 2,       ///< data link k -> k+1: ACK, GRAD, ERROR, HELLO from stage k+1
  kControlUp = 3,    ///< control channel of stage k: stage -> coordinator
  kControlDown = 4,  ///< control channel of stage k: coordinator -> stage
  kInputLog = 5,     ///< stage k's input log entries at rest
};

/// crypto_kdf_derive_from_key(32 bytes, subkey id = purpose << 32 | link,
/// context "zl-frame", run key): BLAKE2b-256 keyed with the run key, salt =
/// the id as 8 little-endian bytes + 8 zero bytes, personalization =
/// "zl-frame" + 8 zero bytes (the Python twin computes it with hashlib).
FrameKey derive_frame_key(const FrameKey& run_key, KeyPurpose purpose, uint32_t link);

/// The keys one end of a connection seals and opens frames with.
struct LinkKeys {
  FrameKey send{};
  FrameKey receive{};
};

/// A data link k -> k+1 (link = k) or stage k's control channel (link = k).
enum class Channel { kData, kControl };
/// The client dials and says HELLO first (a data link's upstream Sender, a
/// stage's ControlClient); the server listens (the Receiver, the coordinator).
enum class LinkEnd { kClient, kServer };
/// Client: send = kDataDown / kControlUp, receive = kDataUp / kControlDown;
/// the server the other way round.
LinkKeys link_keys(const FrameKey& run_key, Channel channel, uint32_t link, LinkEnd end);

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
  /// The connection's session and this frame's sequence number in it (the
  /// sender's count; HELLO is 0). Input log entries: all zero.
  SessionId session{};
  uint64_t seq = 0;

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
  kBadMac,           ///< authentication tag does not verify (corrupt, or sealed under another key)
  kUnknownType,      ///< type field outside FrameType
  kBadHeader,        ///< reserved field not zero
  kBadPayload,       ///< JSON payload breaks the payload rule (check_frame_json)
  kBadTensor,        ///< unknown dtype, rank > 8, bad or duplicate name, dims overflow, payload size != numel * size
  kUnexpectedTensor, ///< DATA or GRAD tensors differ from the expected names/dtypes/shapes
  kWrongRun,         ///< run id differs from the expected one
  kWrongStage,       ///< stage index differs from the expected one
  kWrongSession,     ///< session differs from the connection's (a frame of another connection)
  kReplay,           ///< sequence number not above the last one accepted on the connection
};

/// "truncated", "bad_magic", ... (same strings as zl_device/formats/frames.py).
const char* frame_error_name(FrameError error);

/// What the decoder checks beyond well-formedness. Unset fields are not checked.
struct FrameExpectation {
  std::optional<RunId> run_id;
  std::optional<uint32_t> stage;
  /// The connection's session (wrong_session otherwise) ...
  std::optional<SessionId> session;
  /// ... and the lowest sequence number still new on it (replay below).
  uint64_t min_seq = 0;
  /// When all three are > 0, a DATA frame must carry exactly
  /// hidden float32 [B,S,D], attention_mask int64 [B,S], labels int64 [B,S],
  /// and a GRAD frame exactly grad_hidden bfloat16 or float32 [B,S,D].
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

/// Serializes `frame` and seals it under `key` with a fresh random nonce.
/// Fails with kInvalidArgument for a tensor whose data size does not match
/// its shape, a rank > 8, a JSON payload or tensor names the decoder would
/// reject, or a result larger than `max_frame_bytes`.
/// Returns the sealed bytes.
Result<std::vector<uint8_t>> encode_frame(const Frame& frame, const FrameKey& key,
                                          size_t max_frame_bytes = kDefaultMaxFrameBytes);

/// The size encode_frame would produce, after the same checks (no encryption).
Result<size_t> encoded_frame_size(const Frame& frame, size_t max_frame_bytes);

/// Seals `size` bytes in place: [header, its nonce set][plaintext body][tag
/// space] -> [header][ciphertext][tag]. Tests and the fuzz tool use it to
/// "re-sign" a frame whose plaintext they altered. `size` >= header + tag.
void seal_frame(uint8_t* frame, size_t size, const FrameKey& key);
/// The inverse of seal_frame: decrypts the body in place; false (bytes left
/// as they were) when the tag does not verify under `key`.
[[nodiscard]] bool open_frame(uint8_t* frame, size_t size, const FrameKey& key);

/// Validates and decodes `size` bytes that should hold exactly one frame.
DecodeResult decode_frame(const uint8_t* data, size_t size, const FrameKey& key,
                          const FrameExpectation& expect = {});

/// For stream readers: inspects the first kFrameHeaderSize bytes and yields
/// the total frame length (tag included) so the caller knows how much more to
/// read. Checks magic, version, minimum length and `max_frame_bytes` only.
FrameError peek_frame_length(const uint8_t* header, size_t size, size_t max_frame_bytes,
                             size_t* total_length, std::string* reason);

/// Builds a DATA frame: hidden float32 [B,S,D], attention_mask int64 [B,S],
/// labels int64 [B,S]. Pointers must hold B*S*D resp. B*S elements.
Frame make_data_frame(const RunId& run_id, uint32_t stage, uint64_t window, uint64_t micro_batch,
                      int64_t batch, int64_t seq_len, int64_t hidden_size, const float* hidden,
                      const int64_t* attention_mask, const int64_t* labels);

/// The hidden state's gradient on the wire (PROTOCOL.md §4, GRAD): bf16 by
/// default (half the bytes; kept results in the gradient-alignment checks),
/// f32 where a run wants it exact.
constexpr DType kDefaultGradWireDType = DType::kBFloat16;
/// The name of a GRAD frame's one tensor.
constexpr const char* kGradTensorName = "grad_hidden";

/// Builds a GRAD frame, sent upstream by stage k+1 (`stage`) for the DATA
/// entry (window, micro_batch) it received: grad_hidden [B,S,D] from the
/// float32 `grad_hidden` (B*S*D elements), narrowed to bf16 with
/// round-to-nearest-even when `wire_dtype` is kBFloat16. kInvalidArgument for
/// another wire dtype or a non-positive dim.
Result<Frame> make_grad_frame(const RunId& run_id, uint32_t stage, uint64_t window, uint64_t micro_batch,
                              int64_t batch, int64_t seq_len, int64_t hidden_size, const float* grad_hidden,
                              DType wire_dtype = kDefaultGradWireDType);

/// "" when `frame` carries exactly grad_hidden bfloat16/float32
/// [batch, seq_len, hidden_size] (what a receiver expecting that shape
/// accepts in a GRAD), else why not.
std::string check_grad_frame(const Frame& frame, int64_t batch, int64_t seq_len, int64_t hidden_size);

/// "" when every value of `grad` (a GRAD's grad_hidden as float32, from
/// grad_hidden_f32) is finite; else which is not, blaming the stage that
/// sent it, `from_stage`, for micro-batch `micro_batch`. A receiver refuses
/// such a gradient before it reaches its weights (a finite float32 past
/// bfloat16's range arrives as inf on the bf16 wire).
std::string non_finite_grad(const std::vector<float>& grad, uint32_t from_stage, uint64_t micro_batch);

/// A GRAD frame's grad_hidden as float32 (bf16 widened exactly), B*S*D
/// elements row-major. kInvalidArgument naming what was seen when the frame
/// is not a GRAD, or its tensor is missing, not bfloat16/float32, or not
/// [batch, seq_len, hidden_size].
Result<std::vector<float>> grad_hidden_f32(const Frame& frame, int64_t batch, int64_t seq_len,
                                           int64_t hidden_size);

/// A header-only frame (ACK, STOP, ...) with an optional JSON payload.
Frame make_control_frame(FrameType type, const RunId& run_id, uint32_t stage, uint64_t window,
                         uint64_t micro_batch, std::string json = {});

/// The payload rule of PROTOCOL.md §5, shared with zl_device/formats/frames.py:
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

/// Keyed BLAKE2b-256 of `data` (a digest for tools and tests; frames are sealed, not MACed).
std::array<uint8_t, 32> keyed_digest(const uint8_t* data, size_t size, const FrameKey& key);

/// `size` random bytes (libsodium randombytes_buf): session halves, nonces.
void random_bytes(uint8_t* out, size_t size);

/// Parses 32 bytes of hex (64 chars) into a key; 16 bytes into a run id.
[[nodiscard]] bool parse_hex_key(const std::string& hex, FrameKey* out);
[[nodiscard]] bool parse_hex_run_id(const std::string& hex, RunId* out);
std::string to_hex(const uint8_t* data, size_t size);

}  // namespace zl
