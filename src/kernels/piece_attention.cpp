#include "kernels/piece_attention.h"

#include <limits>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "core/autograd_node.h"
#include "core/compat.h"
#include "core/device.h"
#include "mlacp/errors.h"

namespace mlacp {
namespace {

constexpr const char* kWhat = "piece attention";
constexpr double kInf = std::numeric_limits<double>::infinity();
// The additive bias of a pair the mask forbids: exp(score + bias − max) is exactly 0 for any pair of
// a row that has an allowed key: -1e30 in float32 and bf16 (both reach 3.4e38); float16 reaches
// only 65504, so there it is -30000 (still far below any score, and finite: a row with no allowed
// key stays finite before it is zeroed).
double forbidden_bias(at::ScalarType dtype) { return dtype == at::kHalf ? -3e4 : -1e30; }

// The masked path's additive bias [B|1, 1, Sq, Sk]: 0 where allowed, forbidden_bias where not, and
// 0 over the whole row of a query with no allowed key: the kernel sees an ordinary row (its output
// and gradient are zeroed outside), never a row masked entirely (the CUDA kernels' backward made
// NaN of such rows in bf16 on an H200).
at::Tensor dense_bias(const at::Tensor& allowed, const at::Tensor& alive_row, const at::Tensor& like) {
  return at::zeros(allowed.sizes(), like.options())
      .masked_fill_(allowed.logical_not().logical_and_(alive_row), forbidden_bias(like.scalar_type()));
}

at::ScalarType accumulate_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// [B,H,S,D] -> [B*S, H, D] (a view where the memory is [B,S,H,D], as the runtime's tensors are)
at::Tensor rows_of(const at::Tensor& x) { return x.transpose(1, 2).reshape({x.size(0) * x.size(2), x.size(1), x.size(3)}); }

// The group repeated over the batch: rows b*S + r, pieces of every batch element one after another.
PieceGroup batched(const PieceGroup& g, int64_t batch, int64_t sq, int64_t sk) {
  if (batch == 1) return g;
  PieceGroup out;
  out.causal = g.causal;
  out.max_query = g.max_query;
  out.max_key = g.max_key;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t r : g.query_rows) out.query_rows.push_back(b * sq + r);
    for (int64_t r : g.key_rows) out.key_rows.push_back(b * sk + r);
    const int64_t q0 = out.cu_query.back(), k0 = out.cu_key.back();
    for (int64_t p = 1; p <= g.pieces(); ++p) {
      out.cu_query.push_back(q0 + g.cu_query[p]);
      out.cu_key.push_back(k0 + g.cu_key[p]);
    }
  }
  return out;
}

struct DeviceGroup {
  PieceGroup group;
  at::Tensor query_index, key_index;  // on the tensors' device
  std::vector<at::Tensor> state;      // the kernel's forward state for its backward
};

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionStructure& st) {
  MLACP_REQUIRE(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, kWhat, "q, k, v must be [B, H, S, D]",
                {got("q.dim", q.dim()), got("k.dim", k.dim()), got("v.dim", v.dim())}, "pass 4-D tensors");
  MLACP_REQUIRE(q.device() == k.device() && q.device() == v.device(), kWhat, "q, k, v must be on one device",
                {got("q", q.device()), got("k", k.device()), got("v", v.device())}, "move them to one device");
  MLACP_REQUIRE(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), kWhat,
                "q, k, v must have one dtype", {got("q", q.scalar_type()), got("k", k.scalar_type()), got("v", v.scalar_type())},
                "cast them to one dtype");
  MLACP_REQUIRE(k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(1) == q.size(1) && v.size(1) == q.size(1) &&
                    k.size(3) == q.size(3) && v.size(2) == k.size(2),
                kWhat, "shapes must be q [B,H,Sq,Dqk], k [B,H,Sk,Dqk], v [B,H,Sk,Dv]",
                {got("q", q.sizes()), got("k", k.sizes()), got("v", v.sizes())}, "check the layouts");
  MLACP_REQUIRE(st.query_token_index.defined() && st.key_token_index.defined() &&
                    st.query_token_index.numel() == q.size(2) && st.key_token_index.numel() == k.size(2),
                kWhat, "the structure must describe every query and key row",
                {got("Sq", q.size(2)), got("Sk", k.size(2)),
                 got("query_token_index", st.query_token_index.defined() ? st.query_token_index.numel() : -1),
                 got("key_token_index", st.key_token_index.defined() ? st.key_token_index.numel() : -1)},
                "give one global token index per row");
}

