#include "model/safetensors.h"

#include <filesystem>
#include <fstream>
#include <optional>

#include <nlohmann/json.hpp>

#include "mlacp/errors.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors stores little-endian bytes; mlacp reads them as they are");

namespace mlacp {
namespace {

using nlohmann::json;
constexpr const char* kWhat = "safetensors";
constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // the safetensors library's own limit
constexpr const char* kTruncatedHint = "the file is truncated or not a safetensors file: download or write it again";
constexpr const char* kDequantiseHint =
    "dequantise to bf16 first, e.g. with DeepSeek's fp8_cast_bf16.py (DeepSeek-V3 repository, inference/), "
    "which also drops the weight_scale_inv block scales";
constexpr const char* kReadableDtypes = "F16, BF16, F32, F64 (and I8, U8, I16, I32, I64)";

struct DtypeInfo {
  const char* name;
  uint64_t bytes;
  std::optional<at::ScalarType> scalar;  // none: LibTorch here cannot hold it
};

// Every dtype of the safetensors format with a whole-byte element size.
const std::vector<DtypeInfo>& dtypes() {
  static const std::vector<DtypeInfo> table = {
      {"F64", 8, at::kDouble},  {"F32", 4, at::kFloat},   {"BF16", 2, at::kBFloat16}, {"F16", 2, at::kHalf},
      {"I64", 8, at::kLong},    {"I32", 4, at::kInt},     {"I16", 2, at::kShort},     {"I8", 1, at::kChar},
      {"U8", 1, at::kByte},     {"BOOL", 1, std::nullopt}, {"U16", 2, std::nullopt},   {"U32", 4, std::nullopt},
      {"U64", 8, std::nullopt}, {"F8_E4M3", 1, std::nullopt}, {"F8_E5M2", 1, std::nullopt},
      {"F8_E8M0", 1, std::nullopt}, {"C64", 8, std::nullopt}};
  return table;
}

const DtypeInfo* find_dtype(const std::string& name) {
  for (const DtypeInfo& d : dtypes())
    if (name == d.name) return &d;
  return nullptr;
}

bool is_fp8(const std::string& dtype) { return dtype.rfind("F8_", 0) == 0; }

// A JSON value as a non-negative integer (u64); nullopt when it is not one.
std::optional<uint64_t> as_u64(const json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0) return static_cast<uint64_t>(v.get<int64_t>());
  return std::nullopt;
}

std::string clip(const std::string& text, size_t limit = 200) {
  return text.size() <= limit ? text : text.substr(0, limit) + "...";
}

SafetensorsEntry parse_entry(const std::string& path, const std::string& name, const json& v, uint64_t data_start,
                             uint64_t data_size) {
  auto bad = [&](const std::string& rule, std::vector<ErrorValue> values) {
    std::vector<ErrorValue> all{got("file", path), got("tensor", name)};
    all.insert(all.end(), values.begin(), values.end());
    fail(kWhat, rule, std::move(all), "the header is malformed: write the file again (safetensors' save_file)");
  };
  if (!v.is_object()) bad("a tensor entry must be an object with dtype, shape and data_offsets", {got("entry", clip(v.dump()))});
  for (const char* key : {"dtype", "shape", "data_offsets"})
    if (!v.contains(key)) bad("a tensor entry lacks a required field", {got("field", key)});
  const json& dtype = v.at("dtype");
  const json& shape = v.at("shape");
  const json& offsets = v.at("data_offsets");
  if (!dtype.is_string()) bad("dtype must be a string", {got("dtype", clip(dtype.dump()))});
  if (!shape.is_array()) bad("shape must be an array of non-negative integers", {got("shape", clip(shape.dump()))});
  if (!offsets.is_array() || offsets.size() != 2 || !as_u64(offsets[0]) || !as_u64(offsets[1]))
    bad("data_offsets must be [begin, end], two non-negative integers", {got("data_offsets", clip(offsets.dump()))});
  SafetensorsEntry e;
  e.dtype = dtype.get<std::string>();
  uint64_t elements = 1;
  bool overflow = false;
  for (const json& d : shape) {
    const std::optional<uint64_t> n = as_u64(d);
    if (!n || *n > static_cast<uint64_t>(INT64_MAX)) bad("shape must be an array of non-negative integers", {got("shape", clip(shape.dump()))});
    e.shape.push_back(static_cast<int64_t>(*n));
    overflow = overflow || __builtin_mul_overflow(elements, *n, &elements);
  }
  const uint64_t begin = *as_u64(offsets[0]), end = *as_u64(offsets[1]);
  if (begin > end) bad("data_offsets must have begin <= end", {got("begin", begin), got("end", end)});
  if (end > data_size) {
    fail(kWhat, "the tensor's data_offsets lie outside the file",
         {got("file", path), got("tensor", name), got("begin", begin), got("end", end), got("data_bytes", data_size)},
         kTruncatedHint);
  }
  if (const DtypeInfo* info = find_dtype(e.dtype)) {
    uint64_t bytes = 0;
    overflow = overflow || __builtin_mul_overflow(elements, info->bytes, &bytes);
    if (overflow || bytes != end - begin) {
      std::vector<int64_t> dims(e.shape.begin(), e.shape.end());
      fail(kWhat, "the tensor's byte range does not match its shape and dtype",
           {got("file", path), got("tensor", name), got("dtype", e.dtype), got("shape", dims),
            got("expected_bytes", overflow ? std::string("overflow") : std::to_string(bytes)),
            got("data_offsets_bytes", end - begin)},
           "the header is inconsistent: write the file again (safetensors' save_file)");
    }
  }
  // Unknown dtypes (newer formats such as F4) are kept: the file opens, reading them is an error.
  e.begin = data_start + begin;
  e.end = data_start + end;
  return e;
}

}  // namespace

