// The schedule chosen for a plan, and the names of the transfers.
#include "runtime/schedule.h"

#include "mlacp/errors.h"

namespace mlacp {

// Defined next to each schedule (one file per strategy).
std::unique_ptr<CpSchedule> make_expanded_ulysses_schedule(bool overlap, bool gate);
std::unique_ptr<CpSchedule> make_expanded_hybrid_schedule(bool overlap, bool ulysses);
std::unique_ptr<CpSchedule> make_latent_schedule(bool overlap, bool ulysses, bool own_rows);

std::unique_ptr<CpSchedule> make_schedule(const CpPlan& plan, const MlaConfig& config) {
  const bool overlap = plan.overlap() && plan.cp() > 1;
  if (plan.strategy() == CpStrategy::latent_kv_head) return make_latent_schedule(overlap, plan.ulysses() > 1, plan.kernel() == AttentionKernel::blockwise);
  if (plan.all_gather() == 1) return make_expanded_ulysses_schedule(overlap, config.output_gate);
  return make_expanded_hybrid_schedule(overlap, plan.ulysses() > 1);
}

std::vector<OverlappedTransfer> overlapped_transfers(const CpPlan& plan, const MlaConfig& config) {
  return make_schedule(plan, config)->overlapped_transfers();
}

std::string transfer_name(Transfer t) {
  switch (t) {
    case Transfer::q: return "q";
    case Transfer::k: return "k";
    case Transfer::v: return "v";
    case Transfer::qkv: return "qkv";
    case Transfer::kv: return "kv";
    case Transfer::kv_gather: return "kv_gather";
    case Transfer::latent: return "latent";
    case Transfer::o: return "o";
    case Transfer::dq: return "dq";
    case Transfer::dk: return "dk";
    case Transfer::dv: return "dv";
    case Transfer::dqkv: return "dqkv";
    case Transfer::dkv: return "dkv";
    case Transfer::dkv_gather: return "dkv_gather";
    case Transfer::dlatent: return "dlatent";
    case Transfer::d_o: return "dO";
  }
  return "?";
}

Transfer gradient_of(Transfer t) {
  switch (t) {
    case Transfer::q: return Transfer::dq;
    case Transfer::k: return Transfer::dk;
    case Transfer::v: return Transfer::dv;
    case Transfer::qkv: return Transfer::dqkv;
    case Transfer::kv: return Transfer::dkv;
    case Transfer::kv_gather: return Transfer::dkv_gather;
    case Transfer::latent: return Transfer::dlatent;
    case Transfer::o: return Transfer::d_o;
    default: break;
  }
  MLACP_REQUIRE(false, "transfers", "a gradient transfer has no gradient of its own", {got("transfer", transfer_name(t))},
                "pass a forward transfer");
  return t;
}

}  // namespace mlacp
