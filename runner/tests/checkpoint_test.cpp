// Checkpoints: round trip, pruning, validation of damaged checkpoints, and a
// writer SIGKILLed in the middle of a save.
#include "zl/checkpoint.h"

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "status_test_support.h"
#include "temp_dir_support.h"
#include "zl/durable_file.h"

namespace {

using zl::AdamW;
using zl::AdamWConfig;
using zl::CheckpointOptions;
using zl::CheckpointProgress;
using zl::CheckpointStore;
using zl::TrainableParam;

constexpr const char* kA = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight";
constexpr const char* kB = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight";

// A stage's LoRA parameters (caller-owned buffers, as at run time) + AdamW.
struct Stage {
  std::vector<float> a, b;
  std::unique_ptr<AdamW> opt;

  explicit Stage(int64_t rows = 2, float fill = 0.0f) : a(static_cast<size_t>(rows) * 3, fill), b(3 * 2, fill) {
    opt = zl::testing::value_or_fail(AdamW::create(
        AdamWConfig{}, {TrainableParam{kA, {rows, 3}, a.data()}, TrainableParam{kB, {3, 2}, b.data()}}));
  }

  // Moment `which` (0: exp_avg, 1: exp_avg_sq) of parameter i, copied out.
  std::vector<float> moment(int which, size_t i) const {
    const float* m = which == 0 ? opt->exp_avg(i) : opt->exp_avg_sq(i);
    return std::vector<float>(m, m + opt->param(i).numel());
  }

