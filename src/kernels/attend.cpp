#include "kernels/attend.h"

#include "kernels/blockwise_attention.h"

namespace mlacp {

at::Tensor attend(AttentionKernel kernel, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  double scaling, const AttentionStructure& structure) {
  if (kernel == AttentionKernel::reference) return reference_attention(q, k, v, scaling, structure);
  return blockwise_attention(q, k, v, scaling, structure);
}

}  // namespace mlacp
