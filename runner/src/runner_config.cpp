#include "zl/runner_config.h"

#include <algorithm>
#include <cctype>
#include <cstdio>

#include "zl/durable_file.h"
#include "zl/host_port.h"
#include "zl/link_profile.h"
#include "zl/pipeline_schedule.h"

namespace zl {
namespace {

using nlohmann::json;

enum class FieldType { kString, kInteger, kNumber, kBoolean, kObject, kNumberPair };

const char* type_name(FieldType type) {
  switch (type) {
    case FieldType::kString: return "string";
    case FieldType::kInteger: return "integer";
    case FieldType::kNumber: return "number";
    case FieldType::kBoolean: return "boolean";
    case FieldType::kObject: return "object";
    case FieldType::kNumberPair: return "[number, number]";
  }
  return "?";
}

// One row per config field. Scalar rows point at their storage through
// `ref`; rows whose JSON form differs from the member (betas, schedule kind)
// supply `set`/`get` instead. Object rows only group their children.
struct Field {
  const char* path;  // dotted: "optimizer.schedule.kind"
  FieldType type;
  bool required;
  bool is_path;      // resolved against the config file's directory
  const char* help;
  void* (*ref)(RunnerConfig*);
  Status (*set)(const json&, RunnerConfig*);
  json (*get)(const RunnerConfig&);
};

#define ZL_REF(expr) [](RunnerConfig* c) -> void* { return &(c->expr); }, nullptr, nullptr
#define ZL_GROUP nullptr, nullptr, nullptr

Status set_betas(const json& v, RunnerConfig* c) {
  c->optimizer.beta1 = v[0].get<double>();
  c->optimizer.beta2 = v[1].get<double>();
  return Status();
}
json get_betas(const RunnerConfig& c) { return json::array({c.optimizer.beta1, c.optimizer.beta2}); }

Status set_schedule_kind(const json& v, RunnerConfig* c) {
  if (!parse_lr_schedule_kind(v.get<std::string>(), &c->optimizer.schedule.kind)) {
    return Status(StatusCode::kInvalidArgument, "config field 'optimizer.schedule.kind' is " + v.dump() +
                                                    "; expected \"constant\" or \"warmup_cosine\"");
  }
  return Status();
}
json get_schedule_kind(const RunnerConfig& c) { return lr_schedule_kind_name(c.optimizer.schedule.kind); }

// The field table: order is the order of --help.
const Field kFields[] = {
    {"base_dir", FieldType::kString, false, false,
     "Folder that relative paths resolve against (itself relative to the config file's folder); default: "
     "the config file's folder. The Android app sets it, and writes runner.pid/.out/.err/.exit there.",
     ZL_REF(base_dir)},
    {"program", FieldType::kString, true, true, "Path of this stage's training program (.pte).", ZL_REF(program)},
    {"manifest", FieldType::kString, false, true,
     "The export's manifest.json (PEFT parameter names); empty = manifest.json next to the program.",
     ZL_REF(manifest)},
    {"stage_index", FieldType::kInteger, true, false, "This stage's index, 0-based.", ZL_REF(stage_index)},
    {"num_stages", FieldType::kInteger, true, false, "Number of stages K in the pipeline.", ZL_REF(num_stages)},
    {"data_shard", FieldType::kString, false, true, "Tokenized data shard; required on stage 0, unused elsewhere.",
     ZL_REF(data_shard)},
    {"listen", FieldType::kString, false, false,
     "host:port to accept upstream DATA on; required on stages > 0 (port 0 = any free port).", ZL_REF(listen)},
    {"downstream", FieldType::kString, false, false,
     "host:port of the next stage; required on every stage but the last.", ZL_REF(downstream)},
    {"coordinator", FieldType::kString, false, false, "host:port of the coordinator; empty = run without one.",
     ZL_REF(coordinator)},
    {"run_key_file", FieldType::kString, true, true,
     "File holding the per-run 32-byte MAC key as 64 hex characters (trailing newline allowed).",
     ZL_REF(run_key_file)},
    {"run_id", FieldType::kString, true, false, "Run id, 32 hex characters (16 bytes); the same on every stage.",
     ZL_REF(run_id)},
    {"window_size", FieldType::kInteger, true, false,
     "m: micro-batches per update window (one AdamW step on their mean gradient).", ZL_REF(window_size)},
    {"num_micro_batches", FieldType::kInteger, true, false, "Micro-batches in the whole run.",
     ZL_REF(num_micro_batches)},
    {"in_flight_depth", FieldType::kInteger, false, false, "D: most un-acknowledged DATA entries per link.",
     ZL_REF(in_flight_depth)},
    {"input_timeout_s", FieldType::kInteger, false, false,
     "Seconds to wait for an upstream entry (or for acknowledgements at the end) before failing; 0 = forever.",
     ZL_REF(input_timeout_s)},
    {"checkpoint_dir", FieldType::kString, true, true, "Directory of this stage's window_* checkpoints.",
     ZL_REF(checkpoint_dir)},
    {"checkpoint_interval", FieldType::kInteger, false, false,
     "Checkpoint after every n-th window (the last window always).", ZL_REF(checkpoint_interval)},
    {"keep_last", FieldType::kInteger, false, false, "Complete checkpoints kept on disk.", ZL_REF(keep_last)},
    {"input_log_dir", FieldType::kString, false, true,
     "Durable inbound log (stages > 0); empty = <checkpoint_dir>/input_log.", ZL_REF(input_log_dir)},
    {"resume", FieldType::kBoolean, false, false, "Restore the latest checkpoint on start if one exists.",
     ZL_REF(resume)},
    {"optimizer", FieldType::kObject, false, false, "AdamW settings (torch.optim.AdamW names).", ZL_GROUP},
    {"optimizer.lr", FieldType::kNumber, false, false, "Base learning rate.", ZL_REF(optimizer.lr)},
    {"optimizer.betas", FieldType::kNumberPair, false, false, "Moment decays [beta1, beta2].", nullptr, set_betas,
     get_betas},
    {"optimizer.eps", FieldType::kNumber, false, false, "Added to sqrt of the bias-corrected second moment.",
     ZL_REF(optimizer.eps)},
    {"optimizer.weight_decay", FieldType::kNumber, false, false, "Decoupled weight decay: p *= 1 - lr_t * wd.",
     ZL_REF(optimizer.weight_decay)},
    {"optimizer.schedule", FieldType::kObject, false, false, "Learning-rate schedule over optimizer steps.", ZL_GROUP},
    {"optimizer.schedule.kind", FieldType::kString, false, false,
     "constant, or warmup_cosine: lr*(t+1)/W for t < W, then cosine from lr to lr*min_lr_ratio at t = T.", nullptr,
     set_schedule_kind, get_schedule_kind},
    {"optimizer.schedule.warmup_steps", FieldType::kInteger, false, false, "W: warm-up length in optimizer steps.",
     ZL_REF(optimizer.schedule.warmup_steps)},
    {"optimizer.schedule.total_steps", FieldType::kInteger, false, false,
     "T: step where the cosine reaches the floor; 0 = number of windows.", ZL_REF(optimizer.schedule.total_steps)},
    {"optimizer.schedule.min_lr_ratio", FieldType::kNumber, false, false, "Floor as a fraction of lr, in [0, 1].",
     ZL_REF(optimizer.schedule.min_lr_ratio)},
    {"link_profile", FieldType::kString, false, false,
     "Link emulation of what this stage sends (DATA down, GRAD up): local, wifi (2 ms, 1000 Mbps), mobile (10 ms, 200 Mbps), constrained (30 ms, 50 Mbps).",
     ZL_REF(link_profile)},
    {"threads", FieldType::kInteger, false, false, "ExecuTorch CPU threads; 0 = the device's performance cores (those outside its slowest cluster).", ZL_REF(threads)},
    {"load_mode", FieldType::kString, false, false,
     "How the program's frozen weights are held: mmap (mapped from the file, reclaimable) or file (read into heap).",
     ZL_REF(load_mode)},
    {"log_path", FieldType::kString, false, true, "Telemetry JSON-lines file (appended).", ZL_REF(log_path)},
    {"early_forwarding", FieldType::kBoolean, false, false,
     "Send the hidden state at the marker, before readout/loss/backward finish.", ZL_REF(early_forwarding)},
    {"forward_only_at_lr0", FieldType::kBoolean, false, false,
     "A held stage (role forward) runs phase 1 only: it sends the hidden state and skips readout, loss and "
     "backward, which could not move its weights. false: it computes them anyway (its losses in the telemetry, "
     "its AdamW moments; the weights stay the same either way).",
     ZL_REF(forward_only_at_lr0)},
    {"role", FieldType::kString, false, false,
     "train, or forward: held still (optimizer.lr 0, not the last stage, schedule zerolock). Without it the "
     "stage is held still when it is all of those.",
     ZL_REF(role)},
    {"accumulator_snapshots", FieldType::kBoolean, false, false,
     "After every micro-batch but a window's last, save the window's gradient sum (in the background) to "
     "<checkpoint_dir>/accumulator.safetensors; a restart resumes from it instead of replaying the window's "
     "micro-batches since the checkpoint.",
     ZL_REF(accumulator_snapshots)},
    {"seed", FieldType::kInteger, false, false, "Seed for anything random in the runner.", ZL_REF(seed)},
    {"hold_at_micro_batch", FieldType::kInteger, false, false,
     "Failure injection: after micro-batch N's hidden state is sent (before its phase 2), write a \"hold\" "
     "telemetry line and wait until killed or stopped; -1 = never. The coordinator sets it to kill a stage at a "
     "reproducible point and removes it before the restart.",
     ZL_REF(hold_at_micro_batch)},
    {"schedule", FieldType::kString, false, false,
     "zerolock: each stage steps on its local loss (two phases, no gradient crosses a link); gpipe, 1f1b or "
     "async: end-to-end backprop with the export's backprop programs, grad_hidden sent upstream in GRAD frames "
     "(gpipe and 1f1b flush every window; async is PipeDream's, no flush, weight versions stashed).",
     ZL_REF(schedule)},
    {"grad_wire_dtype", FieldType::kString, false, false,
     "How GRAD frames carry grad_hidden upstream: bf16 (half the bytes) or f32 (exact).", ZL_REF(grad_wire_dtype)},
    {"keep_activations", FieldType::kBoolean, false, false,
     "gpipe, 1f1b or async, a stage before the last: keep each micro-batch's forward (its activations) until its "
     "gradient comes, one program instance per micro-batch in flight, instead of running the forward again in the "
     "backward. Less compute, more memory.",
     ZL_REF(keep_activations)},
};

#undef ZL_REF
#undef ZL_GROUP

bool type_matches(FieldType type, const json& v) {
  switch (type) {
    case FieldType::kString: return v.is_string();
    case FieldType::kInteger: return v.is_number_integer();
    case FieldType::kNumber: return v.is_number();
    case FieldType::kBoolean: return v.is_boolean();
    case FieldType::kObject: return v.is_object();
    case FieldType::kNumberPair: return v.is_array() && v.size() == 2 && v[0].is_number() && v[1].is_number();
  }
  return false;
}

std::string shown(const json& v) {
  std::string text = v.dump();
  if (text.size() > 80) text = text.substr(0, 77) + "...";
  return text;
}

const char* json_kind(const json& v) {
  if (v.is_string()) return "string";
  if (v.is_boolean()) return "boolean";
  if (v.is_number_integer()) return "integer";
  if (v.is_number()) return "number";
  if (v.is_array()) return "array";
  if (v.is_object()) return "object";
  return "null";
}

Status set_field(const Field& f, const json& v, RunnerConfig* c) {
  if (f.set != nullptr) return f.set(v, c);
  void* p = f.ref(c);
  switch (f.type) {
    case FieldType::kString: *static_cast<std::string*>(p) = v.get<std::string>(); break;
    case FieldType::kInteger: *static_cast<int64_t*>(p) = v.get<int64_t>(); break;
    case FieldType::kNumber: *static_cast<double*>(p) = v.get<double>(); break;
    case FieldType::kBoolean: *static_cast<bool*>(p) = v.get<bool>(); break;
    default: break;
  }
  return Status();
}

json get_field(const Field& f, const RunnerConfig& c) {
  if (f.get != nullptr) return f.get(c);
  void* p = f.ref(const_cast<RunnerConfig*>(&c));
  switch (f.type) {
    case FieldType::kString: return *static_cast<std::string*>(p);
    case FieldType::kInteger: return *static_cast<int64_t*>(p);
    case FieldType::kNumber: return *static_cast<double*>(p);
    case FieldType::kBoolean: return *static_cast<bool*>(p);
    default: return nullptr;
  }
}

// Children of `prefix` ("" or "optimizer.") are the rows one level below it.
bool is_child(const Field& f, const std::string& prefix, std::string* name) {
  const std::string path = f.path;
  if (path.compare(0, prefix.size(), prefix) != 0) return false;
  std::string rest = path.substr(prefix.size());
  if (rest.empty() || rest.find('.') != std::string::npos) return false;
  *name = rest;
  return true;
}

Status invalid(const std::string& message) { return Status(StatusCode::kInvalidArgument, "config: " + message); }

Status parse_object(const json& object, const std::string& prefix, RunnerConfig* config) {
  std::vector<std::string> valid;
  std::string name;
  for (const Field& f : kFields) {
    if (is_child(f, prefix, &name)) valid.push_back(name);
  }
  for (auto it = object.begin(); it != object.end(); ++it) {
    if (std::find(valid.begin(), valid.end(), it.key()) == valid.end()) {
      std::string list;
      for (const auto& v : valid) list += (list.empty() ? "" : ", ") + v;
      return invalid("unknown field '" + prefix + it.key() + "'; valid fields" +
                     (prefix.empty() ? "" : " in '" + prefix.substr(0, prefix.size() - 1) + "'") + ": " + list);
    }
  }
  for (const Field& f : kFields) {
    if (!is_child(f, prefix, &name)) continue;
    auto it = object.find(name);
    if (it == object.end()) {
      if (f.required) return invalid("missing required field '" + std::string(f.path) + "' (" + type_name(f.type) +
                                     ": " + f.help + ")");
      continue;
    }
    if (!type_matches(f.type, *it)) {
      return invalid("field '" + std::string(f.path) + "' must be " + type_name(f.type) + ", got " +
                     json_kind(*it) + " " + shown(*it));
    }
    ZL_RETURN_IF_ERROR(f.type == FieldType::kObject ? parse_object(*it, std::string(f.path) + ".", config)
                                                    : set_field(f, *it, config));
  }
  return Status();
}

// "host:port" (see host_port.h); port 0 only for a listen address.
Status check_address(const char* field, const std::string& value, bool allow_port_zero) {
  if (!parse_host_port(value, allow_port_zero ? PortZero::kAllowed : PortZero::kRejected).ok()) {
    return invalid("field '" + std::string(field) + "' is \"" + value + "\"; expected host:port, e.g. 192.168.1.12:7001");
  }
  return Status();
}

Status check_at_least(const char* field, int64_t value, int64_t minimum) {
  if (value < minimum) {
    return invalid("field '" + std::string(field) + "' is " + std::to_string(value) + "; expected >= " +
                   std::to_string(minimum));
  }
  return Status();
}

Status validate(const RunnerConfig& c) {
  for (auto check : {check_at_least("num_stages", c.num_stages, 1), check_at_least("stage_index", c.stage_index, 0),
                     check_at_least("window_size", c.window_size, 1),
                     check_at_least("num_micro_batches", c.num_micro_batches, 1),
                     check_at_least("in_flight_depth", c.in_flight_depth, 1),
                     check_at_least("checkpoint_interval", c.checkpoint_interval, 1),
                     check_at_least("keep_last", c.keep_last, 1), check_at_least("threads", c.threads, 0),
                     check_at_least("input_timeout_s", c.input_timeout_s, 0)}) {
    ZL_RETURN_IF_ERROR(check);
  }
  if (c.stage_index >= c.num_stages) {
    return invalid("field 'stage_index' is " + std::to_string(c.stage_index) + " but num_stages is " +
                   std::to_string(c.num_stages) + "; expected 0 <= stage_index < num_stages");
  }
  if (c.is_first_stage() && c.data_shard.empty()) return invalid("stage 0 needs field 'data_shard' (its data shard)");
  if (!c.is_first_stage()) {
    if (c.listen.empty()) return invalid("stage " + std::to_string(c.stage_index) + " needs field 'listen' (host:port)");
    ZL_RETURN_IF_ERROR(check_address("listen", c.listen, /*allow_port_zero=*/true));
  }
  if (!c.is_last_stage()) {
    if (c.downstream.empty()) {
      return invalid("stage " + std::to_string(c.stage_index) + " of " + std::to_string(c.num_stages) +
                     " needs field 'downstream' (host:port of the next stage)");
    }
    ZL_RETURN_IF_ERROR(check_address("downstream", c.downstream, false));
  }
  if (!c.coordinator.empty()) {
    ZL_RETURN_IF_ERROR(check_address("coordinator", c.coordinator, false));
  }
  RunId run_id{};
  if (!parse_hex_run_id(c.run_id, &run_id)) {
    return invalid("field 'run_id' is \"" + c.run_id + "\"; expected 32 hex characters (16 bytes)");
  }
  if (c.load_mode != "mmap" && c.load_mode != "file") {
    return invalid("field 'load_mode' is '" + c.load_mode + "'; expected mmap (map the program) or file (read it "
                   "into heap memory)");
  }
  const Result<LinkProfile> profile = link_profile_from_name(c.link_profile);
  if (!profile.ok()) return invalid("field 'link_profile': " + profile.status().message());
  const Result<PipelineSchedule> schedule = parse_pipeline_schedule(c.schedule);
  if (!schedule.ok()) return invalid("field 'schedule': " + schedule.status().message());
  if (c.grad_wire_dtype != "bf16" && c.grad_wire_dtype != "f32") {
    return invalid("field 'grad_wire_dtype' is '" + c.grad_wire_dtype + "'; expected bf16 or f32");
  }
  if (!c.role.empty() && c.role != "train" && c.role != "forward") {
    return invalid("field 'role' is '" + c.role + "'; expected train or forward (held still)");
  }
  if (c.role == "forward" && (c.optimizer.lr != 0.0 || c.is_last_stage() || c.schedule != "zerolock")) {
    return invalid("field 'role' is 'forward' (held still) but stage " + std::to_string(c.stage_index) + " of " +
                   std::to_string(c.num_stages) + " has optimizer.lr " + std::to_string(c.optimizer.lr) +
                   " and schedule '" + c.schedule + "'; only a zerolock stage at lr 0 before the last is held still");
  }
  const Status s = c.optimizer.validate();
  if (!s.ok()) return invalid(s.message());
  return Status();
}

std::string directory_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

Result<RunnerConfig> parse_runner_config(const std::string& json_text, const std::string& base_dir) {
  json root = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return invalid("not valid JSON");
  if (!root.is_object()) return invalid("expected a JSON object, got " + std::string(json_kind(root)));
  RunnerConfig config;
  ZL_RETURN_IF_ERROR(parse_object(root, "", &config));
  if (config.base_dir.empty()) {
    config.base_dir = base_dir;
  } else if (config.base_dir[0] != '/' && !base_dir.empty()) {
    config.base_dir = base_dir + "/" + config.base_dir;
  }
  if (!config.base_dir.empty()) {
    for (const Field& f : kFields) {
      if (!f.is_path) continue;
      auto* path = static_cast<std::string*>(f.ref(&config));
      if (!path->empty() && (*path)[0] != '/') *path = config.base_dir + "/" + *path;
    }
  }
  if (config.input_log_dir.empty() && !config.checkpoint_dir.empty()) {
    config.input_log_dir = config.checkpoint_dir + "/input_log";
  }
  LrSchedule& schedule = config.optimizer.schedule;
  if (schedule.kind == LrScheduleKind::kWarmupCosine && schedule.total_steps == 0) {
    schedule.total_steps = config.num_windows();
  }
  ZL_RETURN_IF_ERROR(validate(config));
  return config;
}

Result<AdamWConfig> parse_optimizer_config(const json& optimizer) {
  if (!optimizer.is_object()) return invalid("field 'optimizer' must be object, got " + shown(optimizer));
  RunnerConfig config;
  ZL_RETURN_IF_ERROR(parse_object(optimizer, "optimizer.", &config));
  const Status status = config.optimizer.validate();
  if (!status.ok()) return invalid(status.message());
  return config.optimizer;
}

Result<RunnerConfig> load_runner_config(const std::string& path) {
  const Result<std::string> text = read_file(path);
  ZL_RETURN_IF_ERROR_WITH_PREFIX(text, "config: ");
  Result<RunnerConfig> config = parse_runner_config(*text, directory_of(path));
  if (!config.ok()) return config.status().with_context("", " (in " + path + ")");
  return config;
}

std::string runner_config_help() {
  const RunnerConfig defaults;
  std::string text =
      "Stage configuration: a JSON object, one file per stage (zl_runner --config FILE).\n"
      "Relative paths resolve against base_dir (default: the config file's directory).\n"
      "Nested fields are written as objects:\n"
      "{\"optimizer\": {\"schedule\": {\"kind\": \"warmup_cosine\"}}}.\n\n";
  for (const Field& f : kFields) {
    std::string def;
    if (f.type == FieldType::kObject) {
      def = "";
    } else if (f.required) {
      def = "required";
    } else {
      def = "default " + get_field(f, defaults).dump();
    }
    char line[160];
    std::snprintf(line, sizeof(line), "  %-34s %-17s %s\n", f.path, type_name(f.type), def.c_str());
    text += line;
    text += std::string("      ") + f.help + "\n";
  }
  return text;
}

json runner_config_fields() {
  const RunnerConfig defaults;
  json rows = json::array();
  for (const Field& f : kFields) {
    json row = {{"path", f.path}, {"type", type_name(f.type)}, {"required", f.required}, {"is_path", f.is_path}};
    if (!f.required && f.type != FieldType::kObject) row["default"] = get_field(f, defaults);
    rows.push_back(std::move(row));
  }
  return rows;
}

json runner_config_to_json(const RunnerConfig& config) {
  json root = json::object();
  for (const Field& f : kFields) {
    if (f.type == FieldType::kObject) continue;
    json* node = &root;
    std::string path = f.path;
    size_t dot;
    while ((dot = path.find('.')) != std::string::npos) {
      node = &(*node)[path.substr(0, dot)];
      path = path.substr(dot + 1);
    }
    (*node)[path] = get_field(f, config);
  }
  return root;
}

Result<FrameKey> load_run_key(const std::string& path) {
  Result<std::string> read = read_file(path);
  ZL_RETURN_IF_ERROR_WITH_PREFIX(read, "run key: ");
  std::string text = std::move(read).value();
  auto is_space = [](char ch) { return std::isspace(static_cast<unsigned char>(ch)) != 0; };
  while (!text.empty() && is_space(text.back())) text.pop_back();
  size_t start = 0;
  while (start < text.size() && is_space(text[start])) ++start;
  text = text.substr(start);
  FrameKey key{};
  if (text.size() != 2 * kFrameKeySize || !parse_hex_key(text, &key)) {
    return Status(StatusCode::kInvalidArgument, "run key file '" + path + "' must hold 64 hex characters (32 bytes); found " +
                                                    std::to_string(text.size()) + " characters that are not a hex key");
  }
  return key;
}

}  // namespace zl
