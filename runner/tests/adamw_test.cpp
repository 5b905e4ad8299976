// AdamW and the learning-rate schedules. Agreement with torch.optim.AdamW over
// many steps is tested from Python (tests/test_adamw.py via zl_adamw_check);
// these pin the formulas on values computed by hand.
#include "zl/adamw.h"

#include <cmath>
#include <memory>
#include <vector>

#include <gtest/gtest.h>

namespace {

using zl::AdamW;
using zl::AdamWConfig;
using zl::LrSchedule;
using zl::LrScheduleKind;
using zl::TrainableParam;

LrSchedule warmup_cosine(int64_t warmup, int64_t total, double floor) {
  LrSchedule s;
  s.kind = LrScheduleKind::kWarmupCosine;
  s.warmup_steps = warmup;
  s.total_steps = total;
  s.min_lr_ratio = floor;
  return s;
}

TEST(LrSchedule, ConstantIsOne) {
  LrSchedule s;
  EXPECT_EQ(s.factor(0), 1.0);
  EXPECT_EQ(s.factor(1000), 1.0);
}

TEST(LrSchedule, WarmupRisesLinearlyToOne) {
  LrSchedule s = warmup_cosine(4, 10, 0.1);
  EXPECT_DOUBLE_EQ(s.factor(0), 0.25);
  EXPECT_DOUBLE_EQ(s.factor(1), 0.5);
  EXPECT_DOUBLE_EQ(s.factor(3), 1.0);
  EXPECT_DOUBLE_EQ(s.factor(4), 1.0);  // cosine starts at its top
}

TEST(LrSchedule, CosineReachesFloorAndStays) {
  LrSchedule s = warmup_cosine(2, 10, 0.1);
  // Midway through the decay (t = 6 of 2..10) the cosine term is 0.5.
  EXPECT_DOUBLE_EQ(s.factor(6), 0.1 + 0.9 * 0.5);
  EXPECT_DOUBLE_EQ(s.factor(10), 0.1);
  EXPECT_DOUBLE_EQ(s.factor(50), 0.1);
  EXPECT_GT(s.factor(5), s.factor(7));
}

TEST(LrSchedule, NoWarmupStartsAtOne) {
  LrSchedule s = warmup_cosine(0, 4, 0.0);
  EXPECT_DOUBLE_EQ(s.factor(0), 1.0);
  EXPECT_DOUBLE_EQ(s.factor(2), 0.5);
  EXPECT_DOUBLE_EQ(s.factor(4), 0.0);
}

TEST(LrSchedule, ValidateRejectsBadSettings) {
  EXPECT_FALSE(warmup_cosine(5, 3, 0.1).validate().ok());
  EXPECT_FALSE(warmup_cosine(-1, 3, 0.1).validate().ok());
  zl::Status s = warmup_cosine(1, 3, 1.5).validate();
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("min_lr_ratio"), std::string::npos) << s.message();
}

std::unique_ptr<AdamW> make(AdamWConfig config, std::vector<float>* p) {
  zl::Result<std::unique_ptr<AdamW>> opt =
      AdamW::create(config, {TrainableParam{"w", {static_cast<int64_t>(p->size())}, p->data()}});
  EXPECT_TRUE(opt.ok()) << opt.status().message();
  return opt.ok() ? std::move(opt).value() : nullptr;
}

TEST(AdamW, FirstStepMatchesHandComputation) {
  // p=1, g=0.5, lr=0.1, wd=0.1: p <- 0.99 (decay), m=0.05, v=2.5e-4,
  // bias corrections 0.1 and 0.001: denom = 0.5 + eps, step 1.0 -> p = 0.89.
  AdamWConfig config;
  config.lr = 0.1;
  config.weight_decay = 0.1;
  std::vector<float> p = {1.0f};
  auto opt = make(config, &p);
  const float g = 0.5f;
  ASSERT_TRUE(opt->accumulate({&g}).ok());
  const zl::Result<double> lr = opt->step();
  ASSERT_TRUE(lr.ok()) << lr.status().message();
  EXPECT_DOUBLE_EQ(*lr, 0.1);
  EXPECT_NEAR(p[0], 0.89f, 1e-6);
  EXPECT_NEAR(opt->exp_avg(0)[0], 0.05f, 1e-8);
  EXPECT_NEAR(opt->exp_avg_sq(0)[0], 2.5e-4f, 1e-10);
  EXPECT_EQ(opt->step_count(), 1);
}