  // One optimizer step with gradients derived from `seed`.
  void train_step(float seed) {
    std::vector<float> ga(a.size()), gb(b.size());
    for (size_t i = 0; i < ga.size(); ++i) ga[i] = seed * 0.1f + static_cast<float>(i) * 0.01f;
    for (size_t i = 0; i < gb.size(); ++i) gb[i] = -seed * 0.2f + static_cast<float>(i) * 0.03f;
    ASSERT_TRUE(opt->accumulate({ga.data(), gb.data()}).ok());
    ASSERT_TRUE(opt->step().ok());
  }
};

CheckpointProgress progress_for(const Stage& stage, int64_t window) {
  CheckpointProgress p;
  p.run_id = "00112233445566778899aabbccddeeff";
  p.stage = 1;
  p.window = window;
  p.last_micro_batch = window * 4 + 3;
  p.micro_batches_done = window * 4 + 4;
  p.optimizer_step = stage.opt->step_count();
  p.lr = 1e-4;
  return p;
}

TEST(Checkpoint, RoundTripRestoresParamsMomentsAndProgress) {
  zl_test::TempDir dir;
  CheckpointStore store({dir.file("ckpt"), 1, 2});
  Stage stage(2, 0.5f);
  stage.train_step(1.0f);
  stage.train_step(2.0f);
  CheckpointProgress progress = progress_for(stage, 1);
  progress.extra = {{"shard_cursor", 8}};
  zl::Status s = store.save(*stage.opt, progress);
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_TRUE(zl::is_directory(dir.file("ckpt/window_000001")));

  Stage restored(2, 9.0f);
  ASSERT_OK_AND_ASSIGN(const std::optional<CheckpointProgress> latest, store.load_latest(restored.opt.get()));
  ASSERT_TRUE(latest.has_value());
  const CheckpointProgress& loaded = *latest;
  EXPECT_EQ(restored.a, stage.a);
  EXPECT_EQ(restored.b, stage.b);
  EXPECT_EQ(restored.moment(0, 1), stage.moment(0, 1));
  EXPECT_EQ(restored.moment(1, 0), stage.moment(1, 0));
  EXPECT_EQ(restored.opt->step_count(), 2);
  EXPECT_EQ(loaded.window, 1);
  EXPECT_EQ(loaded.micro_batches_done, 8);
  EXPECT_EQ(loaded.last_micro_batch, 7);
  EXPECT_EQ(loaded.run_id, progress.run_id);
  EXPECT_EQ(loaded.extra.at("shard_cursor"), 8);
  EXPECT_GT(loaded.created_unix_ms, 0);

  // Both continue identically from here.
  stage.train_step(3.0f);
  restored.train_step(3.0f);
  EXPECT_EQ(restored.a, stage.a);
}

TEST(Checkpoint, AnOptimizerThatNeverSteppedWritesNoMoments) {
  // A stage held still by lr 0 (skip_step only): its moments are zeros, and
  // its optimizer file holds none of them, only the "moments": "zero" mark.
  zl_test::TempDir dir;
  CheckpointStore store({dir.file("ckpt"), 1, 2});
  Stage held(2, 0.5f);
  ASSERT_TRUE(held.opt->skip_step().ok());
  ASSERT_TRUE(store.save(*held.opt, progress_for(held, 0)).ok());
  ASSERT_OK_AND_ASSIGN(const zl::CheckpointData data,
                       zl::read_checkpoint(dir.file("ckpt/window_000000"), {held.opt->param(0), held.opt->param(1)}));
  EXPECT_TRUE(data.zero_moments);
  EXPECT_TRUE(data.optimizer.tensors.empty());
  EXPECT_EQ(data.optimizer.metadata.at("moments"), "zero");

  // It restores as zeros, into an optimizer with moments too, and both go on
  // as one that was never saved.
  Stage trained(2, 9.0f), fresh(2, 0.5f);
  trained.train_step(5.0f);
  ASSERT_OK_AND_ASSIGN(const std::optional<CheckpointProgress> latest, store.load_latest(trained.opt.get()));
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(trained.a, held.a);
  EXPECT_EQ(trained.moment(0, 0), std::vector<float>(6, 0.0f));
  EXPECT_EQ(trained.opt->step_count(), 1);
  ASSERT_TRUE(fresh.opt->skip_step().ok());
  for (Stage* s : {&trained, &held, &fresh}) s->train_step(2.0f);
  EXPECT_EQ(trained.a, fresh.a);
  EXPECT_EQ(held.a, fresh.a);
  EXPECT_EQ(trained.moment(1, 1), fresh.moment(1, 1));
}

TEST(Checkpoint, EmptyDirectoryHasNoCheckpoint) {
  zl_test::TempDir dir;
  CheckpointStore store({dir.file("never_created"), 1, 2});
  Stage stage;
  ASSERT_OK_AND_ASSIGN(const std::optional<CheckpointProgress> latest, store.load_latest(stage.opt.get()));
  EXPECT_FALSE(latest.has_value());
}

TEST(Checkpoint, KeepsOnlyTheLastK) {
  zl_test::TempDir dir;
  CheckpointStore store({dir.path(), 1, 2});
  Stage stage;
  for (int64_t w = 0; w < 5; ++w) {
    stage.train_step(static_cast<float>(w));
    ASSERT_TRUE(store.save(*stage.opt, progress_for(stage, w)).ok());
  }
  ASSERT_OK_AND_ASSIGN(const std::vector<int64_t> windows, store.list_windows());
  EXPECT_EQ(windows, (std::vector<int64_t>{3, 4}));
}

TEST(Checkpoint, IntervalDecidesWhichWindowsAreDue) {
  CheckpointStore every({"/x", 1, 2});
  EXPECT_TRUE(every.due(0, false));
  CheckpointStore third({"/x", 3, 2});
  EXPECT_FALSE(third.due(0, false));
  EXPECT_FALSE(third.due(1, false));
  EXPECT_TRUE(third.due(2, false));
  EXPECT_TRUE(third.due(3, true));  // the last window always
  EXPECT_FALSE(CheckpointStore({"/x", 0, 2}).validate().ok());
  EXPECT_FALSE(CheckpointStore({"/x", 1, 0}).validate().ok());
}

TEST(Checkpoint, SavingTheSameWindowAgainReplacesIt) {
  zl_test::TempDir dir;
  CheckpointStore store({dir.path(), 1, 2});
  Stage stage;
  stage.train_step(1.0f);
  ASSERT_TRUE(store.save(*stage.opt, progress_for(stage, 0)).ok());
  stage.train_step(2.0f);
  ASSERT_TRUE(store.save(*stage.opt, progress_for(stage, 0)).ok());
  Stage restored;
  ASSERT_OK_AND_ASSIGN(const CheckpointProgress loaded, store.load(0, restored.opt.get()));
  EXPECT_EQ(restored.a, stage.a);
  EXPECT_EQ(loaded.optimizer_step, 2);
}

// Issue 12 item 13: replacing window_N used to rename it aside and then put
// the new one in place, with a moment in between where no window_N existed
// (a crash or a reader there saw no checkpoint of that window).
TEST(Checkpoint, ReplacingAWindowNeverLeavesItMissing) {
  zl_test::TempDir dir;
  const std::string window_dir = dir.file("window_000000");
  std::atomic<bool> stop{false}, missing{false};
  CheckpointOptions options{dir.path(), 1, 2};
  int hook_calls = 0;
  options.on_replace = [&](const std::string& path) {
    ++hook_calls;
    EXPECT_EQ(path, window_dir);
    // The new checkpoint is complete in place while the old one still exists.
    ASSERT_OK_AND_ASSIGN(const std::string text, zl::read_file(path + "/progress.json"));
    EXPECT_NE(text.find("\"optimizer_step\": " + std::to_string(hook_calls + 1)), std::string::npos) << text;
  };
  CheckpointStore store(options);
  Stage stage;
  stage.train_step(1.0f);
  ASSERT_TRUE(store.save(*stage.opt, progress_for(stage, 0)).ok());
  std::thread watcher([&] {
    while (!stop) {
      struct stat st {};
      if (::stat(window_dir.c_str(), &st) != 0) missing = true;
    }
  });
  for (int i = 0; i < 100 && !missing; ++i) {
    stage.train_step(2.0f + static_cast<float>(i));
    ASSERT_TRUE(store.save(*stage.opt, progress_for(stage, 0)).ok());
  }
  stop = true;
  watcher.join();
  EXPECT_FALSE(missing) << "window_000000 was missing while it was replaced";
  EXPECT_GT(hook_calls, 0);
}

TEST(Checkpoint, CreatingTheRootMakesItDurable) {
  zl_test::TempDir dir;
  const uint64_t before = zl::directories_synced_after_create().load();
  CheckpointStore store({dir.file("a/b/checkpoints"), 1, 2});
  Stage stage;
  stage.train_step(1.0f);
  ASSERT_TRUE(store.save(*stage.opt, progress_for(stage, 0)).ok());
  // a, a/b and a/b/checkpoints were created: each parent was fsynced.
  EXPECT_GE(zl::directories_synced_after_create().load() - before, 3u);
}

// Saves window 0 and returns the store; the tests then damage it.
class DamagedCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    stage_.train_step(1.0f);
    ASSERT_TRUE(store_.save(*stage_.opt, progress_for(stage_, 0)).ok());
    window_dir_ = dir_.file("window_000000");
  }
  zl::Status load(Stage* into) const {
    return store_.load_latest(into->opt.get()).status();
  }
  zl_test::TempDir dir_;
  CheckpointStore store_{CheckpointOptions{dir_.path(), 1, 2}};
  Stage stage_;
  std::string window_dir_;
};

