// zl_frame_tool: encodes/decodes frames from/to files, so the Python twin
// (zl_device/run/frames.py) can be checked against this implementation.
//
//   zl_frame_tool encode --key HEX64 --in spec.json --out frame.bin
//   zl_frame_tool decode --key HEX64 --in frame.bin [--expect-shape B,S,D]
//                        [--expect-run HEX32] [--expect-stage N] [--max-bytes N]
//
// spec.json: {"type": "DATA", "run_id": HEX32, "stage": 0, "window": 0,
//   "micro_batch": 0, "json": "", "tensors": [{"name": "hidden",
//   "dtype": "float32", "shape": [1, 3, 4], "data_hex": "..."}]}
// decode prints the same spec to stdout; a rejected frame prints
// {"error": "<reason code>", "reason": "..."} and exits with status 2.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "zl/frame.h"
#include "zl/input_log.h"

namespace {

using nlohmann::json;

int usage(const char* why) {
  std::fprintf(stderr,
               "zl_frame_tool: %s\n"
               "usage: zl_frame_tool encode --key HEX64 --in spec.json --out frame.bin\n"
               "       zl_frame_tool decode --key HEX64 --in frame.bin [--expect-shape B,S,D]\n"
               "                            [--expect-run HEX32] [--expect-stage N] [--max-bytes N]\n",
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
  for (const auto& t : spec.value("tensors", json::array())) {
    zl::TensorRecord r;
    r.name = t.value("name", "");
    if (!zl::parse_dtype(t.value("dtype", ""), &r.dtype)) return usage("spec: unknown dtype");
    r.shape = t.value("shape", std::vector<int64_t>{});
    if (!hex_to_bytes(t.value("data_hex", ""), &r.data)) return usage("spec: bad data_hex");
    f.tensors.push_back(std::move(r));
  }
  std::vector<uint8_t> bytes;
  const zl::Status s = zl::encode_frame(f, key, &bytes);
  if (!s.ok()) {
    std::fprintf(stderr, "zl_frame_tool: %s\n", s.message().c_str());
    return 1;
  }
  std::ofstream out(args.at("--out"), std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  return out.good() ? 0 : 1;
}

int decode(const std::map<std::string, std::string>& args, const zl::FrameKey& key) {
  if (!args.count("--in")) return usage("decode needs --in");
  std::vector<uint8_t> bytes;
  const zl::Status read = zl::read_file_bytes(args.at("--in"), &bytes);
  if (!read.ok()) {
    std::fprintf(stderr, "zl_frame_tool: %s\n", read.message().c_str());
    return 1;
  }
  zl::FrameExpectation expect;
  if (args.count("--expect-shape")) {
    long long b = 0, s = 0, d = 0;
    if (std::sscanf(args.at("--expect-shape").c_str(), "%lld,%lld,%lld", &b, &s, &d) != 3) {
      return usage("--expect-shape wants B,S,D");
    }
    expect.batch = b;
    expect.seq_len = s;
    expect.hidden_size = d;
  }
  if (args.count("--expect-run")) {
    zl::RunId run{};
    if (!zl::parse_hex_run_id(args.at("--expect-run"), &run)) return usage("--expect-run wants 32 hex digits");
    expect.run_id = run;
  }
  if (args.count("--expect-stage")) expect.stage = static_cast<uint32_t>(std::stoul(args.at("--expect-stage")));
  if (args.count("--max-bytes")) expect.max_frame_bytes = std::stoull(args.at("--max-bytes"));
  const zl::DecodeResult r = zl::decode_frame(bytes.data(), bytes.size(), key, expect);
  if (!r.ok()) {
    std::cout << json{{"error", zl::frame_error_name(r.error)}, {"reason", r.reason}}.dump() << "\n";
    return 2;
  }
  const zl::Frame& f = r.frame;
  json spec = {{"type", zl::frame_type_name(static_cast<uint16_t>(f.type))},
               {"run_id", zl::to_hex(f.run_id.data(), f.run_id.size())},
               {"stage", f.stage},
               {"window", f.window},
               {"micro_batch", f.micro_batch},
               {"json", f.json},
               {"tensors", json::array()}};
  for (const auto& t : f.tensors) {
    spec["tensors"].push_back({{"name", t.name},
                               {"dtype", zl::dtype_name(static_cast<uint8_t>(t.dtype))},
                               {"shape", t.shape},
                               {"data_hex", zl::to_hex(t.data.data(), t.data.size())}});
  }
  std::cout << spec.dump() << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return usage("missing command");
  const std::string command = argv[1];
  std::map<std::string, std::string> args;
  for (int i = 2; i + 1 < argc; i += 2) args[argv[i]] = argv[i + 1];
  if ((argc - 2) % 2 != 0) return usage("options come in --name value pairs");
  zl::FrameKey key{};
  if (!args.count("--key") || !zl::parse_hex_key(args.at("--key"), &key)) {
    return usage("--key wants the 32-byte run key as 64 hex digits");
  }
  if (command == "encode") return encode(args, key);
  if (command == "decode") return decode(args, key);
  return usage("command must be encode or decode");
}
