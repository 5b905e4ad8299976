// Runner config parsing: a good file, and each kind of mistake gets a message
// that names the field.
#include "zl/runner_config.h"

#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "status_test_support.h"
#include "temp_dir_support.h"

namespace {

using nlohmann::json;
using zl::RunnerConfig;

json middle_stage() {
  return {{"program", "stage1.pte"},
          {"stage_index", 1},
          {"num_stages", 3},
          {"listen", "0.0.0.0:7001"},
          {"downstream", "192.168.1.12:7002"},
          {"run_key_file", "run.key"},
          {"run_id", "00112233445566778899aabbccddeeff"},
          {"window_size", 4},
          {"num_micro_batches", 10},
          {"checkpoint_dir", "ckpt"}};
}

zl::Status parse(const json& j, RunnerConfig* out, const std::string& base = "") {
  zl::Result<RunnerConfig> parsed = zl::parse_runner_config(j.dump(), base);
  if (!parsed.ok()) return parsed.status();
  *out = std::move(parsed).value();
  return zl::Status();
}

void expect_error(const json& j, const std::vector<std::string>& fragments) {
  RunnerConfig config;
  zl::Status s = parse(j, &config);
  ASSERT_FALSE(s.ok()) << j.dump();
  for (const auto& f : fragments) EXPECT_NE(s.message().find(f), std::string::npos) << s.message();
}

TEST(RunnerConfig, ParsesAMiddleStageWithDefaults) {
  RunnerConfig c;
  zl::Status s = parse(middle_stage(), &c, "/data/local/tmp/zl");
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_EQ(c.program, "/data/local/tmp/zl/stage1.pte");
  EXPECT_EQ(c.checkpoint_dir, "/data/local/tmp/zl/ckpt");
  EXPECT_EQ(c.input_log_dir, "/data/local/tmp/zl/ckpt/input_log");
  EXPECT_EQ(c.listen, "0.0.0.0:7001");  // addresses are not paths
  EXPECT_EQ(c.stage_index, 1);
  EXPECT_EQ(c.window_size, 4);
  EXPECT_EQ(c.num_windows(), 3);
  EXPECT_EQ(c.in_flight_depth, 4);
  EXPECT_EQ(c.keep_last, 2);
  EXPECT_TRUE(c.early_forwarding);
  EXPECT_EQ(c.link_profile, "local");
  EXPECT_EQ(c.load_mode, "mmap");
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 1e-4);
  EXPECT_EQ(c.optimizer.schedule.kind, zl::LrScheduleKind::kConstant);
}

TEST(RunnerConfig, ParsesNestedOptimizerAndSchedule) {
  json j = middle_stage();
  j["optimizer"] = {{"lr", 2e-4},
                    {"betas", {0.8, 0.99}},
                    {"weight_decay", 0},
                    {"schedule", {{"kind", "warmup_cosine"}, {"warmup_steps", 1}, {"min_lr_ratio", 0.1}}}};
  j["early_forwarding"] = false;
  j["link_profile"] = "wifi";
  RunnerConfig c;
  zl::Status s = parse(j, &c);
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 2e-4);
  EXPECT_DOUBLE_EQ(c.optimizer.beta1, 0.8);
  EXPECT_DOUBLE_EQ(c.optimizer.beta2, 0.99);
  EXPECT_DOUBLE_EQ(c.optimizer.weight_decay, 0.0);
  EXPECT_EQ(c.optimizer.schedule.kind, zl::LrScheduleKind::kWarmupCosine);
  EXPECT_EQ(c.optimizer.schedule.total_steps, 3);  // 0 -> number of windows
  EXPECT_FALSE(c.early_forwarding);
  EXPECT_EQ(c.program, "stage1.pte");  // no base dir: left as given
}

TEST(RunnerConfig, UnknownFieldIsNamedWithTheValidOnes) {
  json j = middle_stage();
  j["windowsize"] = 4;
  expect_error(j, {"unknown field 'windowsize'", "window_size", "checkpoint_dir"});
  j = middle_stage();
  j["optimizer"] = {{"learning_rate", 1e-3}};
  expect_error(j, {"'optimizer.learning_rate'", "in 'optimizer'", "lr, betas, eps, weight_decay, schedule"});
}

TEST(RunnerConfig, MissingRequiredFieldIsNamed) {
  json j = middle_stage();
  j.erase("run_id");
  expect_error(j, {"missing required field 'run_id'"});
}

