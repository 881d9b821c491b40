// HuggingFace checkpoint folders: config.json + model.safetensors, or shards listed by
// model.safetensors.index.json. Everything is checked when the folder is opened (headers, index
// against shards); tensor data is read on demand.
#include "mlacp/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "mlacp/errors.h"
#include "model/safetensors.h"

namespace mlacp {

struct HfCheckpoint::Impl {
  std::string folder;
  HfConfig config;
  std::vector<SafetensorsFile> files;
  std::map<std::string, size_t> file_of;  // tensor name -> index into files
};

namespace {

namespace fs = std::filesystem;
using nlohmann::json;
constexpr const char* kWhat = "checkpoint";
constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";
constexpr std::streamsize kMaxIndexBytes = 256 << 20;  // DeepSeek-V3's index is ~9 MB
constexpr const char* kConfigHint =
    "config.json must describe these weights: hidden_size, num_attention_heads, q_lora_rank, kv_lora_rank, "
    "qk_nope_head_dim, qk_rope_head_dim, v_head_dim, attention_bias (mlacp.up_proj_bias, mlacp.output_gate)";

std::string join(const std::vector<std::string>& names, size_t limit = 12) {
  std::string text;
  for (size_t i = 0; i < names.size() && i < limit; ++i) text += (i ? ", " : "") + names[i];
  if (names.size() > limit) text += ", ... (" + std::to_string(names.size()) + " in all)";
  return "[" + text + "]";
}

std::string path_in(const std::string& folder, const std::string& name) { return (fs::path(folder) / name).string(); }

HfConfig read_config(const std::string& folder) {
  const std::string path = path_in(folder, "config.json");
  std::error_code ec;
  MLACP_REQUIRE(fs::exists(path, ec), kWhat, "the checkpoint folder has no config.json", {got("folder", folder)},
                "a HuggingFace model folder holds config.json next to its safetensors");
  try {
    return load_hf_config_file(path);
  } catch (const Error& e) {
    std::vector<ErrorValue> values = e.values();
    values.push_back(got("file", path));
    throw Error(e.subject(), e.rule(), values, e.hint());
  }
}

// A shard name from the index must be a plain file name inside the folder.
bool plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\\') == std::string::npos;
}

void open_sharded(HfCheckpoint::Impl& impl, const std::string& index_path) {
  std::ifstream in(index_path, std::ios::binary);
  MLACP_REQUIRE(static_cast<bool>(in), kWhat, "cannot open the index", {got("file", index_path)},
                "check the file's permissions");
  std::string text(static_cast<size_t>(kMaxIndexBytes) + 1, '\0');
  in.read(text.data(), kMaxIndexBytes + 1);
  text.resize(static_cast<size_t>(in.gcount()));
  MLACP_REQUIRE(static_cast<std::streamsize>(text.size()) <= kMaxIndexBytes, kWhat, "the index is larger than 256 MiB",
                {got("file", index_path)}, "pass the model's own model.safetensors.index.json");
  json index;
  try {
    index = json::parse(text);
  } catch (const json::parse_error& e) {
    throw Error(kWhat, "the index is not valid JSON", {got("file", index_path), got("parser", e.what())},
                "download or write model.safetensors.index.json again");
  }
  MLACP_REQUIRE(index.is_object() && index.contains("weight_map") && index.at("weight_map").is_object(), kWhat,
                "the index must be an object with a weight_map object (tensor name -> shard file)",
                {got("file", index_path)}, "download or write model.safetensors.index.json again");
  MLACP_REQUIRE(!index.contains("metadata") || index.at("metadata").is_object(), kWhat,
                "the index's metadata must be an object", {got("file", index_path)},
                "download or write model.safetensors.index.json again");
  const json& weight_map = index.at("weight_map");
  MLACP_REQUIRE(!weight_map.empty(), kWhat, "the index's weight_map lists no tensor", {got("file", index_path)},
                "download or write model.safetensors.index.json again");
  std::map<std::string, std::string> shard_of;  // tensor -> shard file name
  std::map<std::string, std::string> first_tensor_of;  // shard -> a tensor naming it (for messages)
  for (const auto& item : weight_map.items()) {
    const json& v = item.value();
    MLACP_REQUIRE(v.is_string() && plain_file_name(v.get<std::string>()), kWhat,
                  "the index must map each tensor to a shard file name in the checkpoint folder",
                  {got("file", index_path), got("tensor", item.key()), got("shard", v.dump())},
                  "shard names are plain file names such as model-00001-of-00002.safetensors");
    shard_of[item.key()] = v.get<std::string>();
    first_tensor_of.emplace(v.get<std::string>(), item.key());
  }
  std::map<std::string, size_t> file_index;
  for (const auto& [shard, tensor] : first_tensor_of) {
    const std::string path = path_in(impl.folder, shard);
    std::error_code ec;
    MLACP_REQUIRE(fs::exists(path, ec), kWhat, "a shard named by the index is missing",
                  {got("index", index_path), got("shard", shard), got("tensor", tensor)},
                  "download the missing shard into the checkpoint folder");
    file_index[shard] = impl.files.size();
    impl.files.push_back(read_safetensors_header(path));
  }
  for (const auto& [tensor, shard] : shard_of) {
    const SafetensorsFile& file = impl.files[file_index.at(shard)];
    MLACP_REQUIRE(file.tensors.count(tensor), kWhat, "the index names a tensor its shard does not hold",
                  {got("index", index_path), got("tensor", tensor), got("shard", file.path)},
                  "the index and the shards are from different saves: download them again");
    impl.file_of[tensor] = file_index.at(shard);
  }
  for (const auto& [shard, i] : file_index) {
    for (const auto& entry : impl.files[i].tensors) {
      const auto it = shard_of.find(entry.first);
      MLACP_REQUIRE(it != shard_of.end() && it->second == shard, kWhat,
                    "a shard holds a tensor the index does not list for it",
                    {got("index", index_path), got("tensor", entry.first), got("shard", impl.files[i].path),
                     got("index_says", it == shard_of.end() ? std::string("(not listed)") : it->second)},
                    "the index and the shards are from different saves: download them again");
    }
  }
}

const SafetensorsFile& file_holding(const HfCheckpoint::Impl& impl, const std::string& name) {
  const auto it = impl.file_of.find(name);
  MLACP_REQUIRE(it != impl.file_of.end(), kWhat, "no tensor of this name in the checkpoint",
                {got("folder", impl.folder), got("tensor", name)}, "tensor_names() lists the checkpoint's tensors");
  return impl.files[it->second];
}

// Checks layer `layer`'s attention tensors against `expected` (parameter name, shape): all present,
// nothing else under the layer's prefix, readable dtypes, equal shapes. No tensor data is read.
void check_layer(const HfCheckpoint::Impl& impl, int64_t layer,
                 const std::vector<std::pair<std::string, std::vector<int64_t>>>& expected) {
  const std::optional<int64_t>& layers = impl.config.num_hidden_layers;
  MLACP_REQUIRE(layer >= 0 && (!layers || layer < *layers), kWhat, "the layer index is outside the model",
                {got("layer", layer), got("num_hidden_layers", layers ? std::to_string(*layers) : "(not given)")},
                "choose a layer between 0 and num_hidden_layers - 1");
  const std::string prefix = HfCheckpoint::attention_prefix(layer);
  std::vector<std::string> present;  // parameter names (prefix stripped)
  for (const auto& item : impl.file_of)
    if (item.first.rfind(prefix, 0) == 0) present.push_back(item.first.substr(prefix.size()));
  if (present.empty()) {
    std::set<int64_t> found;
    for (const auto& item : impl.file_of) {
      const std::string& name = item.first;
      const std::string head = "model.layers.";
      if (name.rfind(head, 0) != 0) continue;
      const size_t dot = name.find('.', head.size());
      if (dot == std::string::npos || name.compare(dot, 11, ".self_attn.") != 0) continue;
      try {
        found.insert(std::stoll(name.substr(head.size(), dot - head.size())));
      } catch (const std::exception&) {
      }
    }
    fail(kWhat, "the checkpoint holds no attention tensors for this layer",
         {got("folder", impl.folder), got("layer", layer), got("prefix", prefix),
          got("layers_with_attention", std::vector<int64_t>(found.begin(), found.end()))},
         "choose a layer that has model.layers.N.self_attn.* tensors");
  }
  for (const std::string& name : present) require_readable_dtype(file_holding(impl, prefix + name), prefix + name);
  std::set<std::string> wanted, have(present.begin(), present.end());
  for (const auto& [name, shape] : expected) wanted.insert(name);
  std::vector<std::string> missing, extra;
  for (const auto& [name, shape] : expected)
    if (!have.count(name)) missing.push_back(prefix + name);
  for (const std::string& name : present)
    if (!wanted.count(name)) extra.push_back(prefix + name);
  if (!missing.empty()) {
    std::vector<ErrorValue> values{got("folder", impl.folder), got("missing", join(missing))};
    if (!extra.empty()) values.push_back(got("extra", join(extra)));
    fail(kWhat, "attention tensors of the layer are missing from the checkpoint", values, kConfigHint);
  }
  MLACP_REQUIRE(extra.empty(), kWhat, "the checkpoint holds attention tensors the layer has no parameter for",
                {got("folder", impl.folder), got("extra", join(extra))}, kConfigHint);
  for (const auto& [name, shape] : expected) {
    const SafetensorsFile& file = file_holding(impl, prefix + name);
    const std::vector<int64_t>& stored = file.tensors.at(prefix + name).shape;
    MLACP_REQUIRE(stored == shape, kWhat, "an attention tensor's shape does not match the layer's parameter",
                  {got("file", file.path), got("tensor", prefix + name), got("shape", stored), got("expected", shape)},
                  kConfigHint);
  }
}

std::vector<std::pair<std::string, at::Tensor>> read_layer(
    const HfCheckpoint& checkpoint, const HfCheckpoint::Impl& impl, int64_t layer,
    const std::vector<std::pair<std::string, std::vector<int64_t>>>& expected, std::optional<at::ScalarType> dtype) {
  check_layer(impl, layer, expected);
  const std::string prefix = HfCheckpoint::attention_prefix(layer);
  std::vector<std::pair<std::string, at::Tensor>> weights;
  for (const auto& [name, shape] : expected) weights.emplace_back(name, checkpoint.read_tensor(prefix + name, dtype));
  return weights;
}

}  // namespace