TEST_F(DamagedCheckpoint, TruncatedAdapterNamesTheFile) {
  ASSERT_OK_AND_ASSIGN(const std::string bytes, zl::read_file(window_dir_ + "/adapter.safetensors"));
  zl_test::write_text(window_dir_ + "/adapter.safetensors", bytes.substr(0, bytes.size() - 5));
  Stage target(2, 7.0f);
  zl::Status s = load(&target);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("adapter.safetensors"), std::string::npos) << s.message();
  EXPECT_EQ(target.a[0], 7.0f);  // nothing was restored
}

TEST_F(DamagedCheckpoint, MissingProgressIsReported) {
  ASSERT_EQ(::unlink((window_dir_ + "/progress.json").c_str()), 0);
  Stage target;
  zl::Status s = load(&target);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("progress.json"), std::string::npos) << s.message();
}

TEST_F(DamagedCheckpoint, CorruptProgressJsonIsReported) {
  zl_test::write_text(window_dir_ + "/progress.json", "{\"format\": \"zl-checkpoint\", \"version\": 1, \"window\":");
  Stage target;
  zl::Status s = load(&target);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("progress.json"), std::string::npos) << s.message();
}

TEST_F(DamagedCheckpoint, MissingOptimizerFileIsReported) {
  ASSERT_EQ(::unlink((window_dir_ + "/optimizer.safetensors").c_str()), 0);
  Stage target;
  zl::Status s = load(&target);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("optimizer.safetensors"), std::string::npos) << s.message();
}