TEST(RunnerConfig, WrongTypeNamesExpectedAndSeen) {
  json j = middle_stage();
  j["window_size"] = "4";
  expect_error(j, {"'window_size'", "integer", "string \"4\""});
  j = middle_stage();
  j["optimizer"] = {{"lr", "fast"}};
  expect_error(j, {"'optimizer.lr'", "number", "\"fast\""});
  j = middle_stage();
  j["window_size"] = 2.5;
  expect_error(j, {"'window_size'", "integer", "2.5"});
  j = middle_stage();
  j["optimizer"] = {{"betas", {0.9}}};
  expect_error(j, {"'optimizer.betas'", "[number, number]"});
}

TEST(RunnerConfig, StageRolesRequireTheirAddresses) {
  json j = middle_stage();
  j.erase("downstream");
  expect_error(j, {"'downstream'"});
  j = middle_stage();
  j.erase("listen");
  expect_error(j, {"'listen'"});
  j = middle_stage();
  j["stage_index"] = 0;
  expect_error(j, {"'data_shard'"});
  j["data_shard"] = "shard0.bin";
  j.erase("listen");
  RunnerConfig c;
  EXPECT_TRUE(parse(j, &c).ok());
  j = middle_stage();
  j["stage_index"] = 2;
  j.erase("downstream");
  EXPECT_TRUE(parse(j, &c).ok());  // last stage sends nothing
}

TEST(RunnerConfig, BadValuesAreNamed) {
  json j = middle_stage();
  j["stage_index"] = 3;
  expect_error(j, {"'stage_index'", "num_stages"});
  j = middle_stage();
  j["downstream"] = "192.168.1.12";
  expect_error(j, {"'downstream'", "host:port"});
  j = middle_stage();
  j["run_id"] = "xyz";
  expect_error(j, {"'run_id'", "32 hex"});
  j = middle_stage();
  j["link_profile"] = "5g";
  expect_error(j, {"'link_profile'", "5g"});
  j = middle_stage();
  j["load_mode"] = "heap";
  expect_error(j, {"'load_mode'", "heap", "mmap"});
  j = middle_stage();
  j["optimizer"] = {{"schedule", {{"kind", "linear"}}}};
  expect_error(j, {"optimizer.schedule.kind", "warmup_cosine"});
  j = middle_stage();
  j["window_size"] = 0;
  expect_error(j, {"'window_size'", ">= 1"});
  expect_error(json::array({1, 2}), {"JSON object"});
  EXPECT_FALSE(zl::parse_runner_config("{not json", "").ok());
}

TEST(RunnerConfig, TheRoleIsAFieldAndAnOlderConfigGetsItFromTheLr) {
  json held = middle_stage();
  held["optimizer"] = {{"lr", 0.0}};
  RunnerConfig c;
  ASSERT_TRUE(parse(held, &c).ok());
  EXPECT_TRUE(c.held_still() && c.forward_only());  // no role: lr 0 before the last under zerolock
  held["forward_only_at_lr0"] = false;
  ASSERT_TRUE(parse(held, &c).ok());
  EXPECT_TRUE(c.held_still() && !c.forward_only());  // held, but phase 2 kept for its losses

  json trains = middle_stage();
  trains["optimizer"] = {{"lr", 0.0}};
  trains["role"] = "train";  // a role given wins over the lr
  ASSERT_TRUE(parse(trains, &c).ok());
  EXPECT_FALSE(c.held_still());
  json forward = middle_stage();
  forward["optimizer"] = {{"lr", 0.0}};
  forward["role"] = "forward";
  ASSERT_TRUE(parse(forward, &c).ok());
  EXPECT_TRUE(c.forward_only());

  forward["optimizer"] = {{"lr", 1e-3}};  // a held stage cannot train
  expect_error(forward, {"'role' is 'forward'", "optimizer.lr 0.001", "only a zerolock stage at lr 0"});
  forward["optimizer"] = {{"lr", 0.0}};
  forward["schedule"] = "gpipe";  // nor skip the gradient a backprop schedule owes upstream
  expect_error(forward, {"'role' is 'forward'", "schedule 'gpipe'"});
  json other = middle_stage();
  other["role"] = "frozen";
  expect_error(other, {"field 'role' is 'frozen'", "train or forward"});
}

