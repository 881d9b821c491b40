// Test helper: writes safetensors files and HuggingFace checkpoint folders, independently of
// mlacp's reader (its own dtype table and layout), so tests can also write broken ones.
//   file = 8-byte little-endian header length N, N bytes of JSON header, the tensors' bytes
#pragma once

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

namespace mlacp::test {

struct RawTensor {
  std::string name;
  std::string dtype;  // "F32", "BF16", "F8_E4M3", ... (written as given)
  std::vector<int64_t> shape;
  std::string bytes;  // little-endian, row-major
};

inline std::string safetensors_dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return "F64";
    case at::kFloat: return "F32";
    case at::kBFloat16: return "BF16";
    case at::kHalf: return "F16";
    case at::kLong: return "I64";
    case at::kInt: return "I32";
    default: throw std::runtime_error("safetensors_writer: no safetensors dtype for this tensor");
  }
}

inline RawTensor raw_tensor(const std::string& name, const at::Tensor& tensor) {
  const at::Tensor t = tensor.contiguous();
  RawTensor raw{name, safetensors_dtype_of(t.scalar_type()), t.sizes().vec(), {}};
  raw.bytes.assign(static_cast<const char*>(t.data_ptr()), t.numel() * t.element_size());
  return raw;
}

// 8-byte length + header text + data, as they are (for broken files).
inline std::string safetensors_file_bytes(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

// The header JSON of `tensors` laid out one after another (as safetensors' save_file does, the
// header padded with spaces to a multiple of 8 bytes).
inline std::string safetensors_header(const std::vector<RawTensor>& tensors,
                                      const std::map<std::string, std::string>& metadata = {}) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const RawTensor& t : tensors) {
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string text = header.dump();
  while ((8 + text.size()) % 8 != 0) text += ' ';
  return text;
}

inline std::string safetensors_bytes(const std::vector<RawTensor>& tensors,
                                     const std::map<std::string, std::string>& metadata = {}) {
  std::string data;
  for (const RawTensor& t : tensors) data += t.bytes;
  return safetensors_file_bytes(safetensors_header(tensors, metadata), data);
}

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw std::runtime_error("safetensors_writer: cannot write " + path);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline std::vector<RawTensor> raw_tensors(const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  std::vector<RawTensor> raws;
  for (const auto& [name, t] : tensors) raws.push_back(raw_tensor(name, t));
  return raws;
}

// A HuggingFace checkpoint folder: config.json and the tensors in one model.safetensors
// (shards == 1) or in `shards` files model-0000i-of-0000N.safetensors (tensors dealt out in
// turn) with model.safetensors.index.json. The folder is created (emptied first).
inline void write_hf_checkpoint(const std::string& folder, const std::string& config_json,
                                const std::vector<RawTensor>& tensors, int shards = 1) {
  std::filesystem::remove_all(folder);
  std::filesystem::create_directories(folder);
  write_bytes(folder + "/config.json", config_json);
  if (shards <= 1) {
    write_bytes(folder + "/model.safetensors", safetensors_bytes(tensors, {{"format", "pt"}}));
    return;
  }
  auto shard_name = [&](int i) {
    char name[64];
    std::snprintf(name, sizeof(name), "model-%05d-of-%05d.safetensors", i + 1, shards);
    return std::string(name);
  };
  std::vector<std::vector<RawTensor>> parts(shards);
  nlohmann::json weight_map = nlohmann::json::object();
  uint64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    parts[i % shards].push_back(tensors[i]);
    weight_map[tensors[i].name] = shard_name(static_cast<int>(i % shards));
    total += tensors[i].bytes.size();
  }
  for (int i = 0; i < shards; ++i)
    write_bytes(folder + "/" + shard_name(i), safetensors_bytes(parts[i], {{"format", "pt"}}));
  const nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  write_bytes(folder + "/model.safetensors.index.json", index.dump(2));
}

}  // namespace mlacp::test
