// StageRunner under a backprop schedule (gpipe, 1f1b, async;
// docs/design#backprop-schedules): the stage runs its operations in the order schedule_ops gives,
// forwards, backwards and the optimizer step that ends each window.
//
//   forward(j)   take micro-batch j's input, run the program to the marker
//                (grad_hidden zeros), send the hidden state downstream, stop
//                the method there, keep the input; the last stage only takes it
//   backward(j)  take j's gradient from downstream (GRAD), run the whole
//                program on the kept input and that gradient, on the weight
//                version j's forward used, send grad_input upstream (GRAD),
//                accumulate the LoRA gradients; after a window's last
//                micro-batch the AdamW step, flush and checkpoint (end_window)
//
// A backward recomputes its forward from the kept input (one more forward per
// micro-batch, a (B,S,D) input held per micro-batch in flight, no activations).
// With keep_activations a stage before the last instead parks each forward at
// its marker in an instance of the program of its own, on a copy of the
// weights it forwards with, and its backward writes the gradient in and
// resumes it (StageProgram::finish(grad_hidden)): no second forward, one
// instance's planned memory per micro-batch in flight.
#include <chrono>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "stage_runner.h"
#include "zl/log.h"

namespace zl::internal {

Status StageRunner::check_program_kind() const {
  if (program_->is_backprop() == backprop()) return Status();
  if (backprop()) {
    return Status(StatusCode::kInvalidArgument,
                  "program " + config_.program + " is a zerolock program (a local step) and schedule '" +
                      config_.schedule + "' runs end-to-end backprop; export with `zl export --program backprop` "
                      "(zl train --schedule does), or use schedule zerolock");
  }
  return Status(StatusCode::kInvalidArgument,
                "program " + config_.program + " is a backprop program (it takes grad_hidden) and schedule "
                "'zerolock' has no gradient to give it; use schedule gpipe, 1f1b or async, or export with "
                "--program zerolock");
}

Status StageRunner::load_instances() {
  const RunnerConfig& c = config_;
  if (!c.keep_activations || !backprop() || program_->is_last()) return Status();
  const int64_t depth = max_in_flight(schedule_ops(schedule_, c.stage_index, c.num_stages, plan_, start_mb_));
  for (int64_t i = 0; i < depth; ++i) {
    ZL_ASSIGN_OR_RETURN(std::unique_ptr<StageProgram> instance, StageProgram::load(program_options()));
    idle_instances_.push_back(instance.get());
    instances_.push_back(std::move(instance));
  }
  log(LogLevel::kInfo, "stage %lld: keeping activations: %lld program instances, one per micro-batch in flight",
      static_cast<long long>(c.stage_index), static_cast<long long>(depth));
  return Status();
}

Result<StageProgram*> StageRunner::take_instance(int64_t mb, const std::vector<std::vector<float>>* weights) {
  if (idle_instances_.empty()) {
    return Status(StatusCode::kInternal, "micro-batch " + std::to_string(mb) + ": all " +
                                             std::to_string(instances_.size()) +
                                             " program instances hold a micro-batch in flight");
  }
  StageProgram* instance = idle_instances_.back();
  idle_instances_.pop_back();
  const std::vector<TrainableParam>& from = program_->parameters();
  const std::vector<TrainableParam>& to = instance->parameters();
  for (size_t i = 0; i < from.size(); ++i) {
    const float* src = weights != nullptr ? (*weights)[i].data() : from[i].data;
    std::copy(src, src + from[i].numel(), to[i].data);
  }
  return instance;
}

Status StageRunner::loop_backprop() {
  const RunnerConfig& c = config_;
  const std::vector<ScheduleOp> ops = schedule_ops(schedule_, c.stage_index, c.num_stages, plan_, start_mb_);
  WindowSums sums;
  int64_t done = start_mb_;
  const Clock::time_point run_start = Clock::now();
  const double cpu_start = process_cpu_s();
  report_running();
  MicroBatchRecord record;  // the last backward's, reported once its window's step (if one follows) is committed
  const auto loss = [&] { return program_->takes_gradient() ? std::nullopt : std::optional<double>(record.loss); };
  for (size_t i = 0; i < ops.size(); ++i) {
    const int64_t mb = ops[i].micro_batch;
    if (ops[i].kind == ScheduleOp::Kind::kStep) {  // right after the backward of the window's last micro-batch
      // Micro-batches forwarded on the weights this step replaces still run their backward on them.
      versions_.before_step(optimizer_->step_count(), program_->parameters());
      max_versions_kept_ = std::max(max_versions_kept_, static_cast<int64_t>(versions_.num_kept()));
      ZL_RETURN_IF_ERROR(end_window(plan_.window_of(mb), mb, sums));
      sums = WindowSums();
      report_done(mb, /*window_end=*/true, record, loss());
      continue;
    }
    if (stopping(stop_)) return stop_status("before micro-batch " + std::to_string(mb));
    if (ops[i].kind == ScheduleOp::Kind::kForward) {
      ZL_RETURN_IF_ERROR(forward_op(mb));
      continue;
    }
    record = MicroBatchRecord();
    StageStepResult result;
    ZL_RETURN_IF_ERROR(backward_op(mb, &record, &result));
    sums.add(result);
    write_micro_batch(&record);
    done = mb + 1;
    const bool step_next = i + 1 < ops.size() && ops[i + 1].kind == ScheduleOp::Kind::kStep;
    if (!step_next) report_done(mb, /*window_end=*/false, record, loss());
  }
  if (receiver_) {
    // The last gradients out before the run counts as done: the upstream still waits for them.
    ZL_RETURN_IF_ERROR(wait_sliced([&](milliseconds slice) { return receiver_->flush_grads(slice); }, stop_,
                                   c.input_timeout_s,
                                   "writing the last gradients to stage " + std::to_string(c.stage_index - 1)));
  }
  finish_run(done - start_mb_, ms_since(run_start) / 1000.0, process_cpu_s() - cpu_start);
  return Status();
}

Status StageRunner::forward_op(int64_t mb) {
  const RunnerConfig& c = config_;
  InFlight f;
  StageInputs inputs;
  ZL_RETURN_IF_ERROR(take_input(mb, &f.entry, &inputs, &f.queue_ms));
  // The version an uninterrupted run forwards on: the current one, but after a restart from a checkpoint taken
  // with micro-batches in flight, whose first forwards re-run on the older version it kept.
  const int64_t version = forward_version(schedule_, c.stage_index, c.num_stages, plan_, mb);
  ZL_ASSIGN_OR_RETURN(const std::vector<std::vector<float>>* stashed, weights_of(version, mb));
  versions_.forwarded(mb, version);
  if (program_->is_last() && mb == c.hold_at_micro_batch) {
    return hold(mb);  // failure injection: its input taken, its loss and gradient not (the last stage sends nothing)
  }
  if (!program_->is_last()) {
    MicroBatchRecord timing;
    if (!instances_.empty()) {
      ZL_ASSIGN_OR_RETURN(f.kept, take_instance(mb, stashed));
      ZL_RETURN_IF_ERROR(begin_micro_batch(mb, inputs, &timing, f.kept));  // parked at the marker until backward(mb)
    } else {
      const WeightSwap swap(program_->parameters(), stashed);
      ZL_RETURN_IF_ERROR(begin_micro_batch(mb, inputs, &timing));  // grad_hidden zeros: it stops at the marker, sends
      ZL_RETURN_IF_ERROR(program_->abandon());
    }
    f.forward_ms = timing.phase1_ms;
    f.send_ms = timing.send_ms;
  }
  in_flight_.emplace(mb, std::move(f));
  return Status();
}

Result<const std::vector<std::vector<float>>*> StageRunner::weights_of(int64_t version, int64_t mb) const {
  if (version == optimizer_->step_count()) return nullptr;  // the current weights: nothing to swap in
  const std::vector<std::vector<float>>* kept = versions_.kept(version);
  if (kept == nullptr || version > optimizer_->step_count()) {
    return Status(StatusCode::kInternal, "micro-batch " + std::to_string(mb) + " runs on weight version " +
                                             std::to_string(version) + "; the stage has taken " +
                                             std::to_string(optimizer_->step_count()) + " steps and kept " +
                                             std::to_string(versions_.num_kept()) + " older versions");
  }
  return kept;
}

Status StageRunner::take_grad(int64_t mb, double* wait_ms) {
  const RunnerConfig& c = config_;
  const Clock::time_point start = Clock::now();
  GradEntry grad;
  auto next = [&](milliseconds slice) -> Status {
    Result<GradEntry> taken = sender_->next_grad(slice);
    if (!taken.ok()) return taken.status();
    grad = std::move(taken).value();
    return Status();
  };
  ZL_RETURN_IF_ERROR(wait_sliced(next, stop_, c.input_timeout_s,
                                 "waiting for the gradient of micro-batch " + std::to_string(mb) + " from stage " +
                                     std::to_string(c.stage_index + 1)));
  *wait_ms = ms_since(start);
  const uint64_t window = static_cast<uint64_t>(plan_.window_of(mb));
  if (grad.micro_batch != static_cast<uint64_t>(mb) || grad.window != window) {
    return Status(StatusCode::kCorrupt, "stage " + std::to_string(c.stage_index + 1) + " sent the gradient of "
                                            "micro-batch " + std::to_string(grad.micro_batch) + " of window " +
                                            std::to_string(grad.window) + ", expected " + std::to_string(mb) +
                                            " of window " + std::to_string(window) +
                                            "; do all stages run the same schedule?");
  }
  ZL_ASSIGN_OR_RETURN(grad_hidden_, grad_hidden_f32(grad.frame, program_->batch(), program_->seq_len(),
                                                    program_->hidden_size()));
  // Refused on receipt, before it reaches this stage's weights, and blamed on the stage that sent it (a runner of
  // this version checks before it sends, in send_grad; a finite float32 past bfloat16's range arrives as inf).
  const std::string bad = non_finite_grad(grad_hidden_, static_cast<uint32_t>(c.stage_index + 1), grad.micro_batch);
  if (!bad.empty()) return damaged_run(static_cast<int64_t>(window), bad);
  return Status();
}

Status StageRunner::send_grad(int64_t mb, const float* grad_input) {
  const RunnerConfig& c = config_;
  const int64_t numel = program_->batch() * program_->seq_len() * program_->hidden_size();
  const int64_t bad = first_non_finite(grad_input, numel);
  if (bad >= 0) {  // this stage diverged: say so here, rather than let stage k-1 step on it
    return damaged_run(plan_.window_of(mb), "its gradient for stage " + std::to_string(c.stage_index - 1) +
                                                " (micro-batch " + std::to_string(mb) + ") holds " +
                                                std::to_string(grad_input[bad]) + " at element " +
                                                std::to_string(bad) + "; not sent");
  }
  ZL_ASSIGN_OR_RETURN(const Frame frame,
                      make_grad_frame(run_id_, static_cast<uint32_t>(c.stage_index),
                                      static_cast<uint64_t>(plan_.window_of(mb)), static_cast<uint64_t>(mb),
                                      program_->batch(), program_->seq_len(), program_->hidden_size(), grad_input,
                                      c.grad_wire_dtype == "f32" ? DType::kFloat32 : DType::kBFloat16));
  return wait_sliced([&](milliseconds slice) { return receiver_->send_grad(frame, slice); }, stop_,
                     c.input_timeout_s,
                     "sending the gradient of micro-batch " + std::to_string(mb) + " to stage " +
                         std::to_string(c.stage_index - 1));
}

Status StageRunner::backward_op(int64_t mb, MicroBatchRecord* record, StageStepResult* result) {
  const auto it = in_flight_.find(mb);
  if (it == in_flight_.end()) {
    return Status(StatusCode::kInternal, "backward of micro-batch " + std::to_string(mb) + " before its forward");
  }
  const InFlight& f = it->second;
  record->stage = config_.stage_index;
  record->window = plan_.window_of(mb);
  record->micro_batch = mb;
  record->queue_ms = f.queue_ms;
  record->phase1_ms = f.forward_ms;
  record->send_ms = f.send_ms;
  const Clock::time_point start = Clock::now();
  double grad_wait_ms = 0;
  if (program_->takes_gradient()) ZL_RETURN_IF_ERROR(take_grad(mb, &grad_wait_ms));
  const int64_t version = versions_.version_of(mb);
  Clock::time_point t = Clock::now();
  if (f.kept != nullptr) {  // its forward waits at the marker, on the weights it began with
    ZL_ASSIGN_OR_RETURN(*result, f.kept->finish(grad_hidden_.data()));
  } else {
    StageInputs inputs;
    ZL_RETURN_IF_ERROR(inputs_of(mb, f.entry, &inputs));
    inputs.grad_hidden = program_->takes_gradient() ? grad_hidden_.data() : nullptr;
    ZL_ASSIGN_OR_RETURN(const std::vector<std::vector<float>>* stashed, weights_of(version, mb));
    const WeightSwap swap(program_->parameters(), stashed);
    ZL_ASSIGN_OR_RETURN(*result, program_->run(inputs));
  }
  record->phase2_ms = ms_since(t);
  if (result->grad_input != nullptr) {
    t = Clock::now();
    ZL_RETURN_IF_ERROR(send_grad(mb, result->grad_input));
    record->send_ms += ms_since(t);
  }
  ZL_RETURN_IF_ERROR(optimizer_->accumulate(result->gradients));
  // A stage before the last differentiates <h, grad_hidden>, no loss to show: null in its micro-batch lines (the
  // window's sum keeps it, so a gradient gone non-finite still stops the run as a damaged one).
  record->loss = program_->takes_gradient() ? std::numeric_limits<double>::quiet_NaN() : result->loss;
  record->task_loss = result->task_loss;
  record->consistency_loss = result->consistency_loss;
  record->grad_wait_ms = grad_wait_ms;
  record->weight_version = version;
  record->total_ms = f.queue_ms + f.forward_ms + f.send_ms + ms_since(start);
  versions_.backwarded(mb);
  if (f.kept != nullptr) idle_instances_.push_back(f.kept);  // its outputs are used: result no longer points in it
  in_flight_.erase(it);
  return Status();
}

}  // namespace zl::internal