TEST(RunnerConfig, HelpDocumentsEveryField) {
  const std::string help = zl::runner_config_help();
  const json all = zl::runner_config_to_json(RunnerConfig{});
  for (const char* field : {"program", "listen", "run_key_file", "window_size", "in_flight_depth", "keep_last",
                            "optimizer.lr", "optimizer.betas", "optimizer.schedule.kind",
                            "optimizer.schedule.min_lr_ratio", "link_profile", "log_path", "early_forwarding",
                            "seed"}) {
    EXPECT_NE(help.find(field), std::string::npos) << field;
  }
  EXPECT_NE(help.find("default [0.9,0.999]"), std::string::npos) << help;
  EXPECT_NE(help.find("required"), std::string::npos);
  // Every leaf of the effective config appears in the help.
  EXPECT_EQ(all.at("optimizer").at("schedule").at("kind"), "constant");
  for (auto it = all.begin(); it != all.end(); ++it) EXPECT_NE(help.find(it.key()), std::string::npos) << it.key();
}

TEST(RunnerConfig, ToJsonRoundTrips) {
  RunnerConfig c;
  ASSERT_TRUE(parse(middle_stage(), &c).ok());
  RunnerConfig again;
  zl::Status s = parse(zl::runner_config_to_json(c), &again);
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_EQ(zl::runner_config_to_json(again), zl::runner_config_to_json(c));
}

TEST(RunnerConfig, FieldTableAsDataMatchesHelpAndDefaults) {
  const json rows = zl::runner_config_fields();
  const json defaults = zl::runner_config_to_json(RunnerConfig{});
  ASSERT_TRUE(rows.is_array());
  int required = 0;
  for (const json& row : rows) {
    const std::string path = row.at("path");
    EXPECT_NE(zl::runner_config_help().find(path), std::string::npos) << path;
    if (row.at("required")) {
      ++required;
      EXPECT_FALSE(row.contains("default")) << path;
    } else if (row.at("type") != "object") {
      json node = defaults;  // the row's default is the effective config's value of a config without it
      for (size_t start = 0, dot; start <= path.size(); start = dot + 1) {
        dot = path.find('.', start);
        if (dot == std::string::npos) dot = path.size();
        node = node.at(path.substr(start, dot - start));
      }
      EXPECT_EQ(row.at("default"), node) << path;
    }
  }
  EXPECT_EQ(required, 8);  // program, stage_index, num_stages, run_key_file, run_id, window_size, ...
  EXPECT_EQ(rows.front().at("path"), "base_dir");
  EXPECT_TRUE(rows[1].at("is_path"));  // program
}

TEST(RunnerConfig, LoadResolvesPathsAgainstTheFile) {
  zl_test::TempDir dir;
  zl_test::write_text(dir.file("conf/stage1.json"), middle_stage().dump());
  ASSERT_OK_AND_ASSIGN(const RunnerConfig c, zl::load_runner_config(dir.file("conf/stage1.json")));
  EXPECT_EQ(c.run_key_file, dir.file("conf/run.key"));
  const zl::Status s = zl::load_runner_config(dir.file("conf/missing.json")).status();
  EXPECT_EQ(s.code(), zl::StatusCode::kNotFound);
  EXPECT_NE(s.message().find("missing.json"), std::string::npos);
}

TEST(RunKey, ReadsHexWithTrailingNewline) {
  zl_test::TempDir dir;
  const std::string hex = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";
  zl_test::write_text(dir.file("run.key"), hex + "\n");
  ASSERT_OK_AND_ASSIGN(const zl::FrameKey key, zl::load_run_key(dir.file("run.key")));
  EXPECT_EQ(key[0], 0x00);
  EXPECT_EQ(key[31], 0x1f);
}

TEST(RunKey, RejectsRawBytesAndShortKeys) {
  zl_test::TempDir dir;
  zl_test::write_text(dir.file("short.key"), "abcd");
  const zl::Status s = zl::load_run_key(dir.file("short.key")).status();
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("64 hex"), std::string::npos) << s.message();
  zl_test::write_text(dir.file("raw.key"), std::string(32, '\x7f'));
  EXPECT_FALSE(zl::load_run_key(dir.file("raw.key")).ok());
  EXPECT_EQ(zl::load_run_key(dir.file("none.key")).status().code(), zl::StatusCode::kNotFound);
}

}  // namespace