TEST_F(DamagedCheckpoint, MomentsMissingWithoutTheZeroMarkAreReported) {
  // An optimizer file without tensors is zeros only when it says so.
  ASSERT_TRUE(zl::write_safetensors(window_dir_ + "/optimizer.safetensors", {}, {{"format", "pt"}}).ok());
  Stage target;
  zl::Status s = load(&target);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("optimizer.safetensors"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(".exp_avg"), std::string::npos) << s.message();
}

TEST_F(DamagedCheckpoint, ShapeMismatchNamesTensorAndShapes) {
  Stage other_shape(4);  // lora_A is [4, 3] in this "program", [2, 3] on disk
  zl::Status s = load(&other_shape);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find(kA), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("[2,3]"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("[4,3]"), std::string::npos) << s.message();
}

TEST_F(DamagedCheckpoint, DifferentParameterSetIsReported) {
  std::vector<float> a(6), b(6), c(1);
  ASSERT_OK_AND_ASSIGN(const std::unique_ptr<AdamW> opt,
                       AdamW::create(AdamWConfig{}, {TrainableParam{kA, {2, 3}, a.data()}, TrainableParam{kB, {3, 2}, b.data()},
                                                     TrainableParam{"extra.lora_A.weight", {1}, c.data()}}));
  const zl::Status s = store_.load_latest(opt.get()).status();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("lacks tensor 'extra.lora_A.weight'"), std::string::npos) << s.message();
}

TEST(Checkpoint, ANonFiniteWeightIsADamagedCheckpoint) {
  // A run that diverged: an intact file whose weight is nan is as unusable as a torn one (kCorrupt, so a resume
  // falls back to an older window, StageRunner::fall_back).
  zl_test::TempDir dir;
  CheckpointStore store(CheckpointOptions{dir.path(), 1, 2});
  Stage stage;
  stage.train_step(1.0f);
  stage.b[4] = std::numeric_limits<float>::quiet_NaN();
  ASSERT_TRUE(store.save(*stage.opt, progress_for(stage, 0)).ok());
  Stage target(2, 7.0f);
  const zl::Status s = store.load_latest(target.opt.get()).status();
  ASSERT_EQ(s.code(), zl::StatusCode::kCorrupt) << s.message();
  EXPECT_NE(s.message().find(std::string("tensor '") + kB + "' holds nan at element 4 (a damaged run: not finite)"),
            std::string::npos) << s.message();
  EXPECT_EQ(target.a[0], 7.0f);  // nothing was restored
  EXPECT_EQ(zl::first_non_finite(stage.a.data(), static_cast<int64_t>(stage.a.size())), -1);
}

TEST_F(DamagedCheckpoint, LeftoverTempDirIsIgnoredThenRemoved) {
  const std::string tmp = dir_.file(".tmp-window_000001-999");
  zl_test::write_text(tmp + "/adapter.safetensors", "partial");
  Stage target;
  ASSERT_OK_AND_ASSIGN(const std::optional<CheckpointProgress> loaded, store_.load_latest(target.opt.get()));
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->window, 0);
  stage_.train_step(2.0f);
  ASSERT_TRUE(store_.save(*stage_.opt, progress_for(stage_, 1)).ok());
  EXPECT_FALSE(zl::is_directory(tmp));
}

