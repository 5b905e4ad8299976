// Command-line parsing shared by the check tools (zl_adamw_check, zl_step_check): `--key value` pairs,
// `-h`/`--help`, and the keys a tool cannot run without.
#pragma once

#include <cstdio>
#include <initializer_list>
#include <map>
#include <cstdint>
#include <string>
#include <vector>

namespace zl {

/// Parses argv into `args` (key without the dashes -> value). Returns -1 to go on, or the exit status to
/// return at once: 0 after printing `usage` for --help, 2 (usage on stderr) for a malformed line or a
/// missing required key, which is named.
inline int parse_tool_args(int argc, char** argv, const char* tool, const char* usage,
                           std::initializer_list<const char*> required, std::map<std::string, std::string>* args) {
  for (int i = 1; i < argc; ++i) {
    std::string key = argv[i];
    if (key == "-h" || key == "--help") {
      std::fputs(usage, stdout);
      return 0;
    }
    if (key.rfind("--", 0) != 0 || i + 1 >= argc) {
      std::fputs(usage, stderr);
      return 2;
    }
    (*args)[key.substr(2)] = argv[++i];
  }
  for (const char* name : required) {
    if (args->count(name) == 0) {
      std::fprintf(stderr, "%s: missing --%s\n%s", tool, name, usage);
      return 2;
    }
  }
  return -1;
}

/// The fixed token inputs the step tools feed a stage (B*S positions of
/// sequences of `seq_len`): deterministic ids, the last 3 positions padding,
/// labels ignored (-100) on the first 2 positions and on padding.
struct FixedTokens {
  std::vector<int64_t> ids, mask, labels;
};

inline FixedTokens fixed_tokens(int64_t positions, int64_t seq_len) {
  FixedTokens t;
  for (int64_t i = 0; i < positions; ++i) {
    const int64_t pos = i % seq_len;
    t.ids.push_back((i * 37 + 11) % 250);
    t.mask.push_back(pos < seq_len - 3 ? 1 : 0);
    t.labels.push_back(pos < 2 || t.mask.back() == 0 ? -100 : t.ids.back());
  }
  return t;
}

}  // namespace zl