SafetensorsFile read_safetensors_header(const std::string& path) {
  std::error_code ec;
  MLACP_REQUIRE(std::filesystem::is_regular_file(path, ec), kWhat, "cannot open the file (not a regular file)",
                {got("file", path)}, "check the checkpoint folder");
  std::ifstream in(path, std::ios::binary);
  MLACP_REQUIRE(static_cast<bool>(in), kWhat, "cannot open the file", {got("file", path)},
                "check the file's permissions");
  SafetensorsFile file;
  file.path = path;
  file.file_size = std::filesystem::file_size(path, ec);
  MLACP_REQUIRE(!ec, kWhat, "cannot read the file's size", {got("file", path), got("cause", ec.message())},
                "check the checkpoint folder");
  MLACP_REQUIRE(file.file_size >= 8, kWhat, "the file is shorter than the 8-byte header length",
                {got("file", path), got("file_size", file.file_size)}, kTruncatedHint);
  unsigned char prefix[8];
  in.read(reinterpret_cast<char*>(prefix), 8);
  MLACP_REQUIRE(in.gcount() == 8, kWhat, "cannot read the 8-byte header length", {got("file", path)}, kTruncatedHint);
  uint64_t header_length = 0;
  for (int i = 7; i >= 0; --i) header_length = (header_length << 8) | prefix[i];
  MLACP_REQUIRE(header_length <= file.file_size - 8, kWhat, "the header length exceeds the file",
                {got("file", path), got("header_length", header_length), got("file_size", file.file_size)},
                kTruncatedHint);
  MLACP_REQUIRE(header_length <= kMaxHeaderBytes, kWhat, "the header is larger than 100 MB (safetensors' limit)",
                {got("file", path), got("header_length", header_length)}, kTruncatedHint);
  std::string text(header_length, '\0');
  in.read(text.data(), static_cast<std::streamsize>(header_length));
  MLACP_REQUIRE(static_cast<uint64_t>(in.gcount()) == header_length, kWhat, "cannot read the header",
                {got("file", path), got("header_length", header_length)}, kTruncatedHint);
  json header;
  try {
    header = json::parse(text);
  } catch (const json::parse_error& e) {
    throw Error(kWhat, "the header is not valid JSON", {got("file", path), got("parser", e.what())}, kTruncatedHint);
  }
  MLACP_REQUIRE(header.is_object(), kWhat, "the header must be a JSON object",
                {got("file", path), got("type", header.type_name())}, kTruncatedHint);
  const uint64_t data_start = 8 + header_length;
  const uint64_t data_size = file.file_size - data_start;
  for (const auto& item : header.items()) {
    if (item.key() == "__metadata__") {
      const json& m = item.value();
      bool strings = m.is_object();
      if (strings)
        for (const auto& kv : m.items()) strings = strings && kv.value().is_string();
      MLACP_REQUIRE(strings, kWhat, "__metadata__ must be an object of strings",
                    {got("file", path), got("__metadata__", clip(m.dump()))},
                    "the header is malformed: write the file again (safetensors' save_file)");
      for (const auto& kv : m.items()) file.metadata[kv.key()] = kv.value().get<std::string>();
      continue;
    }
    file.tensors.emplace(item.key(), parse_entry(path, item.key(), item.value(), data_start, data_size));
  }
  return file;
}