const std::string& HfCheckpoint::folder() const { return impl_->folder; }
const HfConfig& HfCheckpoint::hf_config() const { return impl_->config; }

std::vector<std::string> HfCheckpoint::tensor_names() const {
  std::vector<std::string> names;
  for (const auto& item : impl_->file_of) names.push_back(item.first);
  return names;
}

bool HfCheckpoint::has_tensor(const std::string& name) const { return impl_->file_of.count(name) > 0; }

HfTensorInfo HfCheckpoint::tensor_info(const std::string& name) const {
  const SafetensorsFile& file = file_holding(*impl_, name);
  const SafetensorsEntry& e = file.tensors.at(name);
  return {name, file.path, e.dtype, e.shape};
}

at::Tensor HfCheckpoint::read_tensor(const std::string& name, std::optional<at::ScalarType> dtype) const {
  at::Tensor tensor = read_safetensors_tensor(file_holding(*impl_, name), name);
  return dtype && *dtype != tensor.scalar_type() ? tensor.to(*dtype) : tensor;
}

void HfCheckpoint::require_readable(const std::string& name) const {
  require_readable_dtype(file_holding(*impl_, name), name);
}

std::string HfCheckpoint::attention_prefix(int64_t layer) {
  return "model.layers." + std::to_string(layer) + ".self_attn.";
}

