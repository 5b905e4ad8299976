// zl_frame_tool: encodes/decodes frames from/to files, so the Python twin
// (zl_device/formats/frames.py) can be checked against this implementation.
//
//   zl_frame_tool encode --key HEX64 --in spec.json --out frame.bin
//   zl_frame_tool decode --key HEX64 --in frame.bin [--expect-shape B,S,D]
//                        [--expect-run HEX32] [--expect-stage N] [--max-bytes N]
//                        [--expect-session HEX64] [--min-seq N]
//   zl_frame_tool decode-batch --key HEX64 --in corpus.bin [the expectations of decode]
//                        [--expect-sessions HEX32]
//   zl_frame_tool receive-batch --run-key HEX64 --client-half HEX32 --in corpus.bin
//                        --expect-stage K [the other expectations of decode]
//   zl_frame_tool derive-key --run-key HEX64 --purpose N --link N
//
// --key is a frame key (a subkey of the run key: derive-key prints one, e.g.
// purpose 1 link 0 for the DATA frames of the link 0 -> 1).
// spec.json: {"type": "DATA", "run_id": HEX32, "stage": 0, "window": 0,
//   "micro_batch": 0, "json": "", "session": HEX64, "seq": 0,
//   "nonce": HEX48 (optional: random), "tensors": [{"name": "hidden",
//   "dtype": "float32", "shape": [1, 3, 4], "data_hex": "..."}]}
// A GRAD spec may instead give "grad": {"shape": [B, S, D], "wire_dtype":
//   "bfloat16" | "float32", "f32_hex": "..."} (float32 values): the frame is
//   built by make_grad_frame (narrowed to bf16 there, round to nearest even).
// decode prints the same spec to stdout (a GRAD decoded with --expect-shape
// adds "grad_f32_hex", grad_hidden widened by grad_hidden_f32); a rejected frame prints
// {"error": "<reason code>", "reason": "..."} and exits with status 2.
//
// A corpus is a sequence of [u32 little-endian length][that many bytes].
// decode-batch prints one line per corpus entry: the decode result as above,
// with each tensor's data as "nbytes" and "digest" (keyed BLAKE2b-256 under
// the all-zero key) instead of "data_hex", and for a GRAD "grad_refusal": why
// a runner refuses its values on receipt (non_finite_grad), or null. With --expect-sessions C, entry i
// is decoded as the first frame after the handshake of its own connection:
// session C || i (u64 little-endian) || 8 zero bytes, sequence numbers from 1.
// receive-batch starts a live Receiver (stage K+1, link K -> K+1) on
// 127.0.0.1 whose server half of connection i's session is i (u64 LE) || 8
// zero bytes, and sends every entry over its own connection after the
// handshake (client half --client-half, so that session is the one of
// --expect-sessions), then half-closes it and reads until the receiver closes
// it, printing one line per entry: {"acked": N, "rejected": N, "ignored": N,
// "hang": false} -- what the receiver's statistics counted for that
// connection; "hang" is true when the receiver did not close the connection
// within 10 s.
#include <poll.h>
#include <stdlib.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "zl/frame.h"
#include "zl/input_log.h"
#include "zl/log.h"
#include "zl/peer_link.h"
#include "zl/tcp_socket.h"