bool safetensors_dtype_readable(const std::string& dtype) {
  const DtypeInfo* info = find_dtype(dtype);
  return info && info->scalar;
}

void require_readable_dtype(const SafetensorsFile& file, const std::string& name) {
  const auto it = file.tensors.find(name);
  MLACP_REQUIRE(it != file.tensors.end(), kWhat, "no tensor of this name in the file",
                {got("file", file.path), got("tensor", name)}, "list the file's tensors to find its name");
  const std::string& dtype = it->second.dtype;
  if (safetensors_dtype_readable(dtype)) return;
  if (is_fp8(dtype)) {
    fail(kWhat, "fp8 weights are not supported", {got("file", file.path), got("tensor", name), got("dtype", dtype)},
         kDequantiseHint);
  }
  fail(kWhat, "unsupported tensor dtype", {got("file", file.path), got("tensor", name), got("dtype", dtype)},
       std::string("mlacp reads ") + kReadableDtypes + "; convert the checkpoint's tensors to bf16 or f32");
}

at::Tensor read_safetensors_tensor(const SafetensorsFile& file, const std::string& name) {
  require_readable_dtype(file, name);
  const SafetensorsEntry& e = file.tensors.at(name);
  const at::ScalarType scalar = *find_dtype(e.dtype)->scalar;
  at::Tensor tensor = at::empty(e.shape, at::TensorOptions().dtype(scalar));
  const uint64_t bytes = e.end - e.begin;
  if (bytes == 0) return tensor;
  std::ifstream in(file.path, std::ios::binary);
  MLACP_REQUIRE(static_cast<bool>(in), kWhat, "cannot open the file", {got("file", file.path), got("tensor", name)},
                "check the file's permissions");
  in.seekg(static_cast<std::streamoff>(e.begin));
  in.read(static_cast<char*>(tensor.data_ptr()), static_cast<std::streamsize>(bytes));
  MLACP_REQUIRE(in && static_cast<uint64_t>(in.gcount()) == bytes, kWhat,
                "the file ended before the tensor's bytes (it changed since it was opened?)",
                {got("file", file.path), got("tensor", name), got("begin", e.begin), got("end", e.end)},
                kTruncatedHint);
  return tensor;
}

std::string safetensors_dtype_name(at::ScalarType dtype) {
  for (const DtypeInfo& d : dtypes())
    if (d.scalar && *d.scalar == dtype) return d.name;
  fail(kWhat, "no safetensors dtype for this LibTorch dtype", {got("dtype", c10::toString(dtype))},
       "use float16, bfloat16, float32 or float64");
}

}  // namespace mlacp
