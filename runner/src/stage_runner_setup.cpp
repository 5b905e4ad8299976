// StageRunner's setup: key, telemetry, program, optimizer, checkpoint
// restore, input (shard or Receiver), Sender, coordinator; in this order,
// each a step that names what failed.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "stage_runner.h"
#include "zl/accumulator_snapshot.h"
#include "zl/checkpoint_layout.h"
#include "zl/cpu_features.h"
#include "zl/durable_file.h"
#include "zl/input_log.h"
#include "zl/host_port.h"
#include "zl/link_profile.h"
#include "zl/log.h"

namespace zl::internal {

using nlohmann::json;

Status StageRunner::setup() {
  const RunnerConfig& c = config_;
  setup_start_unix_ms_ = unix_ms_now();
  ZL_ASSIGN_OR_RETURN(key_, load_run_key(c.run_key_file));
  if (!parse_hex_run_id(c.run_id, &run_id_)) {
    return Status(StatusCode::kInvalidArgument, "run_id \"" + c.run_id + "\" is not 32 hex characters");
  }
  if (!c.log_path.empty()) {
    ZL_RETURN_IF_ERROR(make_directories(dir_of(c.log_path)));
    ZL_ASSIGN_OR_RETURN(telemetry_, TelemetryWriter::open(c.log_path));
  }
  const Clock::time_point load_start = Clock::now();
  ZL_RETURN_IF_ERROR(load_program());
  program_load_ms_ = ms_since(load_start);
  program_loaded_unix_ms_ = unix_ms_now();
  ZL_ASSIGN_OR_RETURN(optimizer_, AdamW::create(c.optimizer, program_->parameters()));
  CheckpointOptions checkpoint_options;
  checkpoint_options.dir = c.checkpoint_dir;
  checkpoint_options.interval = c.checkpoint_interval;
  checkpoint_options.keep_last = c.keep_last;
  store_.reset(new CheckpointStore(checkpoint_options));
  ZL_RETURN_IF_ERROR(store_->validate());
  if (c.is_first_stage()) {
    ZL_ASSIGN_OR_RETURN(shard_, DataShard::load(c.data_shard, program_->batch(), program_->seq_len()));
  }
  // A hot standby stops here until it takes over: what follows needs the
  // checkpoint, the input log and the listening port of the stage it replaces.
  if (standby_ != nullptr) ZL_RETURN_IF_ERROR(stand_by());
  ZL_RETURN_IF_ERROR(restore());
  ZL_RETURN_IF_ERROR(load_instances());

  if (!c.is_first_stage()) ZL_RETURN_IF_ERROR(start_receiver());
  if (!c.is_last_stage()) ZL_RETURN_IF_ERROR(start_sender());
  // A backprop schedule restarts from a window's checkpoint: its gradient sums
  // need the downstream's gradients, which a restart gets again from there.
  if (c.accumulator_snapshots && !backprop()) {
    ZL_RETURN_IF_ERROR(make_directories(c.checkpoint_dir));
    snapshots_.reset(new AccumulatorSnapshotWriter(accumulator_snapshot_path(c.checkpoint_dir)));
  }
  write_start_line();
  ZL_RETURN_IF_ERROR(start_control());
  log(LogLevel::kInfo, "stage %lld/%lld: micro-batches %lld..%lld, window %lld, early forwarding %s%s",
      static_cast<long long>(c.stage_index), static_cast<long long>(c.num_stages),
      static_cast<long long>(start_mb_), static_cast<long long>(c.num_micro_batches - 1),
      static_cast<long long>(c.window_size), c.early_forwarding ? "on" : "off",
      forward_only_ ? "; held still (lr 0): forward only" : "");
  return Status();
}

Status StageRunner::load_program() {
  const RunnerConfig& c = config_;
  // Which kernel variants this CPU gets (docs/design#runner-process, kernel paths).
  log(LogLevel::kInfo, "kernel path: %s (cpu features: %s)", kernel_path_name(kernel_path()),
      cpu_features_str(cpu_features()).c_str());
  ZL_ASSIGN_OR_RETURN(program_, StageProgram::load(program_options()));
  if (program_->stage_index() != c.stage_index || program_->is_last() != c.is_last_stage()) {
    return Status(StatusCode::kInvalidArgument,
                  "program " + c.program + " is stage " + std::to_string(program_->stage_index()) +
                      (program_->is_last() ? " (a last stage)" : " (not a last stage)") + ", the config says stage " +
                      std::to_string(c.stage_index) + " of " + std::to_string(c.num_stages));
  }
  return check_program_kind();
}

StageProgramOptions StageRunner::program_options() const {
  StageProgramOptions options;
  options.program_path = config_.program;
  options.manifest_path = config_.manifest;
  options.threads = config_.threads;
  options.map_file = config_.load_mode != "file";
  return options;
}

Status StageRunner::stand_by() {
  const RunnerConfig& c = config_;
  report([](StageProgress* p) { p->phase = "standby"; });
  log(LogLevel::kInfo, "stage %lld: standing by (program loaded in %.0f ms); waiting to take over",
      static_cast<long long>(c.stage_index), program_load_ms_);
  emit_event("{\"event\": \"standby\", \"stage\": %" PRId64 ", \"pid\": %lld, \"program_load_ms\": %.1f}",
             c.stage_index, static_cast<long long>(::getpid()), program_load_ms_);
  ZL_RETURN_IF_ERROR(standby_->wait_for_takeover(stop_));
  took_over_unix_ms_ = unix_ms_now();
  log(LogLevel::kInfo, "stage %lld: taking over", static_cast<long long>(c.stage_index));
  report([](StageProgress* p) { p->phase = "loading"; });
  return Status();
}

Status StageRunner::start_receiver() {
  const RunnerConfig& c = config_;
  ReceiverOptions options;
  ZL_ASSIGN_OR_RETURN(const HostPort listen, parse_host_port(c.listen, PortZero::kAllowed));
  options.host = listen.host;
  options.port = listen.port;
  options.key = key_;
  options.expect.run_id = run_id_;
  options.expect.stage = static_cast<uint32_t>(c.stage_index - 1);
  options.expect.batch = program_->batch();
  options.expect.seq_len = program_->seq_len();
  options.expect.hidden_size = program_->hidden_size();
  options.stage = static_cast<uint32_t>(c.stage_index);
  options.log_dir = c.input_log_dir;
  options.max_pending = static_cast<size_t>(c.in_flight_depth);
  options.first_micro_batch = static_cast<uint64_t>(start_mb_);
  // The link's emulated network holds both ways: the GRADs this stage sends up are shaped as its DATA going down.
  ZL_ASSIGN_OR_RETURN(options.profile, link_profile_from_name(c.link_profile));
  if (restored_window_) options.committed_window = static_cast<uint64_t>(*restored_window_);
  receiver_.reset(new Receiver(options));
  ZL_RETURN_IF_ERROR_WITH_PREFIX(receiver_->start(), "listen " + c.listen + ": ");
  for (const CorruptLogFile& bad : receiver_->input_log().corrupt()) {
    log(LogLevel::kWarn, "input log: set aside %s (%s)", bad.path.c_str(), bad.reason.c_str());
  }
  // Tests and orchestrators that asked for port 0 read the real one here.
  emit_event("{\"event\": \"listening\", \"stage\": %" PRId64 ", \"port\": %u}", c.stage_index,
             static_cast<unsigned>(receiver_->port()));
  return Status();
}

Status StageRunner::start_sender() {
  const RunnerConfig& c = config_;
  SenderOptions options;
  ZL_ASSIGN_OR_RETURN(const HostPort downstream, parse_host_port(c.downstream));
  options.host = downstream.host;
  options.port = downstream.port;
  options.key = key_;
  options.stage = static_cast<uint32_t>(c.stage_index);
  options.run_id = run_id_;
  options.max_in_flight = static_cast<size_t>(c.in_flight_depth);
  ZL_ASSIGN_OR_RETURN(options.profile, link_profile_from_name(c.link_profile));
  if (backprop()) {
    // G: the gradients this stage's schedule may be owed at once (its micro-batches in flight).
    const int64_t owed = max_in_flight(schedule_ops(schedule_, c.stage_index, c.num_stages, plan_, start_mb_));
    options.max_grads_in_flight = static_cast<size_t>(std::max<int64_t>(owed, 1));
    options.batch = program_->batch();
    options.seq_len = program_->seq_len();
    options.hidden_size = program_->hidden_size();
  }
  sender_.reset(new Sender(options));
  ZL_RETURN_IF_ERROR_WITH_PREFIX(sender_->start(), "downstream " + c.downstream + ": ");
  return Status();
}

void StageRunner::write_start_line() {
  if (!telemetry_) return;
  const RunnerConfig& c = config_;
  json start = {{"type", "start"},
                {"stage", c.stage_index},
                {"num_stages", c.num_stages},
                {"pid", static_cast<int64_t>(::getpid())},
                {"first_micro_batch", start_mb_},
                {"resumed_from_window", restored_window_ ? json(*restored_window_) : json(nullptr)},
                {"listen_port", receiver_ ? json(receiver_->port()) : json(nullptr)},
                {"setup_start_unix_ms", setup_start_unix_ms_},
                {"program_load_ms", program_load_ms_},
                {"program_loaded_unix_ms", program_loaded_unix_ms_},
                {"standby", standby_ != nullptr},
                {"took_over_unix_ms", took_over_unix_ms_ ? json(*took_over_unix_ms_) : json(nullptr)},
                {"ready_unix_ms", unix_ms_now()},
                {"resumed_from_snapshot", resumed_accumulated_},
                {"forward_only", forward_only_},
                {"threads", program_ ? json(program_->threads()) : json(nullptr)},
                {"config", runner_config_to_json(c)}};
  (void)telemetry_->write_json(start);
}

Status StageRunner::start_control() {
  const RunnerConfig& c = config_;
  if (c.coordinator.empty()) return Status();
  ZL_ASSIGN_OR_RETURN(ControlClientOptions o, control_options_from_config(c, key_));
  if (receiver_) {
    ZL_ASSIGN_OR_RETURN(o.listen, with_port(c.listen, receiver_->port()));
  }
  o.resume = restored_window_.has_value();
  o.micro_batches_done = start_mb_;
  o.chain_stop = stop_;  // the caller's flag (JNI stopNative, signals) keeps working
  control_.reset(new ControlClient(o));
  // start() returns at once; the client connects in the background.
  ZL_RETURN_IF_ERROR_WITH_PREFIX(control_->start(), "coordinator " + c.coordinator + ": ");
  stop_ = control_->stop_flag();  // true on STOP or when the chained flag is set
  control_->set_phase(ControlPhase::kRunning);
  return Status();
}

Status StageRunner::restore() {
  const RunnerConfig& c = config_;
  Result<std::vector<int64_t>> listed = store_->list_windows();
  if (!listed.ok() && listed.status().code() != StatusCode::kNotFound) return listed.status();
  const std::vector<int64_t> windows = listed.ok() ? std::move(listed).value() : std::vector<int64_t>();
  if (!c.resume) {
    if (!windows.empty()) {
      return Status(StatusCode::kInvalidArgument,
                    "checkpoint_dir " + c.checkpoint_dir + " already holds window " + std::to_string(windows.back()) +
                        "; resume (--resume / \"resume\": true) or use an empty checkpoint_dir");
    }
    return Status();
  }
  if (windows.empty()) {
    resume_accumulator(0);
    return Status();
  }
  CheckpointProgress progress;
  bool found = true;
  Result<CheckpointProgress> loaded = store_->load(windows.back(), optimizer_.get());
  const Status newest = loaded.status();
  if (loaded.ok()) {
    progress = std::move(loaded).value();
  } else {
    ZL_RETURN_IF_ERROR(fall_back(windows, newest, &progress, &found));
  }
  if (!found) return Status();
  if (progress.run_id != c.run_id || progress.stage != c.stage_index) {
    return Status(StatusCode::kInvalidArgument,
                  "checkpoint in " + c.checkpoint_dir + " is of run " + progress.run_id + " stage " +
                      std::to_string(progress.stage) + ", this is run " + c.run_id + " stage " +
                      std::to_string(c.stage_index) + "; use another checkpoint_dir");
  }
  const int64_t expected_done = plan_.end_micro_batch(progress.window);
  if (progress.micro_batches_done != expected_done) {
    return Status(StatusCode::kInvalidArgument,
                  "checkpoint window " + std::to_string(progress.window) + " says " +
                      std::to_string(progress.micro_batches_done) + " micro-batches done, window_size " +
                      std::to_string(c.window_size) + " implies " + std::to_string(expected_done) +
                      "; was window_size changed? Resume with the original settings");
  }
  start_mb_ = progress.micro_batches_done;
  restored_window_ = progress.window;
  if (backprop()) ZL_RETURN_IF_ERROR(restore_weight_versions(progress.window));
  log(LogLevel::kInfo, "resumed from checkpoint window %lld (optimizer step %lld); replaying from micro-batch %lld",
      static_cast<long long>(progress.window), static_cast<long long>(progress.optimizer_step),
      static_cast<long long>(start_mb_));
  if (newest.ok()) resume_accumulator(progress.window + 1);
  return Status();
}

// A checkpoint the async schedule took with micro-batches in flight holds
// the older weight versions they ran forward on; the restart re-runs those
// forwards (and their backwards) on them, as the uninterrupted run did.
Status StageRunner::restore_weight_versions(int64_t window) {
  const std::string path = CheckpointLayout(config_.checkpoint_dir).window_dir(window) + "/" + kWeightVersionsFile;
  if (::access(path.c_str(), F_OK) != 0) return Status();
  ZL_ASSIGN_OR_RETURN(const SafetensorsFile file, read_safetensors(path));
  ZL_RETURN_IF_ERROR(versions_.restore(file, program_->parameters(), path));
  log(LogLevel::kInfo, "restored %zu older weight version(s) from %s", versions_.num_kept(), path.c_str());
  return Status();
}

// An accumulator snapshot of the window after the restored checkpoint
// continues it where the stage stopped (docs/design#recovery-in-detail): the gradient sum
// of its first micro-batches, bit for bit what accumulate() had made of them.
// Anything else (none, torn, another window) leaves the replay from the
// checkpoint, which is exact too.
void StageRunner::resume_accumulator(int64_t window) {
  const RunnerConfig& c = config_;
  if (!c.accumulator_snapshots || backprop() || window >= plan_.num_windows()) return;
  const std::string path = accumulator_snapshot_path(c.checkpoint_dir);
  Result<AccumulatorSnapshot> read = read_accumulator_snapshot(path);
  if (read.status().code() == StatusCode::kNotFound) return;
  Status status = read.status();
  const AccumulatorSnapshot snapshot = read.ok() ? std::move(read).value() : AccumulatorSnapshot();
  if (status.ok()) {
    status = check_accumulator_snapshot(snapshot, c.run_id, c.stage_index, window, plan_.first_micro_batch(window),
                                        plan_.end_micro_batch(window), *optimizer_);
  }
  // A forward-only stage's snapshot holds its progress only (zero sums): its
  // optimizer accumulates nothing, so that skip_step() ends the window.
  if (status.ok() && !forward_only_) {
    std::vector<const float*> sums(optimizer_->num_params(), nullptr);
    for (size_t i = 0; i < snapshot.names.size(); ++i) {
      sums[static_cast<size_t>(optimizer_->find(snapshot.names[i]))] = snapshot.sums[i].data();
    }
    status = optimizer_->restore_accumulator(snapshot.accumulated, sums);
  }
  if (!status.ok()) {
    log(LogLevel::kInfo, "accumulator snapshot %s not used (%s); replaying from micro-batch %lld", path.c_str(),
        status.message().c_str(), static_cast<long long>(start_mb_));
    return;
  }
  start_mb_ = snapshot.micro_batches_done;
  resumed_accumulated_ = snapshot.accumulated;
  resumed_sums_.count = snapshot.accumulated;
  resumed_sums_.loss = snapshot.loss_sum;
  resumed_sums_.task = snapshot.task_loss_sum;
  resumed_sums_.consistency = snapshot.consistency_loss_sum;
  log(LogLevel::kInfo, "accumulator snapshot: window %lld continues at micro-batch %lld (%lld micro-batches not "
      "replayed)", static_cast<long long>(window), static_cast<long long>(start_mb_),
      static_cast<long long>(snapshot.accumulated));
}

// The newest checkpoint does not load (docs/design#recovery-in-detail, "A corrupt newest
// checkpoint"). Resuming from an older one is exact only if every input after
// it can still be replayed locally: stage 0 re-reads its shard, a stage k>0
// needs its input log to hold every micro-batch from the older checkpoint to
// the end of the corrupt window, because upstream keeps only what this stage
// has not acknowledged and committing the corrupt window deleted its entries.
// Exact: the corrupt directory is set aside (renamed corrupt-window_N-<ms>,
// never deleted) and the stage resumes from the older one (or from the start).
// Not exact: kUnrecoverable (exit 2, not retried), the directory left as it is.
Status StageRunner::fall_back(const std::vector<int64_t>& windows, const Status& why, CheckpointProgress* progress,
                              bool* found) {
  const RunnerConfig& c = config_;
  const CheckpointLayout layout(c.checkpoint_dir);
  const int64_t corrupt_window = windows.back();
  const std::string corrupt_dir = layout.window_dir(corrupt_window);
  *found = false;
  int64_t older = -1;  // the newest older checkpoint that loads; -1: none, start over
  for (auto it = windows.rbegin() + 1; it != windows.rend() && !*found; ++it) {
    Result<CheckpointProgress> loaded = store_->load(*it, optimizer_.get());
    if (loaded.ok()) {
      *progress = std::move(loaded).value();
      *found = true;
      older = *it;
    } else {
      log(LogLevel::kWarn, "checkpoint %s does not load either: %s", layout.window_dir(*it).c_str(),
          loaded.status().message().c_str());
    }
  }
  const int64_t replay_from = *found ? progress->micro_batches_done : 0;
  const int64_t replay_end = plan_.end_micro_batch(corrupt_window);
  const std::string target = *found ? "window " + std::to_string(older) : "the start of the run";
  if (!c.is_first_stage()) {
    const InputLog input_log(c.input_log_dir,
                             derive_frame_key(key_, KeyPurpose::kInputLog, static_cast<uint32_t>(c.stage_index)));
    for (int64_t mb = replay_from; mb < replay_end; ++mb) {
      const std::string entry = input_log.path_for(static_cast<uint64_t>(plan_.window_of(mb)),
                                                   static_cast<uint64_t>(mb));
      if (::access(entry.c_str(), F_OK) == 0) continue;
      return Status(StatusCode::kUnrecoverable,
                    "newest checkpoint " + corrupt_dir + " is unusable: " + why.message() + ". Stage " +
                        std::to_string(c.stage_index) + " cannot go back to " + target +
                        " exactly: its input log " + c.input_log_dir + " no longer holds micro-batch " +
                        std::to_string(mb) + " (deleted once its window was committed) and upstream does not "
                        "keep what this stage acknowledged. " +
                        "The directory is left as it is; put an intact copy of it back and restart the stage, " +
                        "or start the run again");
    }
  }
  const int64_t now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
  const std::string aside =
      layout.entry("corrupt-" + checkpoint_dir_name(corrupt_window) + "-" + std::to_string(now_ms));
  if (std::rename(corrupt_dir.c_str(), aside.c_str()) != 0) {
    return Status(StatusCode::kIoError, "newest checkpoint " + corrupt_dir + " is unusable (" + why.message() +
                                            ") and cannot be set aside as " + aside + ": " + std::strerror(errno));
  }
  ZL_RETURN_IF_ERROR(fsync_directory(layout.root()));
  log(LogLevel::kWarn,
      "newest checkpoint %s is unusable (%s); set aside as %s. Resuming exactly from %s: replaying "
      "micro-batches %lld..%lld from %s",
      corrupt_dir.c_str(), why.message().c_str(), aside.c_str(), target.c_str(), static_cast<long long>(replay_from),
      static_cast<long long>(replay_end - 1), c.is_first_stage() ? "the shard" : "the input log");
  return Status();
}

}  // namespace zl::internal
