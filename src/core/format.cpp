#include "core/format.h"

#include "mlacp/errors.h"

namespace mlacp {

std::string shape_text(at::IntArrayRef sizes) {
  std::string text = "[";
  for (size_t i = 0; i < sizes.size(); ++i) text += (i ? ", " : "") + std::to_string(sizes[i]);
  return text + "]";
}

std::string shape_text(const at::Tensor& tensor) {
  return tensor.defined() ? shape_text(tensor.sizes()) : std::string("undefined");
}

std::string dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kDouble: return "float64";
    case at::kFloat: return "float32";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    case at::kBool: return "bool";
    default: return c10::toString(dtype);
  }
}

at::ScalarType parse_dtype(const std::string& name) {
  if (name == "float64" || name == "f64" || name == "double") return at::kDouble;
  if (name == "float32" || name == "f32" || name == "float") return at::kFloat;
  if (name == "bfloat16" || name == "bf16") return at::kBFloat16;
  throw Error("dtype", "must be one of float64, float32, bfloat16", {got("dtype", name)},
              "bfloat16 means float32 parameters under bf16 autocast");
}

}  // namespace mlacp
