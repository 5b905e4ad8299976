// Accumulator snapshots: a window continued from one ends bit for bit where
// the uninterrupted window ends; snapshots that do not continue the window
// are refused with the reason.
#include "zl/accumulator_snapshot.h"

#include <cstring>
#include <memory>
#include <vector>

#include <gtest/gtest.h>

#include "status_test_support.h"
#include "temp_dir_support.h"

namespace {

using zl::AccumulatorSnapshot;
using zl::AdamW;
using zl::AdamWConfig;
using zl::TrainableParam;
using zl_test::TempDir;
using zl_test::write_text;

struct Model {
  std::vector<float> a = {0.5f, -1.0f, 2.0f, 0.25f, 1.5f, -0.75f};
  std::vector<float> b = {0.1f, 0.2f, -0.3f};
  std::unique_ptr<AdamW> optimizer;

  Model() {
    AdamWConfig config;
    config.lr = 1e-2;
    std::vector<TrainableParam> params = {{"lora_A", {2, 3}, a.data()}, {"lora_B", {3, 1}, b.data()}};
    zl::Result<std::unique_ptr<AdamW>> created = AdamW::create(config, params);
    EXPECT_TRUE(created.ok()) << created.status().message();
    if (created.ok()) optimizer = std::move(created).value();
  }
};

// Gradients that differ per micro-batch and do not sum exactly in float.
std::vector<std::vector<float>> gradients(int mb) {
  std::vector<float> ga(6), gb(3);
  for (int j = 0; j < 6; ++j) ga[j] = 0.1f * static_cast<float>(mb + 1) / static_cast<float>(j + 3);
  for (int j = 0; j < 3; ++j) gb[j] = -0.07f * static_cast<float>(mb * mb + 1) / static_cast<float>(j + 7);
  return {ga, gb};
}

void accumulate(Model* m, int mb) {
  const auto g = gradients(mb);
  ASSERT_TRUE(m->optimizer->accumulate({g[0].data(), g[1].data()}).ok());
}

TEST(AccumulatorSnapshot, AWindowContinuedFromASnapshotEndsBitIdentical) {
  TempDir dir;
  const std::string path = zl::accumulator_snapshot_path(dir.path());
  Model straight, interrupted, resumed;
  for (int mb = 0; mb < 4; ++mb) accumulate(&straight, mb);
  ASSERT_TRUE(straight.optimizer->step().ok());

  for (int mb = 0; mb < 3; ++mb) accumulate(&interrupted, mb);
  AccumulatorSnapshot snapshot = AccumulatorSnapshot::of(*interrupted.optimizer, /*with_sums=*/true);
  snapshot.run_id = "run";
  snapshot.stage = 1;
  snapshot.window = 0;
  snapshot.micro_batches_done = 3;
  snapshot.loss_sum = 0.1 + 0.2;  // not a short decimal: must come back exactly
  ASSERT_TRUE(zl::write_accumulator_snapshot(path, snapshot).ok());

  ASSERT_OK_AND_ASSIGN(const AccumulatorSnapshot read, zl::read_accumulator_snapshot(path));
  EXPECT_EQ(read.loss_sum, 0.1 + 0.2);
  ASSERT_TRUE(zl::check_accumulator_snapshot(read, "run", 1, 0, 0, 4, *resumed.optimizer).ok());
  std::vector<const float*> sums(2);
  for (size_t i = 0; i < read.names.size(); ++i) sums[resumed.optimizer->find(read.names[i])] = read.sums[i].data();
  ASSERT_TRUE(resumed.optimizer->restore_accumulator(read.accumulated, sums).ok());
  EXPECT_EQ(resumed.optimizer->accumulated(), 3);
  accumulate(&resumed, 3);
  ASSERT_TRUE(resumed.optimizer->step().ok());
  EXPECT_EQ(0, std::memcmp(straight.a.data(), resumed.a.data(), straight.a.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(straight.b.data(), resumed.b.data(), straight.b.size() * sizeof(float)));
}

TEST(AccumulatorSnapshot, OneThatDoesNotContinueTheWindowIsRefused) {
  Model m;
  for (int mb = 0; mb < 2; ++mb) accumulate(&m, mb);
  AccumulatorSnapshot s = AccumulatorSnapshot::of(*m.optimizer, /*with_sums=*/true);
  s.run_id = "run";
  s.stage = 1;
  s.window = 2;
  s.micro_batches_done = 10;  // window 2 of size 4: micro-batches 8..11, two accumulated
  EXPECT_TRUE(zl::check_accumulator_snapshot(s, "run", 1, 2, 8, 12, *m.optimizer).ok());
  EXPECT_NE(zl::check_accumulator_snapshot(s, "run", 1, 3, 12, 16, *m.optimizer).message().find("of window 2"),
            std::string::npos);
  EXPECT_FALSE(zl::check_accumulator_snapshot(s, "other", 1, 2, 8, 12, *m.optimizer).ok());
  EXPECT_FALSE(zl::check_accumulator_snapshot(s, "run", 0, 2, 8, 12, *m.optimizer).ok());
  s.micro_batches_done = 11;  // does not match two accumulated
  EXPECT_FALSE(zl::check_accumulator_snapshot(s, "run", 1, 2, 8, 12, *m.optimizer).ok());
  s.micro_batches_done = 10;
  s.shapes[0] = {3, 2};
  EXPECT_NE(zl::check_accumulator_snapshot(s, "run", 1, 2, 8, 12, *m.optimizer).message().find("lora_A"),
            std::string::npos);
}

TEST(AccumulatorSnapshot, AForwardOnlyStageHoldsItsProgressAndNoSums) {
  // A stage held still by lr 0 accumulates nothing: its snapshot records how
  // far the window got, and writes none of the zero sums.
  TempDir dir;
  const std::string path = zl::accumulator_snapshot_path(dir.path());
  Model held;
  AccumulatorSnapshot s = AccumulatorSnapshot::of(*held.optimizer, /*with_sums=*/false);
  s.run_id = "run";
  s.stage = 0;
  s.window = 1;
  s.accumulated = 2;  // the runner's count of the window's forward-only micro-batches
  s.micro_batches_done = 6;
  ASSERT_TRUE(zl::write_accumulator_snapshot(path, s).ok());
  ASSERT_OK_AND_ASSIGN(const AccumulatorSnapshot read, zl::read_accumulator_snapshot(path));
  EXPECT_TRUE(read.names.empty() && read.sums.empty());
  EXPECT_EQ(read.micro_batches_done, 6);
  EXPECT_TRUE(zl::check_accumulator_snapshot(read, "run", 0, 1, 4, 8, *held.optimizer).ok());
  EXPECT_EQ(held.optimizer->state_bytes(), 0u);
}

TEST(AccumulatorSnapshot, MissingIsNotFoundAndGarbageIsCorrupt) {
  TempDir dir;
  const std::string path = zl::accumulator_snapshot_path(dir.path());
  EXPECT_EQ(zl::read_accumulator_snapshot(path).status().code(), zl::StatusCode::kNotFound);
  write_text(path, "not a safetensors file");
  EXPECT_EQ(zl::read_accumulator_snapshot(path).status().code(), zl::StatusCode::kCorrupt);
}

TEST(AccumulatorSnapshotWriter, WritesTheNewestInTheBackground) {
  TempDir dir;
  const std::string path = zl::accumulator_snapshot_path(dir.path());
  Model m;
  zl::AccumulatorSnapshotWriter writer(path);
  for (int mb = 0; mb < 3; ++mb) {
    accumulate(&m, mb);
    AccumulatorSnapshot s = AccumulatorSnapshot::of(*m.optimizer, /*with_sums=*/true);
    s.run_id = "run";
    s.micro_batches_done = mb + 1;
    writer.submit(std::move(s));
  }
  writer.drain();
  ASSERT_OK_AND_ASSIGN(const AccumulatorSnapshot read, zl::read_accumulator_snapshot(path));
  EXPECT_EQ(read.accumulated, 3);
  EXPECT_EQ(read.micro_batches_done, 3);
  EXPECT_EQ(writer.failures(), 0);
}

}  // namespace
