// The part of an export's manifest.json (written by `zl export`) that a
// stage program is checked against: its stage entry, found by file name, with
// the layer range, whether it has a `hidden` output, and its LoRA parameters
// (PEFT name, name inside the program, shape) in gradient order, and the
// export's program kind.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "zl/status.h"

namespace zl {

/// What the runner needs from manifest.json for one program file.
struct ManifestStage {
  /// One LoRA tensor of the stage.
  struct Param {
    std::string name;          ///< PEFT name, as in adapter_model.safetensors
    std::string program_name;  ///< fqn inside the program (__et_training_fqn_forward)
    std::vector<int64_t> shape;
  };
  int64_t index = 0;        ///< stage index k
  int64_t first_layer = 0;  ///< decoder layers [first_layer, last_layer] of the model
  int64_t last_layer = 0;
  bool has_hidden_output = false;  ///< false on the last stage (no marker, no downstream)
  std::vector<Param> params;       ///< in gradient order
  /// The manifest's "program": what every stage's program computes
  /// (docs/design#backprop-program): "zerolock" (a local step; manifests from before
  /// the field) or "backprop" (a gradient in, a gradient out).
  std::string program_kind = "zerolock";
  double local_weight = 0;  ///< backprop: the weight of an upstream stage's local loss
};

/// Reads `manifest_path` and returns the entry of `program_file` (a base
/// name such as "stage_1.pte"). Errors name the manifest and the missing or
/// malformed field and say to export again.
Result<ManifestStage> read_manifest_stage(const std::string& manifest_path, const std::string& program_file);

}  // namespace zl