at::Tensor masked_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scaling,
                            const AttentionStructure& st, const VarlenKernel& kernel) {
  const c10::Device device = q.device();
  at::Tensor allowed = allowed_pairs(st).to(device);  // [B|1, 1, Sq, Sk], built on the mask's device
  const int64_t mb = allowed.size(0), sq = q.size(2);
  const at::Tensor alive_row = allowed.any(-1, /*keepdim=*/true);  // [B|1, 1, Sq, 1] bool
  const at::Tensor alive = alive_row.view({mb, sq, 1, 1});           // [B|1, Sq, 1, 1], the output's layout
  // [B, S, H, D] contiguous (the fused kernels' row strides)
  DenseCall call{q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(),
                 at::Tensor(), scaling};
  call.bias = dense_bias(allowed, alive_row, q);
  PieceResult r;
  {
    at::NoGradGuard no_grad;
    r = kernel.dense_forward(call);
  }
  // Rows with no allowed key: exactly 0 (where, not a product: nothing of theirs can leak through)
  at::Tensor out = at::where(alive, r.out, at::zeros({}, r.out.options())).contiguous().transpose(1, 2);
  auto saved = std::make_shared<SavedForBackward>(std::vector<at::Tensor>{q, k, v}, std::vector<std::string>{"q", "k", "v"});
  const at::ScalarType dtype = q.scalar_type();
  return attach_backward({q, k, v}, {out}, "PieceAttentionMaskedBackward",
                         [saved, call, r, alive, &kernel, dtype](std::vector<at::Tensor> grads) {
                           saved->check(kWhat);
                           at::Tensor dout = at::where(alive, grads[0].transpose(1, 2).to(dtype),
                                                       at::zeros({}, grads[0].options().dtype(dtype)));
                           PieceGrads g = kernel.dense_backward(call, r.out, r.lse, dout, r.state);
                           return std::vector<at::Tensor>{g.dq.to(dtype).transpose(1, 2), g.dk.to(dtype).transpose(1, 2),
                                                          g.dv.to(dtype).transpose(1, 2)};
                         })[0];
}

}  // namespace

