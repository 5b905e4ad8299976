// run_stage and StageRunner's loop: per micro-batch input, the two phases,
// the send and the gradient accumulation; per window the AdamW step, flush,
// checkpoint and commit. Setup is in stage_runner_setup.cpp.
#include "zl/runner.h"

#include <sys/resource.h>

#include <chrono>
#include <cinttypes>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "stage_runner.h"
#include "zl/durable_file.h"
#include "zl/log.h"

namespace zl {
namespace internal {
namespace {

using nlohmann::json;

}  // namespace

double process_cpu_s() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  const auto seconds = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec / 1e6; };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

Status StageRunner::run() {
  report([this](StageProgress* p) {
    p->phase = "loading";
    p->stage_index = config_.stage_index;
    p->num_stages = config_.num_stages;
    p->num_micro_batches = config_.num_micro_batches;
  });
  Status status = setup();
  if (status.ok()) status = loop();
  if (control_) {
    if (!status.ok() && status.code() != StatusCode::kClosed) (void)control_->error(status.message());
    control_->set_phase(status.ok() ? ControlPhase::kDone
                        : status.code() == StatusCode::kClosed ? ControlPhase::kStopped
                                                               : ControlPhase::kFailed);
    control_->shutdown();  // queued WINDOW_COMMITTED / ERROR and a last heartbeat, bounded by flush_timeout
  }
  shutdown();
  return status;
}

Status StageRunner::hold(int64_t mb) {
  // Failure injection (config hold_at_micro_batch): the hidden state of `mb`
  // is downstream, its gradient is not accumulated: the worst moment to die.
  log(LogLevel::kWarn, "holding after sending micro-batch %lld (hold_at_micro_batch) until killed or stopped",
      static_cast<long long>(mb));
  // The previous micro-batch's accumulator snapshot is on disk before the
  // "hold" line: where a restart continues does not depend on timing.
  if (snapshots_) snapshots_->drain();
  if (telemetry_) {
    const int64_t now_ms = std::chrono::duration_cast<milliseconds>(
                               std::chrono::system_clock::now().time_since_epoch()).count();
    (void)telemetry_->write_json({{"type", "hold"}, {"stage", config_.stage_index}, {"micro_batch", mb},
                                  {"t_unix_ms", now_ms}});
  }
  while (!stopping(stop_)) std::this_thread::sleep_for(kPollSlice);
  return stop_status("held at micro-batch " + std::to_string(mb));
}

Status StageRunner::take_input(int64_t mb, InputEntry* entry, StageInputs* inputs, double* queue_ms) {
  const Clock::time_point start = Clock::now();
  if (config_.is_first_stage()) {
    shard_.micro_batch(mb, inputs);
    *queue_ms = ms_since(start);
    return Status();
  }
  auto next_entry = [&](milliseconds slice) -> Status {
    Result<InputEntry> next = receiver_->next(slice);
    if (!next.ok()) return next.status();
    *entry = std::move(next).value();
    return Status();
  };
  ZL_RETURN_IF_ERROR(wait_sliced(next_entry, stop_,
                                 config_.input_timeout_s,
                                 "waiting for micro-batch " + std::to_string(mb) + " from stage " +
                                     std::to_string(config_.stage_index - 1)));
  *queue_ms = ms_since(start);
  return inputs_of(mb, *entry, inputs);
}

Status StageRunner::inputs_of(int64_t mb, const InputEntry& entry, StageInputs* inputs) {
  if (config_.is_first_stage()) {
    shard_.micro_batch(mb, inputs);
    return Status();
  }
  const uint64_t window = static_cast<uint64_t>(plan_.window_of(mb));
  if (entry.micro_batch != static_cast<uint64_t>(mb) || entry.window != window) {
    return Status(StatusCode::kCorrupt, "upstream entry is micro-batch " + std::to_string(entry.micro_batch) +
                                            " of window " + std::to_string(entry.window) + ", expected " +
                                            std::to_string(mb) + " of window " + std::to_string(window) +
                                            "; do all stages use the same window_size?");
  }
  const TensorRecord* hidden = entry.frame.find("hidden");
  const TensorRecord* mask = entry.frame.find("attention_mask");
  const TensorRecord* labels = entry.frame.find("labels");
  if (hidden == nullptr || mask == nullptr || labels == nullptr) {
    return Status(StatusCode::kCorrupt, "upstream entry " + std::to_string(mb) + " lacks hidden/attention_mask/labels");
  }
  inputs->hidden = reinterpret_cast<const float*>(hidden->data.data());
  inputs->attention_mask = reinterpret_cast<const int64_t*>(mask->data.data());
  inputs->labels = reinterpret_cast<const int64_t*>(labels->data.data());
  return Status();
}

Status StageRunner::send_hidden(int64_t mb, const StageInputs& inputs, const std::vector<float>& hidden) {
  const uint64_t window = static_cast<uint64_t>(plan_.window_of(mb));
  const Frame frame = make_data_frame(run_id_, static_cast<uint32_t>(config_.stage_index), window,
                                      static_cast<uint64_t>(mb), program_->batch(), program_->seq_len(),
                                      program_->hidden_size(), hidden.data(), inputs.attention_mask, inputs.labels);
  return wait_sliced([&](milliseconds slice) { return sender_->send(frame, slice); }, stop_, config_.input_timeout_s,
                     "sending micro-batch " + std::to_string(mb) + " to " + config_.downstream);
}

// A loss or weight that is nan or inf is a damaged run: the stage diverged (a
// learning rate too high) or its input was damaged. Stepping on it or
// checkpointing it would put NaNs over the last good checkpoint, and a restart
// would replay into the same values, so the stage stops for good
// (kUnrecoverable: exit 2, not retried) with its last good checkpoint kept.
Status StageRunner::damaged_run(int64_t window, const std::string& what) const {
  const Result<std::vector<int64_t>> windows = store_->list_windows();
  const std::string kept =
      windows.ok() && !windows->empty() ? "window " + std::to_string(windows->back()) : "none yet";
  return Status(StatusCode::kUnrecoverable,
                "stage " + std::to_string(config_.stage_index) + " window " + std::to_string(window) + ": " + what +
                    ", a damaged run (diverged?): not stepped or checkpointed; the stage stops with its last good "
                    "checkpoint (" + kept + "). Lower the learning rate (--lr, --stage-lr) or check the data, and "
                    "train again");
}

Status StageRunner::end_window(int64_t window, int64_t last_mb, const WindowSums& sums) {
  const RunnerConfig& c = config_;
  if (!forward_only_ && !std::isfinite(sums.loss)) {
    return damaged_run(window, "the loss summed over its " + std::to_string(sums.count) + " micro-batches is " +
                                   std::to_string(sums.loss));
  }
  // A forward-only stage accumulated nothing: its step only counts (the
  // schedule and the checkpoint's optimizer_step move on, the weights do not).
  ZL_ASSIGN_OR_RETURN(const double lr, forward_only_ ? optimizer_->skip_step() : optimizer_->step());
  for (size_t i = 0; i < optimizer_->num_params() && !forward_only_; ++i) {
    const TrainableParam& p = optimizer_->param(i);  // a finite loss can still step into inf (a huge lr)
    const int64_t bad = first_non_finite(p.data, static_cast<int64_t>(p.numel()));
    if (bad >= 0) {
      return damaged_run(window, "the AdamW step made " + p.name + " " + std::to_string(p.data[bad]) +
                                     " at element " + std::to_string(bad));
    }
  }
  if (sender_) {
    // Commit only what downstream holds durably (see runner.h, step 6).
    ZL_RETURN_IF_ERROR(wait_sliced([&](milliseconds slice) { return sender_->flush(slice); }, stop_,
                                   c.input_timeout_s,
                                   "waiting for " + c.downstream + " to acknowledge window " + std::to_string(window)));
  }
  std::optional<double> checkpoint_ms;
  if (store_->due(window, plan_.is_last_of_run(last_mb))) {
    const Clock::time_point start = Clock::now();
    CheckpointProgress progress;
    progress.run_id = c.run_id;
    progress.stage = c.stage_index;
    progress.window = window;
    progress.last_micro_batch = last_mb;
    progress.micro_batches_done = last_mb + 1;
    progress.optimizer_step = optimizer_->step_count();
    progress.lr = lr;
    progress.extra = {{"program", base_of(c.program)}, {"window_size", c.window_size},
                      {"num_micro_batches", c.num_micro_batches}};
    // The async schedule's micro-batches in flight run on older weights a restart needs too.
    ZL_RETURN_IF_ERROR(store_->save(*optimizer_, progress, versions_.tensors(program_->parameters())));
    if (receiver_) {
      const Status cleaned = receiver_->window_committed(static_cast<uint64_t>(window));
      if (!cleaned.ok()) log(LogLevel::kWarn, "input log cleanup after window %lld: %s",
                             static_cast<long long>(window), cleaned.message().c_str());
    }
    checkpoint_ms = ms_since(start);
  }
  WindowRecord record;
  {
    record.stage = c.stage_index;
    record.window = window;
    record.micro_batches = sums.count;
    // A backprop stage before the last summed <h, grad_hidden>: no loss to show (null), as in its micro-batch lines.
    record.mean_loss = backprop() && program_->takes_gradient() ? std::numeric_limits<double>::quiet_NaN()
                       : sums.count > 0                         ? sums.loss / sums.count
                                                                : 0;
    record.mean_task_loss = sums.count > 0 ? sums.task / sums.count : 0;
    record.mean_consistency_loss = sums.count > 0 ? sums.consistency / sums.count : 0;
    record.lr = lr;
    record.step = optimizer_->step_count();
    record.checkpoint_ms = checkpoint_ms;
    record.pss_mib = read_pss_mib();
    record.temperature_c = read_temperature_c();
    record.forward_only = forward_only_;
  }
  if (telemetry_) (void)telemetry_->write(record);
  if (control_) (void)control_->window_committed(WindowCommittedEvent::from(record, last_mb + 1));
  return Status();
}

Status StageRunner::loop() {
  if (backprop()) return loop_backprop();
  const RunnerConfig& c = config_;
  // The zerolock row of the schedule table: per micro-batch its forward (phase 1, the hidden state sent at the
  // marker) and its backward (phase 2 on the local loss), back to back; the window's step after its last.
  const std::vector<ScheduleOp> ops = schedule_ops(schedule_, c.stage_index, c.num_stages, plan_, start_mb_);
  WindowSums sums = resumed_sums_;  // empty unless an accumulator snapshot continued the window
  int64_t done = start_mb_;
  const Clock::time_point run_start = Clock::now();
  const double cpu_start = process_cpu_s();
  report_running();
  std::optional<ZeroLockStep> step;  // a micro-batch between its phase 1 and its phase 2
  MicroBatchRecord record;           // the last micro-batch's; reported after its window's step when one follows
  const auto loss = [&] { return forward_only_ ? std::nullopt : std::optional<double>(record.loss); };
  for (size_t i = 0; i < ops.size(); ++i) {
    const int64_t mb = ops[i].micro_batch;
    if (ops[i].kind == ScheduleOp::Kind::kStep) {
      ZL_RETURN_IF_ERROR(end_window(plan_.window_of(mb), mb, sums));
      sums = WindowSums();
      report_done(mb, /*window_end=*/true, record, loss());
      continue;
    }
    if (ops[i].kind == ScheduleOp::Kind::kForward) {
      if (stopping(stop_)) return stop_status("before micro-batch " + std::to_string(mb));
      record = MicroBatchRecord();
      ZL_RETURN_IF_ERROR(phase_one(mb, &step.emplace(), &record));
      continue;
    }
    StageStepResult result;
    ZL_RETURN_IF_ERROR(phase_two(&*step, &record, &result));
    step.reset();
    if (forward_only_) {
      sums.add_forward_only();
    } else {
      sums.add(result);
    }
    write_micro_batch(&record);
    done = mb + 1;
    if (i + 1 < ops.size() && ops[i + 1].kind == ScheduleOp::Kind::kStep) continue;
    snapshot_accumulator(mb, sums);
    report_done(mb, /*window_end=*/false, record, loss());
  }
  finish_run(done - start_mb_, ms_since(run_start) / 1000.0, process_cpu_s() - cpu_start);
  return Status();
}

void StageRunner::report_running() {
  report([&](StageProgress* p) {
    p->phase = "running";
    p->micro_batches_done = start_mb_;
    p->committed_window = restored_window_.value_or(-1);
  });
}

void StageRunner::report_done(int64_t mb, bool window_end, const MicroBatchRecord& record,
                              std::optional<double> loss) {
  const int64_t window = plan_.window_of(mb);
  report([&](StageProgress* p) {
    p->micro_batches_done = mb + 1;
    p->window = window;
    if (window_end) p->committed_window = window;
    p->loss = loss;
    p->pss_mib = record.pss_mib;
    p->temperature_c = record.temperature_c;
  });
  if (control_) control_->update_progress(mb + 1, window);
}

Status StageRunner::phase_one(int64_t mb, ZeroLockStep* step, MicroBatchRecord* record) {
  step->start = Clock::now();
  record->stage = config_.stage_index;
  record->window = plan_.window_of(mb);
  record->micro_batch = mb;
  step->micro_batch = mb;
  // A later stage's input lives in step->entry until its hidden state is sent.
  ZL_RETURN_IF_ERROR(take_input(mb, &step->entry, &step->inputs, &record->queue_ms));
  return begin_micro_batch(mb, step->inputs, record);
}

Status StageRunner::phase_two(ZeroLockStep* step, MicroBatchRecord* record, StageStepResult* result) {
  Clock::time_point t = Clock::now();
  if (forward_only_) {
    // lr 0: phase 2's gradients could not move the weights. The parked method
    // stops at the marker; no loss, no gradient, phase2_ms stays 0.
    ZL_RETURN_IF_ERROR(program_->abandon());
    record->forward_only = true;
  } else {
    ZL_ASSIGN_OR_RETURN(*result, program_->finish());
    record->phase2_ms = ms_since(t);
  }

  if (sender_ && !config_.early_forwarding) {
    t = Clock::now();
    const Status sent = send_hidden(step->micro_batch, step->inputs, hidden_);
    record->send_ms = ms_since(t);
    ZL_RETURN_IF_ERROR(sent);
  }

  if (!forward_only_) {
    ZL_RETURN_IF_ERROR(optimizer_->accumulate(result->gradients));
    record->loss = result->loss;
    record->task_loss = result->task_loss;
    record->consistency_loss = result->consistency_loss;
  }
  record->total_ms = ms_since(step->start);
  return Status();
}

Status StageRunner::begin_micro_batch(int64_t mb, const StageInputs& inputs, MicroBatchRecord* record,
                                      StageProgram* program) {
  StageProgram* p = program != nullptr ? program : program_.get();
  const Clock::time_point t = Clock::now();
  ZL_RETURN_IF_ERROR(p->begin(inputs, &hidden_));
  record->phase1_ms = ms_since(t);

  if (sender_ && (config_.early_forwarding || backprop())) {  // a backprop schedule sends at the marker
    const Clock::time_point send_start = Clock::now();
    const Status sent = send_hidden(mb, inputs, hidden_);
    record->send_ms = ms_since(send_start);
    if (!sent.ok()) {
      abandon_step(p);
      return sent;
    }
  }
  if (mb == config_.hold_at_micro_batch) {
    const Status held = hold(mb);
    abandon_step(p);
    return held;
  }
  return Status();
}

void StageRunner::abandon_step(StageProgram* program) {
  // The method is parked at the marker: stop it there before unwinding.
  (void)(program != nullptr ? program : program_.get())->abandon();
}

void StageRunner::write_micro_batch(MicroBatchRecord* record) {
  if (telemetry_ || progress_) {
    record->pss_mib = read_pss_mib();
    record->temperature_c = read_temperature_c();
  }
  if (telemetry_) {
    json line = to_json(*record);
    line["early_forwarding"] = config_.early_forwarding;
    (void)telemetry_->write_json(line);
  }
}

void StageRunner::finish_run(int64_t micro_batches, double wall_s, double cpu_s) {
  const RunnerConfig& c = config_;
  if (telemetry_) {
    const int64_t now_ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
            .count();
    json line = {{"type", "done"},
                 {"t_unix_ms", now_ms},
                 {"stage", c.stage_index},
                 {"micro_batches", micro_batches},
                 {"wall_s", wall_s},
                 {"cpu_s", cpu_s},
                 {"busy_share", wall_s > 0 ? cpu_s / wall_s : 0.0},
                 {"peak_rss_mib", number_or_null(read_peak_rss_mib())},
                 {"optimizer_step", optimizer_->step_count()},
                 {"schedule", c.schedule}};
    if (backprop()) {
      line["max_weight_versions_kept"] = max_versions_kept_;
      line["program_instances"] = instances_.size();  // keep_activations: one per micro-batch in flight
    }
    if (sender_) {
      const SenderStats s = sender_->stats();
      line["sender"] = {{"transmissions", s.transmissions}, {"resends", s.resends}, {"connects", s.connects},
                        {"max_in_flight_seen", s.max_in_flight_seen}, {"bytes_sent", s.bytes_sent},
                        {"bytes_received", s.bytes_received}, {"grads_received", s.grads_received},
                        {"grads_refused", s.grads_refused}, {"max_grad_delay", s.max_grad_delay},
                        {"sum_grad_delay", s.sum_grad_delay}};
    }
    if (receiver_) {
      const ReceiverStats s = receiver_->stats();
      line["receiver"] = {{"accepted", s.accepted}, {"duplicates", s.duplicates}, {"rejected", s.rejected},
                          {"connections", s.connections}, {"bytes_received", s.bytes_received},
                          {"bytes_sent", s.bytes_sent}, {"grads_sent", s.grads_sent}};
    }
    (void)telemetry_->write_json(line);
  }
  emit_event("{\"event\": \"done\", \"stage\": %" PRId64 ", \"micro_batches\": %" PRId64 ", \"wall_s\": %.3f}",
             c.stage_index, micro_batches, wall_s);
  report([](StageProgress* p) { p->phase = "done"; });
}

void StageRunner::snapshot_accumulator(int64_t mb, const WindowSums& sums) {
  if (!snapshots_) return;
  if (snapshots_->failures() > 0) {
    // Not fatal: without snapshots a restart replays from the checkpoint, which is exact.
    log(LogLevel::kWarn, "accumulator snapshots off: %s", snapshots_->last_error().c_str());
    snapshots_.reset();
    return;
  }
  // A forward-only stage accumulates no gradient (its sums are zeros: the
  // snapshot holds none of them), but the snapshot still records how far the
  // window got: a restart continues there instead of running those
  // micro-batches' phase 1 and sends again.
  AccumulatorSnapshot snapshot = AccumulatorSnapshot::of(*optimizer_, /*with_sums=*/!forward_only_);
  if (forward_only_) snapshot.accumulated = sums.count;
  snapshot.run_id = config_.run_id;
  snapshot.stage = config_.stage_index;
  snapshot.window = plan_.window_of(mb);
  snapshot.micro_batches_done = mb + 1;
  snapshot.loss_sum = sums.loss;
  snapshot.task_loss_sum = sums.task;
  snapshot.consistency_loss_sum = sums.consistency;
  snapshots_->submit(std::move(snapshot));
}

void StageRunner::shutdown() {
  if (snapshots_) snapshots_->stop();
  if (sender_) sender_->stop();
  if (receiver_) receiver_->stop();
}

}  // namespace internal

Status run_stage(const RunnerConfig& config, const std::atomic<bool>* stop_requested, ProgressBoard* progress,
                 const Standby* standby) {
  internal::StageRunner runner(config, stop_requested, progress, standby);
  return runner.run();
}

}  // namespace zl
