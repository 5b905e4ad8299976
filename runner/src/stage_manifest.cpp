#include "zl/stage_manifest.h"

#include <nlohmann/json.hpp>

#include "zl/durable_file.h"

namespace zl {
namespace {

using nlohmann::json;

bool read_int_vector(const json& value, std::vector<int64_t>* out) {
  if (!value.is_array()) return false;
  out->clear();
  for (const json& v : value) {
    if (!v.is_number_integer()) return false;
    out->push_back(v.get<int64_t>());
  }
  return true;
}

Status manifest_error(const std::string& path, const std::string& what) {
  return Status(StatusCode::kInvalidArgument,
                "manifest " + path + ": " + what + "; export the stages again with `zl export`");
}

}  // namespace

Result<ManifestStage> read_manifest_stage(const std::string& manifest_path, const std::string& program_file) {
  const Result<std::string> text = read_file(manifest_path);
  if (!text.ok()) {
    return text.status().with_context("manifest " + manifest_path + " (needed for the PEFT parameter names): ",
                               "; pass the export's manifest.json as 'manifest'");
  }
  const json root = json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) return manifest_error(manifest_path, "not a JSON object");
  auto stages = root.find("stages");
  if (stages == root.end() || !stages->is_array()) return manifest_error(manifest_path, "no 'stages' list");
  for (const json& stage : *stages) {
    auto file = stage.find("file");
    if (!stage.is_object() || file == stage.end() || !file->is_string() || file->get<std::string>() != program_file) {
      continue;
    }
    auto index = stage.find("index");
    auto layers = stage.find("layers");
    auto outputs = stage.find("outputs");
    auto params = stage.find("parameters");
    std::vector<int64_t> layer_range;
    if (index == stage.end() || !index->is_number_integer() || layers == stage.end() ||
        !read_int_vector(*layers, &layer_range) || layer_range.size() != 2 || outputs == stage.end() ||
        !outputs->is_array() || params == stage.end() || !params->is_array()) {
      return manifest_error(manifest_path, "entry of " + program_file + " lacks index, layers, outputs or parameters");
    }
    ManifestStage out;
    auto program = root.find("program");
    if (program != root.end()) {
      auto kind = program->is_object() ? program->find("kind") : program->end();
      if (kind == program->end() || !kind->is_string() ||
          (kind->get<std::string>() != "zerolock" && kind->get<std::string>() != "backprop")) {
        return manifest_error(manifest_path, "'program' is not {\"kind\": \"zerolock\" | \"backprop\", ...}");
      }
      out.program_kind = kind->get<std::string>();
      out.local_weight = program->value("local_weight", 0.0);
    }
    out.index = index->get<int64_t>();
    out.first_layer = layer_range[0];
    out.last_layer = layer_range[1];
    out.has_hidden_output = false;
    for (const json& o : *outputs) {
      if (o.is_object() && o.value("name", "") == "hidden") out.has_hidden_output = true;
    }
    for (const json& p : *params) {
      ManifestStage::Param param;
      auto name = p.find("name");
      auto program_name = p.find("program_name");
      auto shape = p.find("shape");
      if (!p.is_object() || name == p.end() || !name->is_string() || program_name == p.end() ||
          !program_name->is_string() || shape == p.end() || !read_int_vector(*shape, &param.shape)) {
        return manifest_error(manifest_path, "a parameter of " + program_file + " lacks name, program_name or shape");
      }
      param.name = name->get<std::string>();
      param.program_name = program_name->get<std::string>();
      out.params.push_back(std::move(param));
    }
    return out;
  }
  return manifest_error(manifest_path, "no stage entry with file \"" + program_file + "\"");
}

}  // namespace zl
