// The context-parallel attention core (docs/DESIGN.md §4): the MLA layer's attention core
// replaced on one module by parallelize(). It validates a forward's inputs before the first
// collective, builds this rank's local step (latents, rotated key rope, the attention's row
// structure) and hands it to the schedule chosen for the plan when it was installed.
#pragma once

#include <memory>

#include "mlacp/comm.h"
#include "mlacp/plan.h"
#include "model/mla_layer.h"
#include "runtime/schedule.h"

namespace mlacp {

class CpAttentionCore : public AttentionCore {
 public:
  CpAttentionCore(CpPlan plan, ParallelGroups groups, const MlaConfig& config, c10::DeviceType device);
  at::Tensor forward(MlaAttentionImpl& module, const at::Tensor& hidden, const MlaForwardOptions& options) override;
  std::string describe() const override;
  const CpPlan& plan() const { return plan_; }

 private:
  CpPlan plan_;
  ParallelGroups groups_;
  std::unique_ptr<CpSchedule> schedule_;
};

}  // namespace mlacp