namespace {

using nlohmann::json;

int usage(const char* why) {
  std::fprintf(stderr,
               "zl_frame_tool: %s\n"
               "usage: zl_frame_tool encode --key HEX64 --in spec.json --out frame.bin\n"
               "       zl_frame_tool decode --key HEX64 --in frame.bin [--expect-shape B,S,D]\n"
               "                            [--expect-run HEX32] [--expect-stage N] [--max-bytes N]\n"
               "                            [--expect-session HEX64] [--min-seq N]\n"
               "       zl_frame_tool decode-batch --key HEX64 --in corpus.bin [expectations] [--expect-sessions HEX32]\n"
               "       zl_frame_tool receive-batch --run-key HEX64 --client-half HEX32 --in corpus.bin\n"
               "                            --expect-stage K [expectations]\n"
               "       zl_frame_tool derive-key --run-key HEX64 --purpose N --link N\n",
               why);
  return 64;
}

bool hex_to_bytes(const std::string& hex, std::vector<uint8_t>* out) {
  if (hex.size() % 2) return false;
  out->resize(hex.size() / 2);
  for (size_t i = 0; i < out->size(); ++i) {
    unsigned v = 0;
    if (std::sscanf(hex.c_str() + 2 * i, "%2x", &v) != 1) return false;
    (*out)[i] = static_cast<uint8_t>(v);
  }
  return true;
}

int encode(const std::map<std::string, std::string>& args, const zl::FrameKey& key) {
  if (!args.count("--in") || !args.count("--out")) return usage("encode needs --in and --out");
  std::ifstream in(args.at("--in"));
  const json spec = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (spec.is_discarded()) return usage("--in is not valid JSON");
  zl::Frame f;
  if (!zl::parse_frame_type(spec.value("type", ""), &f.type)) return usage("spec: unknown type");
  if (!zl::parse_hex_run_id(spec.value("run_id", ""), &f.run_id)) return usage("spec: run_id must be 32 hex digits");
  f.stage = spec.value("stage", 0u);
  f.window = spec.value("window", uint64_t{0});
  f.micro_batch = spec.value("micro_batch", uint64_t{0});
  f.json = spec.value("json", "");
  std::vector<uint8_t> raw;
  if (!hex_to_bytes(spec.value("session", std::string(2 * zl::kSessionSize, '0')), &raw) ||
      raw.size() != zl::kSessionSize) {
    return usage("spec: session must be 64 hex digits");
  }
  std::copy(raw.begin(), raw.end(), f.session.begin());
  f.seq = spec.value("seq", uint64_t{0});
  std::vector<uint8_t> nonce;
  if (spec.contains("nonce") &&
      (!hex_to_bytes(spec.value("nonce", ""), &nonce) || nonce.size() != zl::kFrameNonceSize)) {
    return usage("spec: nonce must be 48 hex digits");
  }
  if (spec.contains("grad")) {
    const json& g = spec["grad"];
    const std::vector<int64_t> shape = g.value("shape", std::vector<int64_t>{});
    zl::DType wire = zl::kDefaultGradWireDType;
    std::vector<uint8_t> values;
    if (shape.size() != 3 || !zl::parse_dtype(g.value("wire_dtype", "bfloat16"), &wire) ||
        !hex_to_bytes(g.value("f32_hex", ""), &values) || values.size() % sizeof(float) != 0) {
      return usage("spec: grad wants shape [B,S,D], wire_dtype and f32_hex");
    }
    if (values.size() / sizeof(float) != static_cast<size_t>(shape[0] * shape[1] * shape[2])) {
      return usage("spec: grad f32_hex does not hold B*S*D floats");
    }
    std::vector<float> grad(values.size() / sizeof(float));
    std::memcpy(grad.data(), values.data(), values.size());
    zl::Result<zl::Frame> built = zl::make_grad_frame(f.run_id, f.stage, f.window, f.micro_batch, shape[0], shape[1],
                                                      shape[2], grad.data(), wire);
    if (!built.ok()) {
      std::fprintf(stderr, "zl_frame_tool: %s\n", built.status().message().c_str());
      return 1;
    }
    f.tensors = std::move(built->tensors);
  }
  for (const auto& t : spec.value("tensors", json::array())) {
    zl::TensorRecord r;
    r.name = t.value("name", "");
    if (!zl::parse_dtype(t.value("dtype", ""), &r.dtype)) return usage("spec: unknown dtype");
    r.shape = t.value("shape", std::vector<int64_t>{});
    if (!hex_to_bytes(t.value("data_hex", ""), &r.data)) return usage("spec: bad data_hex");
    f.tensors.push_back(std::move(r));
  }
  zl::Result<std::vector<uint8_t>> encoded = zl::encode_frame(f, key);
  if (!encoded.ok()) {
    std::fprintf(stderr, "zl_frame_tool: %s\n", encoded.status().message().c_str());
    return 1;
  }
  std::vector<uint8_t> bytes = std::move(encoded).value();
  if (!nonce.empty()) {  // reproduce a given frame: the same plaintext sealed with that nonce
    if (!zl::open_frame(bytes.data(), bytes.size(), key)) return 1;
    std::copy(nonce.begin(), nonce.end(), bytes.begin() + (zl::kFrameHeaderSize - zl::kFrameNonceSize));
    zl::seal_frame(bytes.data(), bytes.size(), key);
  }
  std::ofstream out(args.at("--out"), std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  return out.good() ? 0 : 1;
}

std::string safe_dump(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

// --expect-* and --max-bytes; false (after usage()) on a malformed value.
bool parse_expectation(const std::map<std::string, std::string>& args, zl::FrameExpectation* expect) {
  if (args.count("--expect-shape")) {
    long long b = 0, s = 0, d = 0;
    if (std::sscanf(args.at("--expect-shape").c_str(), "%lld,%lld,%lld", &b, &s, &d) != 3) {
      usage("--expect-shape wants B,S,D");
      return false;
    }
    expect->batch = b;
    expect->seq_len = s;
    expect->hidden_size = d;
  }
  if (args.count("--expect-run")) {
    zl::RunId run{};
    if (!zl::parse_hex_run_id(args.at("--expect-run"), &run)) {
      usage("--expect-run wants 32 hex digits");
      return false;
    }
    expect->run_id = run;
  }
  if (args.count("--expect-stage")) expect->stage = static_cast<uint32_t>(std::stoul(args.at("--expect-stage")));
  if (args.count("--expect-session")) {
    std::vector<uint8_t> raw;
    if (!hex_to_bytes(args.at("--expect-session"), &raw) || raw.size() != zl::kSessionSize) {
      usage("--expect-session wants 64 hex digits");
      return false;
    }
    zl::SessionId id{};
    std::copy(raw.begin(), raw.end(), id.begin());
    expect->session = id;
  }
  if (args.count("--min-seq")) expect->min_seq = std::stoull(args.at("--min-seq"));
  if (args.count("--max-bytes")) expect->max_frame_bytes = std::stoull(args.at("--max-bytes"));
  return true;
}

json header_spec(const zl::Frame& f) {
  return {{"type", zl::frame_type_name(static_cast<uint16_t>(f.type))},
          {"run_id", zl::to_hex(f.run_id.data(), f.run_id.size())},
          {"stage", f.stage},
          {"window", f.window},
          {"micro_batch", f.micro_batch},
          {"json", f.json},
          {"session", zl::to_hex(f.session.data(), f.session.size())},
          {"seq", f.seq},
          {"tensors", json::array()}};
}

int decode(const std::map<std::string, std::string>& args, const zl::FrameKey& key) {
  if (!args.count("--in")) return usage("decode needs --in");
  const zl::Result<std::vector<uint8_t>> read = zl::read_file_bytes(args.at("--in"));
  if (!read.ok()) {
    std::fprintf(stderr, "zl_frame_tool: %s\n", read.status().message().c_str());
    return 1;
  }
  const std::vector<uint8_t>& bytes = *read;
  zl::FrameExpectation expect;
  if (!parse_expectation(args, &expect)) return 64;
  const zl::DecodeResult r = zl::decode_frame(bytes.data(), bytes.size(), key, expect);
  if (!r.ok()) {
    std::cout << safe_dump(json{{"error", zl::frame_error_name(r.error)}, {"reason", r.reason}}) << "\n";
    return 2;
  }
  const zl::Frame& f = r.frame;
  json spec = header_spec(f);
  for (const auto& t : f.tensors) {
    spec["tensors"].push_back({{"name", t.name},
                               {"dtype", zl::dtype_name(static_cast<uint8_t>(t.dtype))},
                               {"shape", t.shape},
                               {"data_hex", zl::to_hex(t.data.data(), t.data.size())}});
  }
  if (f.type == zl::FrameType::kGrad && expect.batch > 0) {
    const zl::Result<std::vector<float>> grad = zl::grad_hidden_f32(f, expect.batch, expect.seq_len, expect.hidden_size);
    if (grad.ok()) {
      spec["grad_f32_hex"] = zl::to_hex(reinterpret_cast<const uint8_t*>(grad->data()), grad->size() * sizeof(float));
    }
  }
  std::cout << safe_dump(spec) << "\n";
  return 0;
}

// The entries of a corpus file; false on a malformed corpus.
// Entry i's session in a corpus: the client half, then i (u64 LE) and 8 zero bytes.
zl::SessionId entry_session(const std::vector<uint8_t>& client_half, uint64_t i) {
  zl::SessionId id{};
  std::copy(client_half.begin(), client_half.end(), id.begin());
  for (size_t b = 0; b < 8; ++b) id[zl::kSessionHalfSize + b] = static_cast<uint8_t>(i >> (8 * b));
  return id;
}

bool read_corpus(const std::string& path, std::vector<std::vector<uint8_t>>* out) {
  const zl::Result<std::vector<uint8_t>> read = zl::read_file_bytes(path);
  if (!read.ok()) {
    std::fprintf(stderr, "zl_frame_tool: %s\n", read.status().message().c_str());
    return false;
  }
  const std::vector<uint8_t>& bytes = *read;
  size_t pos = 0;
  while (pos < bytes.size()) {
    if (bytes.size() - pos < 4) return false;
    const uint32_t n = static_cast<uint32_t>(bytes[pos]) | (static_cast<uint32_t>(bytes[pos + 1]) << 8) |
                       (static_cast<uint32_t>(bytes[pos + 2]) << 16) |
                       (static_cast<uint32_t>(bytes[pos + 3]) << 24);
    pos += 4;
    if (bytes.size() - pos < n) return false;
    out->emplace_back(bytes.begin() + static_cast<std::ptrdiff_t>(pos),
                      bytes.begin() + static_cast<std::ptrdiff_t>(pos + n));
    pos += n;
  }
  return true;
}

int decode_batch(const std::map<std::string, std::string>& args, const zl::FrameKey& key) {
  if (!args.count("--in")) return usage("decode-batch needs --in");
  zl::FrameExpectation expect;
  if (!parse_expectation(args, &expect)) return 64;
  std::vector<uint8_t> client_half;
  if (args.count("--expect-sessions") &&
      (!hex_to_bytes(args.at("--expect-sessions"), &client_half) || client_half.size() != zl::kSessionHalfSize)) {
    return usage("--expect-sessions wants 32 hex digits");
  }
  std::vector<std::vector<uint8_t>> corpus;
  if (!read_corpus(args.at("--in"), &corpus)) return usage("--in is not a corpus file");
  std::string out;
  uint64_t index = 0;
  for (const auto& bytes : corpus) {
    if (!client_half.empty()) {
      expect.session = entry_session(client_half, index);
      expect.min_seq = 1;
    }
    ++index;
    const zl::DecodeResult r = zl::decode_frame(bytes.data(), bytes.size(), key, expect);
    if (!r.ok()) {
      out += safe_dump(json{{"error", zl::frame_error_name(r.error)}, {"reason", r.reason}});
    } else {
      json spec = header_spec(r.frame);
      for (const auto& t : r.frame.tensors) {
        const auto digest = zl::keyed_digest(t.data.data(), t.data.size(), zl::FrameKey{});
        spec["tensors"].push_back({{"name", t.name},
                                   {"dtype", zl::dtype_name(static_cast<uint8_t>(t.dtype))},
                                   {"shape", t.shape},
                                   {"nbytes", t.data.size()},
                                   {"digest", zl::to_hex(digest.data(), digest.size())}});
      }
      if (r.frame.type == zl::FrameType::kGrad && expect.batch > 0) {  // what a runner's take_grad refuses
        const auto grad = zl::grad_hidden_f32(r.frame, expect.batch, expect.seq_len, expect.hidden_size);
        const std::string refusal =
            grad.ok() ? zl::non_finite_grad(*grad, r.frame.stage, r.frame.micro_batch) : grad.status().message();
        spec["grad_refusal"] = refusal.empty() ? json(nullptr) : json(refusal);
      }
      out += safe_dump(spec);
    }
    out += "\n";
  }
  std::cout << out;
  return 0;
}

// Sends one corpus entry over a fresh connection after the handshake,
// half-closes it and reads until the receiver closes it. Returns whether it
// did within `timeout`; kInternal when the handshake fails.
zl::Result<bool> send_and_drain(uint16_t port, const zl::LinkKeys& keys, const zl::Frame& hello,
                                const zl::SessionId& session, const std::vector<uint8_t>& bytes,
                                std::chrono::milliseconds timeout) {
  ZL_ASSIGN_OR_RETURN(const zl::Socket sock, zl::connect_tcp("127.0.0.1", port, std::chrono::milliseconds(2000)));
  ZL_RETURN_IF_ERROR(zl::write_frame(sock.fd(), hello, keys.send));
  ZL_ASSIGN_OR_RETURN(const zl::DecodeResult reply, zl::read_frame(sock.fd(), keys.receive, {}, timeout));
  if (!reply.ok() || reply.frame.type != zl::FrameType::kHello || reply.frame.session != session) {
    return zl::Status(zl::StatusCode::kInternal, "the receiver's HELLO is not the expected one: " + reply.reason);
  }
  (void)zl::send_all(sock.fd(), bytes.data(), bytes.size());  // the receiver may close early
  ::shutdown(sock.fd(), SHUT_WR);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  uint8_t buf[4096];
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p{sock.fd(), POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    const ssize_t n = ::recv(sock.fd(), buf, sizeof(buf), 0);
    if (n <= 0) return true;  // EOF (or reset): the receiver closed the connection
  }
}

// Plays each corpus entry to a real Receiver (its input log under `log_dir`)
// over a connection of its own, and prints one line per entry: how many
// frames it acknowledged, rejected or ignored, and whether it hung. Returns
// the exit code.
int replay_to_receiver(const std::vector<std::vector<uint8_t>>& corpus, const zl::FrameKey& run_key,
                       const zl::FrameExpectation& expect, const std::vector<uint8_t>& client_half,
                       const std::string& log_dir) {
  auto connection = std::make_shared<std::atomic<uint64_t>>(0);
  zl::ReceiverOptions options;
  options.key = run_key;
  options.expect = expect;
  options.stage = *expect.stage + 1;
  options.log_dir = log_dir;
  options.max_pending = size_t{1} << 30;  // nobody consumes: never apply back-pressure
  options.session_random = [connection](uint8_t* out, size_t size) {
    const zl::SessionId id = entry_session(std::vector<uint8_t>(zl::kSessionHalfSize), connection->load());
    std::memcpy(out, id.data() + zl::kSessionHalfSize, size);
  };
  const zl::LinkKeys keys = zl::link_keys(run_key, zl::Channel::kData, *expect.stage, zl::LinkEnd::kClient);
  zl::Frame hello =
      zl::make_control_frame(zl::FrameType::kHello, expect.run_id.value_or(zl::RunId{}), *expect.stage, 0, 0);
  std::copy(client_half.begin(), client_half.end(), hello.session.begin());
  zl::Receiver receiver(options);
  const zl::Status started = receiver.start();
  if (!started.ok()) {
    std::fprintf(stderr, "zl_frame_tool: %s\n", started.message().c_str());
    return 1;
  }
  int rc = 0;
  std::string out;
  zl::ReceiverStats before = receiver.stats();
  for (uint64_t i = 0; i < corpus.size(); ++i) {
    connection->store(i);
    const zl::Result<bool> closed = send_and_drain(receiver.port(), keys, hello, entry_session(client_half, i),
                                                   corpus[i], std::chrono::milliseconds(10000));
    if (!closed.ok()) {
      std::fprintf(stderr, "zl_frame_tool: entry %llu: %s\n", static_cast<unsigned long long>(i),
                   closed.status().message().c_str());
      rc = 1;
      break;
    }
    const zl::ReceiverStats after = receiver.stats();
    out += safe_dump(json{{"acked", (after.accepted + after.duplicates) - (before.accepted + before.duplicates)},
                          {"rejected", after.rejected - before.rejected},
                          {"ignored", after.ignored - before.ignored},
                          {"hang", !*closed}});
    out += "\n";
    before = after;
  }
  receiver.stop();
  std::cout << out;
  return rc;
}

int receive_batch(const std::map<std::string, std::string>& args, const zl::FrameKey& run_key) {
  if (!args.count("--in")) return usage("receive-batch needs --in");
  zl::FrameExpectation expect;
  if (!parse_expectation(args, &expect)) return 64;
  if (!expect.stage) return usage("receive-batch needs --expect-stage (the upstream stage of the link)");
  std::vector<uint8_t> client_half;
  if (!args.count("--client-half") || !hex_to_bytes(args.at("--client-half"), &client_half) ||
      client_half.size() != zl::kSessionHalfSize) {
    return usage("receive-batch needs --client-half (32 hex digits)");
  }
  std::vector<std::vector<uint8_t>> corpus;
  if (!read_corpus(args.at("--in"), &corpus)) return usage("--in is not a corpus file");
  zl::set_log_level(zl::LogLevel::kError);
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = std::string(base ? base : "/tmp") + "/zl-frame-tool-XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) {
    std::perror("zl_frame_tool: mkdtemp");
    return 1;
  }
  const int rc = replay_to_receiver(corpus, run_key, expect, client_half, tmpl);
  std::error_code ignored;
  std::filesystem::remove_all(tmpl, ignored);
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return usage("missing command");
  const std::string command = argv[1];
  std::map<std::string, std::string> args;
  for (int i = 2; i + 1 < argc; i += 2) args[argv[i]] = argv[i + 1];
  if ((argc - 2) % 2 != 0) return usage("options come in --name value pairs");
  zl::FrameKey key{};
  const bool takes_run_key = command == "receive-batch" || command == "derive-key";
  const char* key_flag = takes_run_key ? "--run-key" : "--key";
  if (!args.count(key_flag) || !zl::parse_hex_key(args.at(key_flag), &key)) {
    return usage(takes_run_key ? "--run-key wants the 32-byte run key as 64 hex digits"
                               : "--key wants a 32-byte frame key as 64 hex digits (derive-key prints one)");
  }
  if (command == "encode") return encode(args, key);
  if (command == "decode") return decode(args, key);
  if (command == "decode-batch") return decode_batch(args, key);
  if (command == "receive-batch") return receive_batch(args, key);
  if (command == "derive-key") {
    if (!args.count("--purpose") || !args.count("--link")) return usage("derive-key needs --purpose and --link");
    const zl::FrameKey sub = zl::derive_frame_key(
        key, static_cast<zl::KeyPurpose>(std::stoul(args.at("--purpose"))), static_cast<uint32_t>(std::stoul(args.at("--link"))));
    std::cout << zl::to_hex(sub.data(), sub.size()) << "\n";
    return 0;
  }
  return usage("command must be encode, decode, decode-batch, receive-batch or derive-key");
}
