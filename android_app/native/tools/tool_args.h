// Command-line parsing shared by the check tools (zl_adamw_check, zl_step_check): `--key value` pairs,
// `-h`/`--help`, and the keys a tool cannot run without.
#pragma once

#include <cstdio>
#include <initializer_list>
#include <map>
#include <string>

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

}  // namespace zl
