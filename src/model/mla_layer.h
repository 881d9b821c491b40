// The MLA layer's steps, for the parallel runtime, the checks and the tests (not public API):
// MlaAttention::forward is compute_latents -> attention core -> project_output, and a CP
// schedule runs the same steps on its own tokens. Users see only forward, config, parameters
// and TP sharding (include/mlacp/attention.h).
//
//   compute_latents  (down projections + RMSNorm)      -> LocalLatents
//   attention core   (up projections, RoPE, attention) -> [B, S, H*Dv]
//   project_output   (optional gate, o_proj)           -> [B, S, d]
#pragma once

#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "kernels/rope.h"
#include "mlacp/attention.h"

namespace mlacp {

// A replacement for the single-device path of MlaAttention::forward, installed once (the
// context-parallel runtime is one). It receives the module so it uses the module's own
// parameters: installing a core never copies or re-creates them.
class AttentionCore {
 public:
  virtual ~AttentionCore() = default;
  virtual at::Tensor forward(MlaAttentionImpl& module, const at::Tensor& hidden, const MlaForwardOptions& options) = 0;
  virtual std::string describe() const = 0;
};

struct MlaLayer {
  static ResolvedForward resolve(const MlaAttentionImpl& m, const at::Tensor& hidden, const MlaForwardOptions& options);
  // The input is on the module's device (an mlacp error before any work, not LibTorch's).
  static void check_device(const MlaAttentionImpl& m, const at::Tensor& hidden);
  static LocalLatents compute_latents(MlaAttentionImpl& m, const at::Tensor& hidden);
  // [B, S, Rq|d] -> [B, S, H, Dqk], RoPE applied to the last Dr lanes
  static at::Tensor expand_query(MlaAttentionImpl& m, const at::Tensor& query_latent, const RopeTable& rope);
  // The rotation of the resolved tokens: the caller's position_embeddings, or the config's rope
  // at the resolved positions. Computed once per forward, used for queries and keys.
  static RopeTable rope_table(const MlaAttentionImpl& m, const ResolvedForward& r);
  static RopeTable rope_table(const MlaAttentionImpl& m, const at::Tensor& positions);  // [B, S] int64
  // The parameters expand_query reads (q_b_proj or q_proj: weight, bias if any).
  static std::vector<at::Tensor> query_parameters(MlaAttentionImpl& m);
  // [B, S, Dr] -> [B, S, Dr] rotated (one key head shared by all heads)
  static at::Tensor rotate_key(const at::Tensor& key_rope_raw, const RopeTable& rope);
  // kv_b_proj's rows of heads [head_begin, head_end) (weight, bias: views of the parameters, so
  // their gradient lands in those rows only).
  static std::pair<at::Tensor, at::Tensor> kv_up_rows(MlaAttentionImpl& m, int64_t head_begin, int64_t head_end);
  // kv_b_proj's parameters (weight, bias if any).
  static std::vector<at::Tensor> kv_parameters(MlaAttentionImpl& m);
  // projected [B, S, h*(Dn+Dv)] and the rotated key rope [B, S, Dr] -> key [B, S, h, Dqk],
  // value [B, S, h, Dv] (the rope lanes shared by every head).
  static std::pair<at::Tensor, at::Tensor> assemble_key_value(const MlaAttentionImpl& m, const at::Tensor& projected,
                                                              const at::Tensor& key_rope);
  // projected [B, S, h*(Dn+Dv)] -> key_nope [B, S, h, Dn], value [B, S, h, Dv].
  static std::pair<at::Tensor, at::Tensor> split_key_value(const MlaAttentionImpl& m, const at::Tensor& projected);
  // key_nope [B, S, h, Dn] and the rotated key rope [B, S, Dr] -> key [B, S, h, Dqk].
  static at::Tensor assemble_key(const at::Tensor& key_nope, const at::Tensor& key_rope);
  // kv_latent [B, S, Rkv], rotated key rope [B, S, Dr], heads [head_begin, head_end) -> key, value.
  static std::pair<at::Tensor, at::Tensor> expand_key_value(MlaAttentionImpl& m, const at::Tensor& kv_latent,
                                                            const at::Tensor& key_rope, int64_t head_begin,
                                                            int64_t head_end);
  // The single-device attention core on the module's kernel -> [B, S, H*Dv].
  static at::Tensor single_device_core(MlaAttentionImpl& m, const LocalLatents& latents, const ResolvedForward& r);
  // sigmoid(o_gate_proj(hidden)) [B, S, H*Dv], and the parameters it reads.
  static at::Tensor gate(MlaAttentionImpl& m, const at::Tensor& hidden);
  static std::vector<at::Tensor> gate_parameters(MlaAttentionImpl& m);
  // attention [B, S, H*Dv], hidden [B, S, d] (for the gate) -> [B, S, d]. With TP the projection
  // is row-parallel: `reduce_partial` sums the bias-free partial outputs over TP, and the bias is
  // added once after it.
  static at::Tensor project_output(MlaAttentionImpl& m, const at::Tensor& attention, const at::Tensor& hidden,
                                   const std::function<at::Tensor(const at::Tensor&)>& reduce_partial = nullptr);
  // Installs a core (once; a second install is an error) / the installed one, or null.
  static void install_core(MlaAttentionImpl& m, std::shared_ptr<AttentionCore> core);
  static const AttentionCore* installed_core(const MlaAttentionImpl& m);
};

}  // namespace mlacp
