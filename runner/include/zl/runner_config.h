// Per-stage runner configuration: one JSON object per stage, written by the
// orchestrator (zl_device) and passed as `zl_runner --config stage1.json`.
//
// The field table in runner_config.cpp is the single source for parsing,
// validation of types, `--help` text and `runner_config_to_json`; defaults
// are the member initializers below (and in AdamWConfig / LrSchedule).
//
// Example (stage 1 of 3):
//   {"program": "stage1.pte", "stage_index": 1, "num_stages": 3,
//    "listen": "0.0.0.0:7001", "downstream": "192.168.1.12:7002",
//    "run_key_file": "run.key", "run_id": "00112233445566778899aabbccddeeff",
//    "window_size": 4, "num_micro_batches": 128, "checkpoint_dir": "ckpt",
//    "optimizer": {"lr": 2e-4, "schedule": {"kind": "warmup_cosine", "warmup_steps": 2}}}
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "zl/adamw.h"
#include "zl/frame.h"
#include "zl/status.h"
#include "zl/window_plan.h"

namespace zl {

/// Everything one stage process needs to run. Relative paths in the file are
/// resolved against the config file's directory by load_runner_config.
struct RunnerConfig {
  std::string base_dir;           ///< relative paths resolve here; after parsing: the folder used (may be empty)
  std::string program;            ///< this stage's training program (.pte)
  std::string manifest;           ///< the export's manifest.json; empty = next to `program`
  int64_t stage_index = 0;        ///< 0-based
  int64_t num_stages = 0;         ///< K
  std::string data_shard;         ///< tokenized shard (stage 0 only)
  std::string listen;             ///< "host:port" for upstream DATA (stages > 0)
  std::string downstream;         ///< "host:port" of the next stage (stages < K-1)
  std::string coordinator;        ///< "host:port" of the coordinator; empty = none
  std::string run_key_file;       ///< file with the per-run MAC key: 64 hex chars
  std::string run_id;             ///< 32 hex chars (16 bytes), same on every stage
  int64_t window_size = 0;        ///< m: micro-batches per AdamW step
  int64_t num_micro_batches = 0;  ///< micro-batches in the whole run
  int64_t in_flight_depth = 4;    ///< D: un-acknowledged DATA entries per link
  int64_t input_timeout_s = 600;  ///< give up waiting for upstream input (or acks) after this; 0 = never
  std::string checkpoint_dir;     ///< root of window_* checkpoints
  int64_t checkpoint_interval = 1;  ///< checkpoint every n-th window (and the last)
  int64_t keep_last = 2;          ///< complete checkpoints kept
  std::string input_log_dir;      ///< durable inbound log; empty = <checkpoint_dir>/input_log
  bool resume = true;             ///< restore the latest checkpoint if there is one
  AdamWConfig optimizer;          ///< lr, betas, eps, weight_decay, schedule
  std::string link_profile = "local";  ///< local | wifi | mobile | constrained
  int64_t threads = 0;            ///< ExecuTorch CPU threads; 0 = runtime default
  std::string load_mode = "mmap";  ///< mmap: frozen weights mapped from the program file; file: read into heap
  std::string log_path = "metrics.jsonl";  ///< telemetry JSON lines (appended)
  bool early_forwarding = true;   ///< send hidden at the marker, before phase 2
  bool forward_only_at_lr0 = true;  ///< a held stage (role forward) runs phase 1 only (forward_only())
  /// train | forward (held still: lr 0, not the last, zerolock); empty in a
  /// config written before roles were: the role then follows from the lr.
  std::string role;
  /// Save the window's gradient sum per micro-batch (docs/design#recovery-in-detail).
  bool accumulator_snapshots = true;
  int64_t seed = 0;               ///< for anything random in the runner (data order)
  int64_t hold_at_micro_batch = -1;  ///< failure injection: park after sending this micro-batch; -1 = never
  /// zerolock: the local-loss step (two phases); gpipe | 1f1b | async: end-to-end
  /// backprop with a backprop program (pipeline_schedule.h, docs/design#backprop-schedules).
  std::string schedule = "zerolock";
  std::string grad_wire_dtype = "bf16";  ///< GRAD frames upstream: bf16 (half the bytes) or f32
  /// A backprop schedule's stage before the last keeps each micro-batch's
  /// forward suspended at the marker until its gradient comes, instead of
  /// running the forward again in the backward: one program instance (its
  /// planned memory) per micro-batch in flight (docs/design#backprop-schedules).
  bool keep_activations = false;

  /// How num_micro_batches fall into windows of window_size.
  WindowPlan window_plan() const { return WindowPlan(num_micro_batches, window_size); }
  /// Number of update windows: ceil(num_micro_batches / window_size).
  int64_t num_windows() const { return window_plan().num_windows(); }
  bool is_first_stage() const { return stage_index == 0; }
  bool is_last_stage() const { return stage_index == num_stages - 1; }
  /// A stage held still (role forward: `zl train --stage-lr 0,0,1` gives it
  /// lr 0 and it is not the last): its weights never move, so it runs phase 1
  /// only, sends the hidden state and skips the readout, loss and backward
  /// (docs/design#windows-and-adamw). The last stage always computes its loss.
  /// forward_only_at_lr0: false keeps phase 2 (for its losses). A config
  /// without a role (older runs) is held by the same rule on its lr that
  /// zl_device/formats/stage_spec.py stage_role applies; validate() refuses a
  /// role that contradicts it. Never under a backprop schedule: its
  /// grad_input is owed upstream whatever its lr.
  bool held_still() const {
    return role.empty() ? optimizer.lr == 0.0 && !is_last_stage() && schedule == "zerolock" : role == "forward";
  }
  bool forward_only() const { return forward_only_at_lr0 && held_still(); }
};

/// Parses a JSON text into a config and validates it. Unknown fields, missing
/// required fields, wrong types and bad values fail with a message naming
/// the field (e.g. "optimizer.lr"), the expected type and the value seen.
/// Relative paths are joined to the config's own `base_dir` field, which is
/// itself joined to the `base_dir` argument when relative; without the
/// field, to the argument (unless it is empty).
/// For warmup_cosine with total_steps 0, total_steps becomes num_windows().
Result<RunnerConfig> parse_runner_config(const std::string& json_text, const std::string& base_dir);

/// Reads `path` and parses it; relative paths resolve against its directory.
Result<RunnerConfig> load_runner_config(const std::string& path);

/// Parses just an "optimizer" object (same fields, defaults and messages as
/// in the stage config) and validates it; used by tools that run AdamW alone.
Result<AdamWConfig> parse_optimizer_config(const nlohmann::json& optimizer);

/// The `--help` text: every field with type, default (or "required") and
/// meaning, in the order of the field table.
std::string runner_config_help();

/// The field table as data, for tools that write configs (zl_device/formats/runner_config.py is checked
/// against it): one object per row, {"path", "type", "required", "is_path", "default"} ("default" absent for
/// required fields and object rows), in table order. `zl_runner --config-fields` prints it.
nlohmann::json runner_config_fields();

/// The effective configuration (all fields, defaults filled in), for logs.
nlohmann::json runner_config_to_json(const RunnerConfig& config);

/// Reads the run key: the file holds the 32-byte key as 64 hex characters
/// (surrounding whitespace, e.g. a trailing newline, is ignored). Hex rather
/// than raw bytes so it survives `adb push`, shell tools and JSON alike.
Result<FrameKey> load_run_key(const std::string& path);

}  // namespace zl
