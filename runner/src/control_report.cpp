// What a stage tells the coordinator about itself, apart from the connection
// (control_client.cpp): phase names, the device it runs on, its identity from
// the stage config, and the window events it reports.
#include <sys/utsname.h>

#if defined(__ANDROID__)
#include <sys/system_properties.h>
#endif

#include "zl/control_client.h"

namespace zl {

const char* control_phase_name(ControlPhase phase) {
  switch (phase) {
    case ControlPhase::kStarting: return "starting";
    case ControlPhase::kWaitingForStart: return "waiting_for_start";
    case ControlPhase::kRunning: return "running";
    case ControlPhase::kStopped: return "stopped";
    case ControlPhase::kDone: return "done";
    case ControlPhase::kFailed: return "failed";
  }
  return "unknown";
}

Result<ControlClientOptions> control_options_from_config(const RunnerConfig& config, const FrameKey& key) {
  if (config.coordinator.empty()) {
    return Status(StatusCode::kInvalidArgument, "the stage config names no coordinator (\"coordinator\": \"host:port\")");
  }
  RunId run_id{};
  if (!parse_hex_run_id(config.run_id, &run_id)) {
    return Status(StatusCode::kInvalidArgument, "run_id \"" + config.run_id + "\" is not 32 hex characters");
  }
  if (config.stage_index < 0 || config.stage_index >= static_cast<int64_t>(kCoordinatorStage)) {
    return Status(StatusCode::kInvalidArgument, "stage_index " + std::to_string(config.stage_index) + " out of range");
  }
  ControlClientOptions out;
  out.coordinator = config.coordinator;
  out.run_id = run_id;
  out.key = key;
  out.stage = static_cast<uint32_t>(config.stage_index);
  return out;
}

std::string describe_device() {
  std::string name;
#if defined(__ANDROID__)
  char manufacturer[PROP_VALUE_MAX] = {0};
  char model[PROP_VALUE_MAX] = {0};
  __system_property_get("ro.product.manufacturer", manufacturer);
  __system_property_get("ro.product.model", model);
  name = manufacturer;
  if (model[0] != '\0') name += (name.empty() ? "" : " ") + std::string(model);
#endif
  utsname u{};
  if (::uname(&u) == 0) {
#if defined(__ANDROID__)
    const std::string os = "Android";
#else
    const std::string os = u.sysname;
#endif
    if (name.empty()) name = u.nodename;
    name += " (" + os + " " + u.machine + ")";
  }
  return name.empty() ? "unknown" : name;
}

WindowCommittedEvent WindowCommittedEvent::from(const WindowRecord& record, int64_t micro_batches_done) {
  WindowCommittedEvent e;
  e.window = record.window;
  e.micro_batches_done = micro_batches_done;
  if (!record.forward_only) {  // a forward-only stage computed no loss
    e.mean_loss = record.mean_loss;
    e.mean_task_loss = record.mean_task_loss;
    e.mean_consistency_loss = record.mean_consistency_loss;
  }
  e.checkpoint_ms = record.checkpoint_ms;
  return e;
}

}  // namespace zl
