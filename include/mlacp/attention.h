// MlaAttention: the single-device DeepSeek MLA layer (SPEC §1), parameters named as in
// DeepSeek-V3 checkpoints. Its forward is split at the seam the parallel runtime uses:
//   compute_latents  (down projections + RMSNorm)      -> LocalLatents
//   attention core   (up projections, RoPE, attention) -> [B, S, H*Dv]
//   project_output   (optional gate, o_proj)           -> [B, S, d]
// Later layers replace only the core.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include "mlacp/config.h"
#include "mlacp/plan.h"

namespace mlacp {

// Per-call inputs of the forward. Every field is validated before any work (SPEC §6, §8).
struct MlaForwardOptions {
  at::Tensor position_ids;                            // [B, S] or [S] integer; default: 0..S-1
                                                      // (document-relative when packed)
  std::optional<std::vector<int64_t>> document_ends;  // packed: global document ends (cu_seqlens,
                                                      // with or without the leading 0); batch 1
  std::optional<std::vector<int64_t>> document_lengths;   // alternative to document_ends
  std::optional<std::vector<int64_t>> key_document_ends;  // must equal the query's (FA-style callers)
  std::optional<bool> is_causal;                      // default: MlaConfig::causal
  at::Tensor attention_mask;                          // bool [S, S] or [B|1, 1, S, S], True = allowed
  double dropout = 0.0;                               // must be 0 in training
  bool use_cache = false;                             // KV cache: not supported, rejected
  bool output_attentions = false;                     // attention weights: not supported, rejected
};

// The three normalised local latents of SPEC §4 (BSR layout).
struct LocalLatents {
  at::Tensor query_latent;  // [B, S, Rq] (RMS-normalised), or [B, S, d] without a q latent
  at::Tensor kv_latent;     // [B, S, Rkv] (RMS-normalised)
  at::Tensor key_rope_raw;  // [B, S, Dr] (not normalised, not yet rotated)
};

// Forward inputs after validation: what the attention core needs about positions and masks.
struct ResolvedForward {
  int64_t batch = 0;
  int64_t seq_len = 0;        // global sequence length S
  at::Tensor local_tokens;    // [S_l] int64: global token index of each local row
  bool causal = true;
  at::Tensor rope_positions;  // [B, S_l] int64 (document-relative when packed)
  at::Tensor document_ends;   // [n_docs] int64 global exclusive ends, or undefined
  at::Tensor mask;            // bool [B|1, 1, S, S], or undefined
};

class RmsNormImpl : public torch::nn::Module {
 public:
  RmsNormImpl(int64_t dim, double eps, const at::TensorOptions& options);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;
  double eps;
};
TORCH_MODULE(RmsNorm);

class MlaAttentionImpl;

// A replacement for the single-device path of MlaAttention::forward, installed once (the
// context-parallel runtime is one). It receives the module so it uses the module's own
// parameters: installing a core never copies or re-creates them.
class AttentionCore {
 public:
  virtual ~AttentionCore() = default;
  virtual at::Tensor forward(MlaAttentionImpl& module, const at::Tensor& hidden, const MlaForwardOptions& options) = 0;
  virtual std::string describe() const = 0;
};

class MlaAttentionImpl : public torch::nn::Module {
 public:
  explicit MlaAttentionImpl(const MlaConfig& config,
                            const at::TensorOptions& options = at::TensorOptions().dtype(at::kFloat));

  // hidden: [B, S, d] -> [B, S, d]
  at::Tensor forward(const at::Tensor& hidden, const MlaForwardOptions& options = {});