at::Tensor piece_attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, double scaling,
                           const AttentionStructure& st, const VarlenKernel* kernel_or_null, PieceStats* stats) {
  check_inputs(q_in, k_in, v_in, st);
  at::Tensor q = q_in, k = k_in, v = v_in;
  // Under autocast float32 inputs run in the autocast dtype (as a GEMM would); inside, autocast is
  // off, so every kernel computes in the dtype it was given.
  const c10::DeviceType device_type = q.device().type();
  if (q.scalar_type() == at::kFloat && compat::autocast_enabled(device_type)) {
    const at::ScalarType low = compat::autocast_dtype(device_type);
    q = q.to(low), k = k.to(low), v = v.to(low);
  }
  const compat::AutocastGuard no_autocast(device_type, false, compat::autocast_dtype(device_type));
  const VarlenKernel& kernel = kernel_or_null ? *kernel_or_null : varlen_kernel_for(q.device(), q.scalar_type());
  if (stats) *stats = PieceStats{kernel.name(), st.mask.defined(), 0, 0, true};
  if (st.mask.defined()) return masked_attention(q, k, v, scaling, st, kernel);

  const PiecePlan plan = plan_pieces(st);
  const int64_t b = q.size(0), h = q.size(1), sq = q.size(2), sk = k.size(2), dqk = q.size(3), dv = v.size(3);
  const at::ScalarType dtype = q.scalar_type(), acc = accumulate_type(dtype);
  const c10::Device device = q.device();
  auto groups = std::make_shared<std::vector<DeviceGroup>>();
  for (const PieceGroup& g : plan.groups) {
    DeviceGroup d{batched(g, b, sq, sk), {}, {}, {}};
    d.query_index = host_to_device(at::tensor(d.group.query_rows, at::kLong), device);
    d.key_index = host_to_device(at::tensor(d.group.key_rows, at::kLong), device);
    groups->push_back(std::move(d));
    if (stats) stats->pieces += groups->back().group.pieces();
  }
  if (stats) {
    stats->groups = static_cast<int64_t>(groups->size());
    stats->each_row_once = plan.each_row_once;
  }
  auto call_of = [scaling](const DeviceGroup& d, const at::Tensor& qr, const at::Tensor& kr, const at::Tensor& vr) {
    return VarlenCall{qr.index_select(0, d.query_index), kr.index_select(0, d.key_index),
                      vr.index_select(0, d.key_index), &d.group, scaling};
  };

  at::Tensor out_rows, lse;  // [B*Sq, H, Dv] in dtype, [B*Sq, H] in acc
  {
    at::NoGradGuard no_grad;
    const at::Tensor qr = rows_of(q), kr = rows_of(k), vr = rows_of(v);
    at::Tensor out_acc = at::zeros({b * sq, h, dv}, q.options().dtype(acc));
    lse = at::full({b * sq, h}, -kInf, q.options().dtype(acc));
    std::vector<PieceResult> results;
    for (DeviceGroup& d : *groups) {
      results.push_back(kernel.forward(call_of(d, qr, kr, vr)));
      d.state = results.back().state;
    }
    // A row in several pieces: its k-th piece goes to layer k (each layer holds a row at most once),
    // layers combine as out = Σ exp(lse_k − lse) out_k, lse = log Σ exp(lse_k).
    std::vector<int64_t> seen(b * sq, 0);
    std::vector<std::vector<int64_t>> layer_position, layer_row;
    int64_t offset = 0;
    for (const DeviceGroup& d : *groups) {
      for (size_t j = 0; j < d.group.query_rows.size(); ++j) {
        const int64_t row = d.group.query_rows[j], layer = seen[row]++;
        if (layer == static_cast<int64_t>(layer_row.size())) layer_position.emplace_back(), layer_row.emplace_back();
        layer_position[layer].push_back(offset + static_cast<int64_t>(j));
        layer_row[layer].push_back(row);
      }
      offset += static_cast<int64_t>(d.group.query_rows.size());
    }
    std::vector<at::Tensor> outs, lses;
    for (const PieceResult& r : results) outs.push_back(r.out.to(acc)), lses.push_back(r.lse.to(acc));
    const at::Tensor out_all = at::cat(outs), lse_all = at::cat(lses);
    for (size_t layer = 0; layer < layer_row.size(); ++layer) {
      const at::Tensor position = host_to_device(at::tensor(layer_position[layer], at::kLong), device);
      const at::Tensor row = host_to_device(at::tensor(layer_row[layer], at::kLong), device);
      if (layer == 0) {
        out_acc.index_copy_(0, row, out_all.index_select(0, position));
        lse.index_copy_(0, row, lse_all.index_select(0, position));
        continue;
      }
      at::Tensor lse_k = at::full_like(lse, -kInf).index_copy_(0, row, lse_all.index_select(0, position));
      at::Tensor out_k = at::zeros_like(out_acc).index_copy_(0, row, out_all.index_select(0, position));
      at::Tensor total = at::logaddexp(lse, lse_k);
      const at::Tensor has_key = total > -kInf;
      auto weight = [&](const at::Tensor& part) {
        return at::where(has_key, at::exp(part - total), at::zeros_like(total)).unsqueeze(-1);
      };
      out_acc = out_acc * weight(lse) + out_k * weight(lse_k);
      lse = total;
    }
    out_rows = out_acc.to(dtype);
  }
  at::Tensor out = out_rows.view({b, sq, h, dv}).transpose(1, 2);  // [B,H,Sq,Dv], [B,Sq,H,Dv] memory
  auto saved = std::make_shared<SavedForBackward>(std::vector<at::Tensor>{q, k, v}, std::vector<std::string>{"q", "k", "v"});
  return attach_backward(
      {q, k, v}, {out}, "PieceAttentionBackward",
      [saved, groups, out_rows, lse, call_of, &kernel, dtype, acc, b, h, sq, sk, dqk, dv](std::vector<at::Tensor> grads) {
        saved->check(kWhat);
        const at::Tensor qr = rows_of((*saved)[0]), kr = rows_of((*saved)[1]), vr = rows_of((*saved)[2]);
        const at::Tensor dout_rows = rows_of(grads[0].to(dtype));
        at::Tensor dq = at::zeros({b * sq, h, dqk}, qr.options().dtype(acc));
        at::Tensor dk = at::zeros({b * sk, h, dqk}, qr.options().dtype(acc));
        at::Tensor dvv = at::zeros({b * sk, h, dv}, qr.options().dtype(acc));
        for (const DeviceGroup& d : *groups) {
          PieceGrads g = kernel.backward(call_of(d, qr, kr, vr), out_rows.index_select(0, d.query_index),
                                         lse.index_select(0, d.query_index), dout_rows.index_select(0, d.query_index),
                                         d.state);
          dq.index_add_(0, d.query_index, g.dq.to(acc));
          dk.index_add_(0, d.key_index, g.dk.to(acc));
          dvv.index_add_(0, d.key_index, g.dv.to(acc));
        }
        auto back = [&](const at::Tensor& rows, int64_t s, int64_t dim) {
          return rows.to(dtype).view({b, s, h, dim}).transpose(1, 2);
        };
        return std::vector<at::Tensor>{back(dq, sq, dqk), back(dk, sk, dqk), back(dvv, sk, dv)};
      })[0];
}

}  // namespace mlacp