void HfCheckpoint::check_attention_layer(int64_t layer) const {
  check_layer(*impl_, layer, mla_parameter_shapes(config()));
}

std::vector<std::pair<std::string, at::Tensor>> HfCheckpoint::read_attention_layer(
    int64_t layer, std::optional<at::ScalarType> dtype) const {
  return read_layer(*this, *impl_, layer, mla_parameter_shapes(config()), dtype);
}

void HfCheckpoint::load_attention_layer(MlaAttention& module, int64_t layer,
                                        std::optional<at::ScalarType> dtype) const {
  MLACP_REQUIRE(module->tp_size() == 1, kWhat, "load the checkpoint before sharding heads over TP",
                {got("tp_size", module->tp_size())},
                "load into a fresh module, then shard_heads_for_tp / parallelize");
  if (dtype) module->to(*dtype);
  std::vector<std::pair<std::string, std::vector<int64_t>>> expected;
  for (const auto& item : module->named_parameters())
    expected.emplace_back(item.key(), item.value().sizes().vec());
  const auto weights = read_layer(*this, *impl_, layer, expected, std::nullopt);
  at::NoGradGuard no_grad;
  auto parameters = module->named_parameters();
  for (const auto& [name, value] : weights) parameters[name].copy_(value);  // converts to the parameter's dtype
}

HfCheckpoint open_hf_checkpoint(const std::string& folder) {
  std::error_code ec;
  MLACP_REQUIRE(fs::is_directory(folder, ec), kWhat, "the checkpoint must be a folder", {got("folder", folder)},
                "pass the folder holding config.json and the safetensors files");
  auto impl = std::make_shared<HfCheckpoint::Impl>();
  impl->folder = folder;
  impl->config = read_config(folder);
  const std::string single = path_in(folder, kSingleFile), index = path_in(folder, kIndexFile);
  const bool has_single = fs::exists(single, ec), has_index = fs::exists(index, ec);
  MLACP_REQUIRE(!(has_single && has_index), kWhat, "the folder holds both model.safetensors and its sharded form",
                {got("folder", folder), got("single", kSingleFile), got("index", kIndexFile)},
                "keep one: the single file, or the shards with their index");
  if (!has_single && !has_index) {
    std::vector<std::string> other;
    for (const auto& entry : fs::directory_iterator(folder, ec)) {
      const std::string name = entry.path().filename().string();
      const std::string ext = entry.path().extension().string();
      if (ext == ".safetensors" || ext == ".bin" || ext == ".pt" || ext == ".pth") other.push_back(name);
    }
    std::sort(other.begin(), other.end());
    fail(kWhat, "no model.safetensors or model.safetensors.index.json in the folder",
         {got("folder", folder), got("weight_files", join(other))},
         "mlacp reads safetensors only: save the model with safetensors (transformers' save_pretrained does by default)");
  }
  if (has_single) {
    impl->files.push_back(read_safetensors_header(single));
    for (const auto& entry : impl->files[0].tensors) impl->file_of[entry.first] = 0;
  } else {
    open_sharded(*impl, index);
  }
  HfCheckpoint checkpoint;
  checkpoint.impl_ = std::move(impl);
  return checkpoint;
}

}  // namespace mlacp