TEST(AdamW, AccumulationStepsWithTheMean) {
  AdamWConfig config;
  config.lr = 0.01;
  std::vector<float> a = {1.0f, -2.0f}, b = a;
  auto mean_opt = make(config, &a);
  auto acc_opt = make(config, &b);
  const std::vector<float> g1 = {0.2f, -0.4f}, g2 = {0.6f, 0.0f}, mean = {0.4f, -0.2f};
  ASSERT_TRUE(mean_opt->accumulate({mean.data()}).ok());
  ASSERT_TRUE(acc_opt->accumulate({g1.data()}).ok());
  ASSERT_TRUE(acc_opt->accumulate({g2.data()}).ok());
  EXPECT_EQ(acc_opt->accumulated(), 2);
  ASSERT_TRUE(mean_opt->step().ok());
  ASSERT_TRUE(acc_opt->step().ok());
  EXPECT_EQ(acc_opt->accumulated(), 0);
  EXPECT_NEAR(a[0], b[0], 1e-7);
  EXPECT_NEAR(a[1], b[1], 1e-7);
  EXPECT_NE(b[0], 1.0f);
}

TEST(AdamW, ZeroLearningRateLeavesTheWeightsBitForBit) {
  AdamWConfig config;
  config.lr = 0.0;
  config.weight_decay = 0.1;
  std::vector<float> p = {1.0f, -0.25f};
  auto opt = make(config, &p);
  const std::vector<float> g = {0.5f, -3.0f};
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(opt->accumulate({g.data()}).ok());
    ASSERT_TRUE(opt->step().ok());
  }
  EXPECT_EQ(p[0], 1.0f);
  EXPECT_EQ(p[1], -0.25f);
  EXPECT_EQ(opt->step_count(), 3);
  config.lr = -1e-3;
  EXPECT_FALSE(config.validate().ok());
}

TEST(AdamW, SkipStepAdvancesTheScheduleOnly) {
  // A stage held still (lr 0) computes no gradients; its windows still count
  // as optimizer steps, on the schedule a stepping stage would follow.
  AdamWConfig config;
  config.lr = 0.1;
  config.weight_decay = 0.1;
  config.schedule = warmup_cosine(2, 6, 0.1);
  std::vector<float> p = {1.0f, -0.25f};
  auto opt = make(config, &p);
  const std::vector<float> g = {0.5f, -3.0f};
  ASSERT_TRUE(opt->accumulate({g.data()}).ok());
  ASSERT_TRUE(opt->step().ok());
  const std::vector<float> p_after_step = p;
  const std::vector<float> m(opt->exp_avg(0), opt->exp_avg(0) + 2), v(opt->exp_avg_sq(0), opt->exp_avg_sq(0) + 2);
  for (int64_t t = 1; t < 4; ++t) {
    const zl::Result<double> lr = opt->skip_step();
    ASSERT_TRUE(lr.ok()) << lr.status().message();
    EXPECT_DOUBLE_EQ(*lr, opt->lr_at(t));
    EXPECT_EQ(opt->step_count(), t + 1);
  }
  EXPECT_EQ(p, p_after_step);
  EXPECT_EQ(std::vector<float>(opt->exp_avg(0), opt->exp_avg(0) + 2), m);
  EXPECT_EQ(std::vector<float>(opt->exp_avg_sq(0), opt->exp_avg_sq(0) + 2), v);
}

TEST(AdamW, StateIsAllocatedWhenFirstWritten) {
  // A stage held still by lr 0 never accumulates or steps: it carries no
  // moments and no accumulator, and reads them as zeros (checkpoints).
  std::vector<float> p(1000, 1.0f);
  auto opt = make(AdamWConfig{}, &p);
  EXPECT_EQ(opt->state_bytes(), 0u);
  for (int64_t t = 0; t < 3; ++t) ASSERT_TRUE(opt->skip_step().ok());
  opt->clear_accumulator();
  EXPECT_EQ(opt->state_bytes(), 0u);
  EXPECT_EQ(opt->exp_avg(0)[999], 0.0f);
  EXPECT_EQ(opt->grad_sum(0)[0], 0.0f);
  const std::vector<float> g(1000, 0.5f);
  ASSERT_TRUE(opt->accumulate({g.data()}).ok());
  EXPECT_EQ(opt->state_bytes(), 1000 * sizeof(float));  // the accumulator
  EXPECT_EQ(opt->grad_sum(0)[999], 0.5f);
  ASSERT_TRUE(opt->step().ok());
  EXPECT_EQ(opt->state_bytes(), 3 * 1000 * sizeof(float));  // and both moments
  EXPECT_GT(opt->exp_avg(0)[999], 0.0f);
}

