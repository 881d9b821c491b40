// The safetensors file format, read with plain file I/O (no mmap):
//   8 bytes  little-endian u64 N: the header's length
//   N bytes  JSON object: name -> {"dtype": "BF16"|..., "shape": [...], "data_offsets": [begin, end]},
//            offsets relative to the first byte after the header; optional "__metadata__" (str -> str)
//   the tensors' bytes (little-endian, row-major)
// Owns: parsing and validating one file's header, reading one tensor's bytes into an at::Tensor of
// the stored dtype. Does not own: which files make a checkpoint (model/hf_checkpoint.cpp).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace mlacp {

struct SafetensorsEntry {
  std::string dtype;           // as stored: "F32", "BF16", "F8_E4M3", ... (unknown names kept as given)
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte range in the file (absolute: header already added)
};

struct SafetensorsFile {
  std::string path;
  uint64_t file_size = 0;
  std::map<std::string, SafetensorsEntry> tensors;
  std::map<std::string, std::string> metadata;  // "__metadata__"
};

// Reads and validates the header: the file holds at least the 8-byte length and the header, the
// header is a JSON object of well-formed entries, every entry's bytes lie inside the file and
// (for a known dtype) match shape x element size. Throws mlacp::Error naming the file, the tensor
// and the rule.
SafetensorsFile read_safetensors_header(const std::string& path);

// The tensor's bytes as an at::Tensor of its stored dtype (F16, BF16, F32, F64, I8, U8, I16, I32,
// I64). fp8 (F8_E4M3, F8_E5M2, ...) and other dtypes LibTorch cannot hold are an mlacp::Error
// naming the tensor and the way out.
at::Tensor read_safetensors_tensor(const SafetensorsFile& file, const std::string& name);

// Whether read_safetensors_tensor can read this dtype, and the error it would give otherwise.
bool safetensors_dtype_readable(const std::string& dtype);
void require_readable_dtype(const SafetensorsFile& file, const std::string& name);

// "F32" etc. for the dtypes read_safetensors_tensor reads (for writers and messages).
std::string safetensors_dtype_name(at::ScalarType dtype);

}  // namespace mlacp
