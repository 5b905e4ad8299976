// zl_schedule_ops: the runner's schedule lists (zl/pipeline_schedule.h) as
// text, so tests/test_schedule_table.py can check them against the Python
// table (zl_device/formats/schedule_table.py), action for action.
//
//   echo '[{"schedule": "async", "stage": 0, "num_stages": 3, "num_micro_batches": 6,
//           "window_size": 2, "first_micro_batch": 0}]' | zl_schedule_ops
//   ["F0@0 F1@0 F2@0 B0@0 F3@0 B1@0 S1@0 F4@1 B2@0 ..."]
//
// One string per case: schedule_ops' list, F<mb>@<version> and B<mb>@<version>
// with the version forward_version gives (a backward runs on its forward's),
// and S<mb>@<window> for the optimizer step that ends a window (the steps
// taken before it).
//
//   zl_schedule_ops --table
//   [{"name": "zerolock", "backprop": false, "flush": true, "warm_up": "none"}, ...]
//
// The runner's schedule table (pipeline_schedules()), row for row as the Python ScheduleRule writes it.
#include <cstdio>
#include <iostream>
#include <iterator>
#include <string>

#include <nlohmann/json.hpp>

#include "zl/pipeline_schedule.h"
#include "zl/window_plan.h"

int main(int argc, char** argv) {
  using nlohmann::json;
  if (argc == 2 && std::string(argv[1]) == "--table") {
    using WarmUp = zl::PipelineSchedule::WarmUp;
    json rows = json::array();
    for (const zl::PipelineSchedule& s : zl::pipeline_schedules()) {
      const char* warm = s.warm_up == WarmUp::kNone ? "none" : s.warm_up == WarmUp::kPipeline ? "pipeline" : "window";
      rows.push_back({{"name", s.name}, {"backprop", s.backprop}, {"flush", s.flush}, {"warm_up", warm}});
    }
    std::printf("%s\n", rows.dump().c_str());
    return 0;
  }
  const std::string text((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  const json cases = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!cases.is_array()) {
    std::fprintf(stderr, "zl_schedule_ops: expected a JSON array of cases on stdin\n");
    return 2;
  }
  json out = json::array();
  for (const json& c : cases) {
    const zl::Result<zl::PipelineSchedule> schedule = zl::parse_pipeline_schedule(c.at("schedule").get<std::string>());
    if (!schedule.ok()) {
      std::fprintf(stderr, "zl_schedule_ops: %s\n", schedule.status().message().c_str());
      return 2;
    }
    const int64_t stage = c.at("stage"), num_stages = c.at("num_stages");
    const zl::WindowPlan plan(c.at("num_micro_batches").get<int64_t>(), c.at("window_size").get<int64_t>());
    std::string line;
    for (const zl::ScheduleOp& op : zl::schedule_ops(*schedule, stage, num_stages, plan, c.at("first_micro_batch"))) {
      using Kind = zl::ScheduleOp::Kind;
      const char* kind = op.kind == Kind::kForward ? "F" : op.kind == Kind::kBackward ? "B" : "S";
      const int64_t version = op.kind == Kind::kStep
                                  ? plan.window_of(op.micro_batch)  // the steps taken before it
                                  : zl::forward_version(*schedule, stage, num_stages, plan, op.micro_batch);
      line += (line.empty() ? "" : " ") + std::string(kind) + std::to_string(op.micro_batch) + "@" +
              std::to_string(version);
    }
    out.push_back(line);
  }
  std::printf("%s\n", out.dump().c_str());
  return 0;
}
