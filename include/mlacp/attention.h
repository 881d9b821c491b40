// MlaAttention: the single-device DeepSeek MLA layer (docs/DESIGN.md §1), parameters named as in
// DeepSeek-V3 checkpoints. mlacp::parallelize (mlacp/runtime.h) makes the same module run with
// context parallelism; the steps the runtime shares with it are private (src/model/mla_layer.h).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include "mlacp/config.h"
#include "mlacp/plan.h"

namespace mlacp {

// Per-call inputs of the forward. Every field is validated before any work (docs/DESIGN.md §6, §8).
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
  // The rotary embedding of the tokens as HuggingFace's rotary module returns it: (cos, sin), each
  // [B|1, S, Dr] = cat(freqs, freqs) with any magnitude applied. When given it replaces the
  // config's rope (theta, YaRN): the caller's rope type and precision are used as they are.
  std::optional<std::pair<at::Tensor, at::Tensor>> position_embeddings;
};

// The three normalised local latents of docs/DESIGN.md §4 (BSR layout).
struct LocalLatents {
  at::Tensor query_latent;  // [B, S, Rq] (RMS-normalised), or [B, S, d] without a q latent
  at::Tensor kv_latent;     // [B, S, Rkv] (RMS-normalised)
  at::Tensor key_rope_raw;  // [B, S, Dr] (not normalised, not yet rotated)
};

// Forward inputs after validation: what the attention core needs about positions and masks.
struct ResolvedForward {
  int64_t batch = 0;
  int64_t seq_len = 0;        // global sequence length S
  at::Tensor local_tokens;    // [S_l] int64 (CPU: host metadata): global token index of each local row
  bool causal = true;
  at::Tensor rope_positions;  // [B, S_l] int64 (document-relative when packed)
  at::Tensor rope_cos, rope_sin;  // [B|1, S_l, Dr/2] from position_embeddings, or undefined
  at::Tensor document_ends;   // [n_docs] int64 (CPU) global exclusive ends, or undefined
  at::Tensor mask;            // bool [B|1, 1, S, S], or undefined
};

class RmsNormImpl : public torch::nn::Module {
 public:
  RmsNormImpl(int64_t dim, double eps, const at::TensorOptions& options, bool always_float32 = false);
  // With a graph, the node keeps x only and recomputes the rest in the backward (same gradients).
  at::Tensor forward(const at::Tensor& x);
  // weight * x / rms(x) in at least float32 (HuggingFace's order with always_float32), no node.
  static at::Tensor normalise(const at::Tensor& x, const at::Tensor& weight, double eps, bool always_float32);
  at::Tensor weight;
  double eps;
  bool always_float32;  // MlaConfig::rms_norm_float32
};
TORCH_MODULE(RmsNorm);

class AttentionCore;  // src/model/mla_layer.h: what the parallel runtime installs
struct MlaLayer;      // src/model/mla_layer.h: the layer's steps, for the runtime

class MlaAttentionImpl : public torch::nn::Module {
 public:
  explicit MlaAttentionImpl(const MlaConfig& config,
                            const at::TensorOptions& options = at::TensorOptions().dtype(at::kFloat));

  // hidden: [B, S, d] -> [B, S, d]
  at::Tensor forward(const at::Tensor& hidden, const MlaForwardOptions& options = {});

  // Whether a context-parallel runtime is installed (mlacp::parallelize), and its description.
  bool is_parallel() const { return core_ != nullptr; }
  std::string parallel_description() const;

  // Tensor parallelism: keeps heads [tp_rank*H/tp, (tp_rank+1)*H/tp) of q_b_proj (q_proj),
  // kv_b_proj and o_gate_proj (rows) and o_proj (input columns); everything else stays
  // replicated. Call on every TP rank before installing CP. The parameters keep their names.
  void shard_heads_for_tp(int64_t tp_rank, int64_t tp_size);
  int64_t tp_size() const { return tp_size_; }
  // Whether a parameter (by name) is sharded over TP (each TP rank holds its own slice).
  static bool is_tp_sharded_parameter(const std::string& name);
  // Whether a parameter's gradient must NOT be summed over TP: the sharded ones, and o_proj.bias
  // (added after the TP sum of the row-parallel o_proj, so every TP rank already holds its whole
  // gradient). Every other parameter holds a partial gradient per TP rank.
  static bool skips_tp_reduction(const std::string& name);

  // Uses the given tensors as this module's parameters, by the names of named_parameters(): the
  // same tensor objects, no copy, so gradients accumulate where the caller holds them (e.g. the
  // nn.Parameters of a HuggingFace attention module). Every parameter must be given, with its
  // shape and one dtype and device for all; a name the module does not have is an error.
  // Also after parallelize() (with the installed device and dtype): a caller whose parameter
  // objects change between forwards (FSDP's gathered parameters, a custom op's inputs) adopts the
  // current ones before each forward.
  void adopt_parameters(const std::map<std::string, at::Tensor>& tensors);

  const MlaConfig& config() const { return config_; }
  // The kernel of the single-device path: blockwise (the fast one) unless set; `reference` (the
  // naive oracle, S x S scores) for checking. The CP runtime uses its plan's kernel instead.
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
  friend struct MlaLayer;
  torch::nn::Linear& query_up_projection();
  void validate_latents(const LocalLatents& latents) const;

  MlaConfig config_;
  int64_t local_heads_;
  int64_t tp_size_ = 1;
  AttentionKernel kernel_ = AttentionKernel::blockwise;
  std::shared_ptr<AttentionCore> core_;
  double scaling_;
  struct RopeState;
  std::shared_ptr<RopeState> rope_;
};
TORCH_MODULE(MlaAttention);

// The parameters an MlaAttention built from `config` registers (before TP sharding), in
// named_parameters() order: name ("q_a_proj.weight", ...) and shape. Computed from the config
// alone, without allocating the module (checkpoint readers check against it).
std::vector<std::pair<std::string, std::vector<int64_t>>> mla_parameter_shapes(const MlaConfig& config);

}  // namespace mlacp
