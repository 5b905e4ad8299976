// WindowPlan: the window arithmetic every part of the runner shares, on even
// and short last windows, and the degenerate plans a config can hold before
// validation.
#include "zl/window_plan.h"

#include <vector>

#include <gtest/gtest.h>

namespace zl {
namespace {

TEST(WindowPlanTest, EvenWindows) {
  const WindowPlan plan(12, 4);
  EXPECT_EQ(plan.num_windows(), 3);
  EXPECT_EQ(plan.window_of(0), 0);
  EXPECT_EQ(plan.window_of(3), 0);
  EXPECT_EQ(plan.window_of(4), 1);
  EXPECT_EQ(plan.window_of(11), 2);
  EXPECT_EQ(plan.first_micro_batch(2), 8);
  EXPECT_EQ(plan.end_micro_batch(0), 4);
  EXPECT_EQ(plan.end_micro_batch(2), 12);
}

TEST(WindowPlanTest, ShortLastWindow) {
  const WindowPlan plan(10, 4);  // windows [0,4) [4,8) [8,10)
  EXPECT_EQ(plan.num_windows(), 3);
  EXPECT_EQ(plan.window_of(9), 2);
  EXPECT_EQ(plan.first_micro_batch(2), 8);
  EXPECT_EQ(plan.end_micro_batch(1), 8);
  EXPECT_EQ(plan.end_micro_batch(2), 10);  // not 12: the run ends first
}

TEST(WindowPlanTest, LastOfWindowMarksEveryWindowEndOnce) {
  const WindowPlan plan(10, 4);
  std::vector<int64_t> ends;
  for (int64_t mb = 0; mb < plan.num_micro_batches(); ++mb) {
    if (plan.is_last_of_window(mb)) ends.push_back(mb);
  }
  EXPECT_EQ(ends, (std::vector<int64_t>{3, 7, 9}));
  ASSERT_EQ(static_cast<int64_t>(ends.size()), plan.num_windows());
  for (int64_t w = 0; w < plan.num_windows(); ++w) {
    EXPECT_EQ(ends[static_cast<size_t>(w)] + 1, plan.end_micro_batch(w)) << "window " << w;
  }
}

TEST(WindowPlanTest, LastOfRun) {
  const WindowPlan plan(10, 4);
  EXPECT_FALSE(plan.is_last_of_run(7));
  EXPECT_FALSE(plan.is_last_of_run(8));
  EXPECT_TRUE(plan.is_last_of_run(9));
  EXPECT_TRUE(plan.is_last_of_run(10));
}

TEST(WindowPlanTest, WindowOfOneMicroBatch) {
  const WindowPlan plan(3, 1);
  EXPECT_EQ(plan.num_windows(), 3);
  for (int64_t mb = 0; mb < 3; ++mb) {
    EXPECT_EQ(plan.window_of(mb), mb);
    EXPECT_TRUE(plan.is_last_of_window(mb));
    EXPECT_EQ(plan.end_micro_batch(mb), mb + 1);
  }
}

TEST(WindowPlanTest, WindowLargerThanTheRun) {
  const WindowPlan plan(3, 8);
  EXPECT_EQ(plan.num_windows(), 1);
  EXPECT_FALSE(plan.is_last_of_window(1));
  EXPECT_TRUE(plan.is_last_of_window(2));
  EXPECT_EQ(plan.end_micro_batch(0), 3);
}

TEST(WindowPlanTest, UnvalidatedWindowSizeHasNoWindows) {
  EXPECT_EQ(WindowPlan(10, 0).num_windows(), 0);
  EXPECT_EQ(WindowPlan(10, -2).num_windows(), 0);
  EXPECT_EQ(WindowPlan(0, 4).num_windows(), 0);
}

}  // namespace
}  // namespace zl