  // --- the seam (used by the parallel runtime and by tests) ---
  ResolvedForward resolve(const at::Tensor& hidden, const MlaForwardOptions& options) const;
  LocalLatents compute_latents(const at::Tensor& hidden);
  // [B, S, Rq|d] -> [B, S, H, Dqk], RoPE applied to the last Dr lanes
  at::Tensor expand_query(const at::Tensor& query_latent, const at::Tensor& rope_positions);
  // [B, S, Dr] -> [B, S, Dr] rotated (one key head shared by all heads)
  at::Tensor rotate_key(const at::Tensor& key_rope_raw, const at::Tensor& rope_positions) const;
  // kv_latent [B, S, Rkv], rotated key rope [B, S, Dr], heads [head_begin, head_end) ->
  // key [B, S, h, Dqk], value [B, S, h, Dv]. Only those rows of kv_b_proj are read, so their
  // gradient lands in those rows and nowhere else.
  std::pair<at::Tensor, at::Tensor> expand_key_value(const at::Tensor& kv_latent, const at::Tensor& key_rope,
                                                     int64_t head_begin, int64_t head_end);
  // The two halves of expand_key_value, for schedules that run the projection themselves:
  // kv_b_proj's rows of heads [head_begin, head_end) (weight, bias: views of the parameters) ...
  std::pair<at::Tensor, at::Tensor> kv_up_rows(int64_t head_begin, int64_t head_end);
  // ... and the assembly of projected [B, S, h*(Dn+Dv)] with the rotated key rope [B, S, Dr].
  std::pair<at::Tensor, at::Tensor> assemble_key_value(const at::Tensor& projected, const at::Tensor& key_rope) const;
  // The single-device attention core on the naive reference kernel -> [B, S, H*Dv].
  at::Tensor reference_core(const LocalLatents& latents, const ResolvedForward& resolved);
  // attention [B, S, H*Dv], hidden [B, S, d] (for the gate) -> [B, S, d]. With TP the
  // projection is row-parallel: `reduce_partial` sums the bias-free partial outputs over TP, and
  // the bias is added once after it.
  at::Tensor project_output(const at::Tensor& attention, const at::Tensor& hidden,
                            const std::function<at::Tensor(const at::Tensor&)>& reduce_partial = nullptr);

  // Installs a core (once; a second install is an error) / the installed one, or null.
  void install_core(std::shared_ptr<AttentionCore> core);
  AttentionCore* core() const { return core_.get(); }

  // Tensor parallelism: keeps heads [tp_rank*H/tp, (tp_rank+1)*H/tp) of q_b_proj (q_proj),
  // kv_b_proj and o_gate_proj (rows) and o_proj (input columns); everything else stays
  // replicated. Call on every TP rank before installing CP. The parameters keep their names.
  void shard_heads_for_tp(int64_t tp_rank, int64_t tp_size);
  int64_t tp_size() const { return tp_size_; }
  // Whether a parameter (by name) is sharded over TP (its gradient is not summed over TP).
  static bool is_tp_sharded_parameter(const std::string& name);

  const MlaConfig& config() const { return config_; }
  // The kernel of the single-device core: naive (the oracle) unless set; the CP runtime uses its
  // plan's kernel instead.
  void set_attention_kernel(AttentionKernel kernel) { kernel_ = kernel; }
  AttentionKernel attention_kernel() const { return kernel_; }
  int64_t local_heads() const { return local_heads_; }
  double scaling() const { return scaling_; }

  // Submodules, named as in DeepSeek-V3 checkpoints. Unused ones are empty holders.
  torch::nn::Linear q_a_proj{nullptr};
  RmsNorm q_a_layernorm{nullptr};
  torch::nn::Linear q_b_proj{nullptr};
  torch::nn::Linear q_proj{nullptr};  // only without a q latent (DeepSeek-V2-Lite)
  torch::nn::Linear kv_a_proj_with_mqa{nullptr};
  RmsNorm kv_a_layernorm{nullptr};
  torch::nn::Linear kv_b_proj{nullptr};
  torch::nn::Linear o_proj{nullptr};
  torch::nn::Linear o_gate_proj{nullptr};  // only with output_gate

 private:
  torch::nn::Linear& query_up_projection();
  void validate_latents(const LocalLatents& latents) const;

  MlaConfig config_;
  int64_t local_heads_;
  int64_t tp_size_ = 1;
  AttentionKernel kernel_ = AttentionKernel::naive;
  std::shared_ptr<AttentionCore> core_;
  double scaling_;
  struct RopeState;
  std::shared_ptr<RopeState> rope_;
};
TORCH_MODULE(MlaAttention);

}  // namespace mlacp
