// The backprop schedules' operation order per stage (pipeline_schedule.h), the
// in-flight bound that sizes a link's gradient credit, and the weight versions
// a stage keeps for its stale backwards.
#include "zl/pipeline_schedule.h"

#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace zl {
namespace {

PipelineSchedule schedule(const char* name) { return parse_pipeline_schedule(name).value(); }

/// "F0 F1 B0 ..." for readable expectations; `steps`: with "S<mb>" where a window's step is.
std::string text(const std::vector<ScheduleOp>& ops, bool steps = false) {
  std::string out;
  for (const ScheduleOp& op : ops) {
    if (op.kind == ScheduleOp::Kind::kStep && !steps) continue;
    if (!out.empty()) out += ' ';
    const char* kind = op.kind == ScheduleOp::Kind::kForward ? "F" : op.kind == ScheduleOp::Kind::kBackward ? "B" : "S";
    out += kind + std::to_string(op.micro_batch);
  }
  return out;
}

TEST(PipelineScheduleTest, GPipeForwardsAWindowThenBackwardsIt) {
  const WindowPlan plan(5, 2);  // windows [0,2) [2,4) [4,5)
  EXPECT_EQ(text(schedule_ops(schedule("gpipe"), 0, 3, plan)), "F0 F1 B0 B1 F2 F3 B2 B3 F4 B4");
  // The last stage's forward and backward are one execution: no warm-up under any schedule.
  EXPECT_EQ(text(schedule_ops(schedule("gpipe"), 2, 3, plan)), "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4");
  // The step is an operation: after the backward of each window's last micro-batch.
  EXPECT_EQ(text(schedule_ops(schedule("gpipe"), 0, 3, plan), true),
            "F0 F1 B0 B1 S1 F2 F3 B2 B3 S3 F4 B4 S4");
}

TEST(PipelineScheduleTest, OneFOneBWarmsUpPerWindowAndFlushes) {
  const WindowPlan plan(8, 4);
  EXPECT_EQ(text(schedule_ops(schedule("1f1b"), 0, 3, plan)),
            "F0 F1 F2 B0 F3 B1 B2 B3 F4 F5 F6 B4 F7 B5 B6 B7");
  EXPECT_EQ(text(schedule_ops(schedule("1f1b"), 1, 3, plan)),
            "F0 F1 B0 F2 B1 F3 B2 B3 F4 F5 B4 F6 B5 F7 B6 B7");
}

TEST(PipelineScheduleTest, AsyncNeverFlushes) {
  const WindowPlan plan(6, 2);
  // Stage 0 of 3: two warm-up forwards, then 1F1B across window ends (F2, F3 before B1 ends window 0 ... ).
  EXPECT_EQ(text(schedule_ops(schedule("async"), 0, 3, plan)), "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5");
  EXPECT_EQ(text(schedule_ops(schedule("async"), 2, 3, plan)), "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5");
  // A restart from window 1's checkpoint warms up again from its first micro-batch.
  EXPECT_EQ(text(schedule_ops(schedule("async"), 0, 3, plan, 2)), "F2 F3 F4 B2 F5 B3 B4 B5");
  // Forwards of window 1 run before window 0's step (after B1): their backwards use the stashed version.
  EXPECT_EQ(text(schedule_ops(schedule("async"), 0, 3, plan), true),
            "F0 F1 F2 B0 F3 B1 S1 F4 B2 F5 B3 S3 B4 B5 S5");
  // ZeroLock: each micro-batch's phase 1 (F) and phase 2 on the local loss (B) back to back, on every stage.
  EXPECT_EQ(text(schedule_ops(schedule("zerolock"), 0, 3, plan, 2), true), "F2 B2 F3 B3 S3 F4 B4 F5 B5 S5");
}

TEST(PipelineScheduleTest, EveryMicroBatchOnceEachWayForwardFirst) {
  for (PipelineSchedule s : {schedule("gpipe"), schedule("1f1b"), schedule("async")}) {
    for (int64_t k = 0; k < 4; ++k) {
      const WindowPlan plan(11, 3);
      std::vector<int> forward(11, 0), backward(11, 0);
      for (const ScheduleOp& op : schedule_ops(s, k, 4, plan)) {
        if (op.kind == ScheduleOp::Kind::kStep) {
          ASSERT_EQ(backward[op.micro_batch], 1) << "a step follows its window's last backward";
          ASSERT_TRUE(plan.is_last_of_window(op.micro_batch));
        } else if (op.kind == ScheduleOp::Kind::kForward) {
          ++forward[op.micro_batch];
        } else {
          ASSERT_EQ(forward[op.micro_batch], 1) << s.name << " stage " << k;
          ++backward[op.micro_batch];
        }
      }
      EXPECT_EQ(forward, std::vector<int>(11, 1));
      EXPECT_EQ(backward, std::vector<int>(11, 1));
    }
  }
}

TEST(PipelineScheduleTest, InFlightIsTheWarmUpPlusOneOrTheWindow) {
  const WindowPlan plan(16, 4);
  EXPECT_EQ(max_in_flight(schedule_ops(schedule("async"), 0, 3, plan)), 3);  // K - k
  EXPECT_EQ(max_in_flight(schedule_ops(schedule("async"), 2, 3, plan)), 1);
  EXPECT_EQ(max_in_flight(schedule_ops(schedule("1f1b"), 0, 8, plan)), 4);  // a window at most
  EXPECT_EQ(max_in_flight(schedule_ops(schedule("gpipe"), 1, 3, plan)), 4);
}

TEST(PipelineScheduleTest, ParsesTheConfigNames) {
  EXPECT_EQ(parse_pipeline_schedule("async").value(), schedule("async"));
  EXPECT_STREQ(schedule("1f1b").name, "1f1b");
  EXPECT_TRUE(schedule("1f1b").flush && !schedule("async").flush && !schedule("zerolock").backprop);
  const Result<PipelineSchedule> bad = parse_pipeline_schedule("pipedream");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("schedule 'pipedream'; expected zerolock"), std::string::npos);
}

TEST(WeightVersionsTest, KeepsAVersionOnlyWhileAMicroBatchNeedsIt) {
  std::vector<float> a = {1, 2}, b = {3};
  const std::vector<TrainableParam> params = {{"a", {2}, a.data()}, {"b", {1}, b.data()}};
  WeightVersions versions;
  versions.forwarded(0, 0);
  versions.backwarded(0);
  versions.before_step(0, params);  // nothing in flight: nothing kept
  EXPECT_EQ(versions.num_kept(), 0u);

  versions.forwarded(1, 0);  // forwarded on version 0, its backward after the step
  versions.before_step(0, params);
  a[0] = 10;  // the step
  ASSERT_NE(versions.kept(0), nullptr);
  EXPECT_EQ((*versions.kept(0))[0], (std::vector<float>{1, 2}));
  {
    const WeightSwap swap(params, versions.kept(0));
    EXPECT_EQ(a[0], 1);  // the backward sees its forward's weights
  }
  EXPECT_EQ(a[0], 10);  // and the current ones come back
  versions.backwarded(1);
  EXPECT_EQ(versions.num_kept(), 0u);
  EXPECT_EQ(versions.version_of(1), -1);
}

}  // namespace
}  // namespace zl