// Child process: saves windows 1, 2, 3, ... of a large parameter (every value
// = window + 1) until it is killed.
[[noreturn]] void save_forever(const std::string& root, size_t numel) {
  std::vector<float> data(numel, 0.0f);
  zl::Result<std::unique_ptr<AdamW>> created =
      AdamW::create(AdamWConfig{}, {TrainableParam{kA, {static_cast<int64_t>(numel)}, data.data()}});
  if (!created.ok()) _exit(2);
  const std::unique_ptr<AdamW> opt = std::move(created).value();
  CheckpointStore store({root, 1, 2});
  for (int64_t w = 1; w < 10000; ++w) {
    std::fill(data.begin(), data.end(), static_cast<float>(w + 1));
    CheckpointProgress p;
    p.window = w;
    if (!store.save(*opt, p).ok()) _exit(3);
  }
  _exit(0);
}

bool has_temp_entry(const std::string& root) {
  const zl::Result<std::vector<std::string>> names = zl::list_directory(root);
  if (!names.ok()) return false;
  return std::any_of(names->begin(), names->end(), [](const std::string& n) { return n.rfind(".tmp-", 0) == 0; });
}

TEST(CheckpointCrash, KilledWriterLeavesPreviousCheckpointAsLatest) {
  zl_test::TempDir dir;
  const std::string root = dir.file("ckpt");
  constexpr size_t kNumel = size_t{4} << 20;  // 16 MiB per tensor, 48 MiB per checkpoint
  bool killed_mid_write = false;
  for (int attempt = 0; attempt < 5 && !killed_mid_write; ++attempt) {
    ASSERT_TRUE(zl::remove_tree(root).ok());
    {
      // Window 0 (values 1.0) exists before the writer starts.
      std::vector<float> data(kNumel, 1.0f);
      ASSERT_OK_AND_ASSIGN(const std::unique_ptr<AdamW> opt,
                           AdamW::create(AdamWConfig{}, {TrainableParam{kA, {static_cast<int64_t>(kNumel)}, data.data()}}));
      CheckpointProgress p;
      p.window = 0;
      ASSERT_TRUE(CheckpointStore({root, 1, 2}).save(*opt, p).ok());
    }
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) save_forever(root, kNumel);

    // Kill once the child is inside a save, after attempt-many complete ones
    // (so both "only window 0" and "a newer window" get exercised).
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (std::chrono::steady_clock::now() < deadline) {
      const std::vector<int64_t> windows =
          CheckpointStore({root, 1, 2}).list_windows().value_or(std::vector<int64_t>());
      const bool enough = attempt == 0 || (!windows.empty() && windows.back() >= 1);
      if (enough && has_temp_entry(root)) break;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    ASSERT_EQ(::kill(child, SIGKILL), 0);
    int wstatus = 0;
    ASSERT_EQ(::waitpid(child, &wstatus, 0), child);
    ASSERT_TRUE(WIFSIGNALED(wstatus)) << "writer exited on its own with status " << wstatus;
    killed_mid_write = has_temp_entry(root);
  }
  ASSERT_TRUE(killed_mid_write) << "never caught the writer inside a save";

  CheckpointStore store({root, 1, 2});
  ASSERT_OK_AND_ASSIGN(const std::vector<int64_t> windows, store.list_windows());
  ASSERT_FALSE(windows.empty());
  std::vector<float> data(kNumel, -1.0f);
  ASSERT_OK_AND_ASSIGN(const std::unique_ptr<AdamW> opt,
                       AdamW::create(AdamWConfig{}, {TrainableParam{kA, {static_cast<int64_t>(kNumel)}, data.data()}}));
  ASSERT_OK_AND_ASSIGN(const std::optional<CheckpointProgress> loaded, store.load_latest(opt.get()));
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->window, windows.back());
  const float expected = static_cast<float>(loaded->window + 1);
  EXPECT_EQ(data.front(), expected);
  EXPECT_EQ(data.back(), expected);
  EXPECT_TRUE(std::all_of(data.begin(), data.end(), [&](float v) { return v == expected; }));
}

}  // namespace