TEST(AdamW, RestoringZeroMomentsAllocatesNone) {
  // A held stage's checkpoint (zero moments) restores without allocating
  // them; its next real step is the same as a fresh optimizer's.
  AdamWConfig config;
  config.lr = 0.05;
  std::vector<float> a = {0.5f, 1.5f}, b = {9.0f, 9.0f};
  const std::vector<float> zeros(2, 0.0f);
  auto fresh = make(config, &a);
  auto restored = make(config, &b);
  ASSERT_TRUE(restored->restore(0, {a.data()}, {zeros.data()}, {zeros.data()}).ok());
  EXPECT_EQ(restored->state_bytes(), 0u);
  EXPECT_EQ(b, a);
  const std::vector<float> g = {0.3f, -0.7f};
  for (auto* opt : {fresh.get(), restored.get()}) {
    ASSERT_TRUE(opt->accumulate({g.data()}).ok());
    ASSERT_TRUE(opt->step().ok());
  }
  EXPECT_EQ(b, a);
}

TEST(AdamW, SkipStepRefusesToDropGradients) {
  std::vector<float> p = {3.0f};
  auto opt = make(AdamWConfig{}, &p);
  const float g = 1.0f;
  ASSERT_TRUE(opt->accumulate({&g}).ok());
  const zl::Result<double> lr = opt->skip_step();
  ASSERT_FALSE(lr.ok());
  EXPECT_NE(lr.status().message().find("accumulated"), std::string::npos) << lr.status().message();
  EXPECT_EQ(opt->step_count(), 0);
  EXPECT_EQ(opt->accumulated(), 1);
}

TEST(AdamW, StepWithoutGradientsFailsAndChangesNothing) {
  std::vector<float> p = {3.0f};
  auto opt = make(AdamWConfig{}, &p);
  EXPECT_FALSE(opt->step().ok());
  EXPECT_EQ(p[0], 3.0f);
  EXPECT_EQ(opt->step_count(), 0);
}

TEST(AdamW, ScheduleScalesTheUpdate) {
  // With zero weight decay the first Adam step moves each weight by ~lr_t.
  AdamWConfig config;
  config.lr = 0.1;
  config.weight_decay = 0.0;
  config.schedule = warmup_cosine(4, 8, 0.0);
  std::vector<float> p = {0.0f};
  auto opt = make(config, &p);
  const float g = 1.0f;
  ASSERT_TRUE(opt->accumulate({&g}).ok());
  ASSERT_TRUE(opt->step().ok());
  EXPECT_NEAR(p[0], -0.025f, 1e-6);  // lr * 1/4
  EXPECT_DOUBLE_EQ(opt->lr_at(1), 0.05);
}

TEST(AdamW, RejectsBadParamsAndConfig) {
  std::vector<float> p = {0.0f};
  EXPECT_FALSE(AdamW::create(AdamWConfig{}, {{"w", {1}, p.data()}, {"w", {1}, p.data()}}).ok());
  EXPECT_FALSE(AdamW::create(AdamWConfig{}, {{"w", {1}, nullptr}}).ok());
  AdamWConfig bad;
  bad.beta2 = 1.0;
  const zl::Status s = AdamW::create(bad, {{"w", {1}, p.data()}}).status();
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("betas[1]"), std::string::npos) << s.message();
}

TEST(AdamW, AccumulateChecksGradientCount) {
  std::vector<float> p = {0.0f};
  auto opt = make(AdamWConfig{}, &p);
  const float g = 1.0f;
  EXPECT_FALSE(opt->accumulate({&g, &g}).ok());
  EXPECT_EQ(opt->accumulated(), 0);
}

TEST(AdamW, RestoreContinuesLikeTheOriginal) {
  AdamWConfig config;
  config.lr = 0.05;
  std::vector<float> a = {0.5f, 1.5f};
  auto original = make(config, &a);
  const std::vector<float> g = {0.3f, -0.7f};
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(original->accumulate({g.data()}).ok());
    ASSERT_TRUE(original->step().ok());
  }
  std::vector<float> b = {9.0f, 9.0f};
  auto copy = make(config, &b);
  ASSERT_TRUE(copy->restore(original->step_count(), {a.data()}, {original->exp_avg(0)},
                            {original->exp_avg_sq(0)})
                  .ok());
  EXPECT_EQ(b, a);
  ASSERT_TRUE(original->accumulate({g.data()}).ok());
  ASSERT_TRUE(original->step().ok());
  ASSERT_TRUE(copy->accumulate({g.data()}).ok());
  ASSERT_TRUE(copy->step().ok());
  EXPECT_EQ(b, a);  // bit-identical: same state, same arithmetic
}

}  // namespace
