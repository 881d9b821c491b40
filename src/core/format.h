// Small text helpers shared by error messages, tables and JSON renderers (no tensors).
#pragma once

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace mlacp {

// "[2, 7, 12]" for a tensor's shape.
std::string shape_text(const at::Tensor& tensor);
std::string shape_text(at::IntArrayRef sizes);
// "float64", "bfloat16", ... (the names users type on the command line).
std::string dtype_name(at::ScalarType dtype);
// Parses the names above; throws mlacp::Error for anything else.
at::ScalarType parse_dtype(const std::string& name);

}  // namespace mlacp
