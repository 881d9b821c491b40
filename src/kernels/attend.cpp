#include "kernels/attend.h"

#include "kernels/blockwise_attention.h"
#include "kernels/piece_attention.h"

namespace mlacp {

at::Tensor attend(AttentionKernel kernel, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  double scaling, const AttentionStructure& structure) {
  if (kernel == AttentionKernel::reference) return reference_attention(q, k, v, scaling, structure);
  // The blockwise kernel is the CPU's; any other device takes the varlen pieces (docs/DESIGN.md §16).
  // device: the blockwise kernel is the CPU's; other devices take the varlen pieces
  if (kernel == AttentionKernel::pieces || !q.device().is_cpu()) return piece_attention(q, k, v, scaling, structure);
  return blockwise_attention(q, k, v, scaling, structure);
}

}  // namespace mlacp
