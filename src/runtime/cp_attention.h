// The context-parallel attention core (SPEC §4): validation, the plain schedule of both
// strategies and their hybrids, and the output restore. Installed on an MlaAttention by
// install_context_parallel().
#pragma once

#include "mlacp/attention.h"
#include "mlacp/comm.h"
#include "mlacp/plan.h"
#include "runtime/overlap_schedule.h"

namespace mlacp {

class CpAttentionCore : public AttentionCore {
 public:
  CpAttentionCore(CpPlan plan, ParallelGroups groups);
  at::Tensor forward(MlaAttentionImpl& module, const at::Tensor& hidden, const MlaForwardOptions& options) override;
  std::string describe() const override;
  const CpPlan& plan() const { return plan_; }
  const ParallelGroups& groups() const { return groups_; }

 private:
  // Query/key rows of this rank's attention: the Ulysses block's tokens and all tokens.
  struct Rows {
    at::Tensor query_tokens;  // [U*S_l] global token indices in exchange order
    at::Tensor key_tokens;    // [S] global token indices in gather order
  };
  Rows rows_for(int64_t seq_len, const at::Device& device) const;
  ScheduledInputs expanded_inputs(MlaAttentionImpl& m, const LocalLatents& latents, const at::Tensor& query,
                                  const at::Tensor& key_rope);
  ScheduledInputs latent_inputs(const ScheduleContext& ctx, const LocalLatents& latents, const at::Tensor& query,
                                const at::Tensor& key_rope);
  at::Tensor restore_output(const at::Tensor& attention, int64_t batch, int64_t local_len);

  CpPlan plan_;
  ParallelGroups groups_;
};

}  // namespace mlacp
