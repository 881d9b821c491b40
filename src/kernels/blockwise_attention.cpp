// Blockwise attention: forward and backward drivers, autograd wiring, public entry points.
// See blockwise_attention.h for the contract.
//
// Layout of one forward step (query block i, key block j; bq × bk tile):
//
//   K_j rows [bk, Dqk] ──A──┐
//   Q_i^T panels [Dqk, bq] ─B┴─> S^T [bk, bq]  ── mask, online softmax over the key axis
//                                   │             (query index = vector lane: m, l per lane)
//   P = (S^T)^T [bq, bk] ──A──┐     ▼
//   V_j panels [bk, Dv]  ──B──┴──> O_acc [bq, Dv] += P·V_j  (after O_acc *= alpha)
//
// Backward per query block i (dQ_i local), key blocks j in turn (dK/dV accumulate per head):
//   S^T = K_j·Q_i^T, dP^T = V_j·dO_i^T, P^T = exp(S^T·scale − lse_i),
//   dS^T = P^T ∘ (dP^T − D_i)·scale, dV_j += P^T·dO_i, dK_j += dS^T·Q_i, dQ_i += dS·K_j.
//
// Every GEMM is C[M×N] (+)= A·B with A read by scalar broadcast at arbitrary strides and B
// packed in 64-column panels, so no operand is transposed in memory except the packed panels.
// Micro-kernels: AVX-512F (float32 FMA) and AVX-512-BF16 (vdpbf16ps: bf16 pairs, float32
// sums), chosen at run time; portable C++ for float64 and CPUs without AVX-512.
//
// Pieces: blockwise_plan (checks, Plan), blockwise_gemm (packing, micro-kernels, gemm),
// blockwise_softmax (tile steps), blockwise_workers (pool), blockwise_isa (paths, ISA macros).
#include "kernels/blockwise_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <vector>

#include <ATen/ATen.h>

#include "core/autograd_node.h"
#include "kernels/blockwise_gemm.h"
#include "kernels/blockwise_isa.h"
#include "kernels/blockwise_plan.h"
#include "kernels/blockwise_softmax.h"
#include "kernels/blockwise_workers.h"
#include "mlacp/errors.h"

namespace mlacp {

using namespace blockwise_detail;

namespace {

// Inner dim must be dense; other strides are read in place.
at::Tensor dense_rows(const at::Tensor& t) { return t.size(3) <= 1 || t.stride(3) == 1 ? t : t.contiguous(); }

// Whether the rows of one (batch, head) lie next to each other.
bool head_rows_adjacent(const at::Tensor& t) { return t.size(2) <= 1 || t.size(3) <= 1 || t.stride(2) == t.size(3); }

// K and V are swept once per query block. In a [B,S,H,D] tensor viewed as [B,H,S,D] (how the CP
// runtime passes them) one head's rows lie H·D elements apart, so at long S every row of a sweep
// is on its own page: a TLB miss per row (measured: `mlacp bench-kernel --layout bshd`). When
// there is more than one sweep, one head-major copy makes each head's rows adjacent.
at::Tensor swept_rows(const at::Tensor& t, int64_t sweeps) {
  const at::Tensor d = dense_rows(t);
  return sweeps < 2 || head_rows_adjacent(d) ? d : d.contiguous();
}

// An output [B,H,S,D] in the memory layout of `like` when that is [B,H,S,D] or [B,S,H,D].
at::Tensor empty_rows_like(const at::Tensor& like, int64_t d, at::ScalarType dtype) {
  const int64_t b = like.size(0), h = like.size(1), s = like.size(2);
  const auto opts = like.options().dtype(dtype);
  if (!like.is_contiguous() && like.transpose(1, 2).is_contiguous())
    return at::empty({b, s, h, d}, opts).transpose(1, 2);
  return at::empty({b, h, s, d}, opts);
}

// ---------------------------------------------------------------------------------------------
// Per-worker buffers, carved from one byte tensor (counted by the memory probe). The layout
// function runs twice: once to size, once to place.
class Bump {
 public:
  explicit Bump(char* base) : base_(base) {}
  template <class T>
  T* take(int64_t count) {
    offset_ = round_up(offset_, 64);
    T* p = base_ ? reinterpret_cast<T*>(base_ + offset_) : nullptr;
    offset_ += std::max<int64_t>(count, 1) * static_cast<int64_t>(sizeof(T));
    return p;
  }
  int64_t bytes() const { return offset_; }

 private:
  char* base_;
  int64_t offset_ = 0;
};

enum class Phase { forward, backward };

template <class P>
struct Buffers {
  using E = typename P::E;
  using Acc = typename P::Acc;
  at::Tensor storage;
  E *q_rows = nullptr, *k_rows = nullptr, *v_rows = nullptr, *do_rows = nullptr;  // converted rows
  E *q_t = nullptr, *do_t = nullptr, *v_panel = nullptr;                          // B panels
  E *k_panel = nullptr, *q_panel = nullptr, *do_panel = nullptr;
  Acc *st = nullptr, *dpt = nullptr;                // score tiles S^T, dP^T [block_k][ldq]
  E *pw = nullptr, *pt = nullptr, *dst = nullptr;   // bf16 P / dS layouts (pair paths)
  Acc *o_acc = nullptr, *dq_acc = nullptr;          // [block_q][Dv], [block_q][Dqk]
  Acc *m = nullptr, *l = nullptr, *alpha = nullptr, *safe = nullptr, *sum = nullptr;  // per query lane
  Acc *lse = nullptr, *delta = nullptr;
  Acc *dk_head = nullptr, *dv_head = nullptr;       // [Sk][Dqk], [Sk][Dv] (backward, head mode)

  void carve(const Plan& p, Phase phase, bool head_acc, Bump& bump) {
    const int64_t bq = p.block_q, bk = p.block_k, ldq = round_up(bq, kLanes);
    const int64_t dqk2 = round_up(p.dqk, 2), dv2 = round_up(p.dv, 2);
    const int64_t pair_tile = P::kPairs ? round_up(bk, 2) * ldq : 0;
    q_rows = bump.take<E>(bq * dqk2);
    k_rows = bump.take<E>(bk * dqk2);
    v_rows = bump.take<E>(bk * dv2);
    q_t = bump.take<E>(panel_elems(p.dqk, bq));
    st = bump.take<Acc>(bk * ldq);
    pw = bump.take<E>(pair_tile);
    for (Acc** lane : {&m, &l, &alpha, &safe, &sum, &lse, &delta}) *lane = bump.take<Acc>(ldq);
    if (phase == Phase::forward) {
      v_panel = bump.take<E>(panel_elems(bk, p.dv));
      o_acc = bump.take<Acc>(bq * p.dv);
      return;
    }
    do_rows = bump.take<E>(bq * dv2);
    do_t = bump.take<E>(panel_elems(p.dv, bq));
    k_panel = bump.take<E>(panel_elems(bk, p.dqk));
    q_panel = bump.take<E>(panel_elems(bq, p.dqk));
    do_panel = bump.take<E>(panel_elems(bq, p.dv));
    dpt = bump.take<Acc>(bk * ldq);
    pt = bump.take<E>(pair_tile);
    dst = bump.take<E>(pair_tile);
    dq_acc = bump.take<Acc>(bq * p.dqk);
    if (head_acc) {
      dk_head = bump.take<Acc>(p.sk * p.dqk);
      dv_head = bump.take<Acc>(p.sk * p.dv);
    }
  }
  static Buffers make(const Plan& p, Phase phase, bool head_acc) {
    Buffers b;
    Bump sizing(nullptr);
    b.carve(p, phase, head_acc, sizing);
    b.storage = at::empty({sizing.bytes() + 64}, at::TensorOptions().dtype(at::kByte));
    char* base = static_cast<char*>(b.storage.data_ptr());
    Bump placing(base + (64 - reinterpret_cast<uintptr_t>(base) % 64) % 64);
    b.carve(p, phase, head_acc, placing);
    return b;
  }
};

struct Counts {
  int64_t computed = 0, masked = 0;
};

// ---------------------------------------------------------------------------------------------
// Forward: one task = (batch·head, query block).
struct ForwardIO {
  Rows4 q, k, v, out;
  void* lse;  // Acc [B·H·Sq]
};

template <class P>
struct ForwardState {
  Buffers<P> buf;
  Counts counts;
};

template <class P>
void forward_tile_row(const Plan& p, const ForwardIO& io, int64_t bh, int64_t qb, ForwardState<P>& state) {
  using E = typename P::E;
  using Acc = typename P::Acc;
  Buffers<P>& s = state.buf;
  const int64_t b = bh / p.heads, h = bh % p.heads;
  const BlockInfo& qi = p.q_blocks[qb];
  const int64_t bq = qi.size, ldq = round_up(bq, kLanes), dqk = p.dqk, dv = p.dv;
  const Acc scale = static_cast<Acc>(p.scaling);
  pack_b_cols<P>(rows_as<P>(io.q, b, h, qi.begin, bq, dqk, s.q_rows, false), bq, dqk, s.q_t);
  std::fill(s.m, s.m + ldq, -std::numeric_limits<Acc>::infinity());
  std::fill(s.l, s.l + ldq, Acc(0));
  std::fill(s.o_acc, s.o_acc + bq * dv, Acc(0));
  const int64_t ua = P::kPairs ? 2 : 1;  // E per A unit along K
  for (int64_t kb = 0; kb < p.nkb; ++kb) {
    const TileKind kind = p.classify(qb, kb);
    if (kind == TileKind::skip || (kind == TileKind::masked && !p.mask_any(b, qb, kb))) continue;
    const BlockInfo& kj = p.k_blocks[kb];
    const int64_t bk = kj.size;
    ++state.counts.computed;
    const RowsE<E> kr = rows_as<P>(io.k, b, h, kj.begin, bk, dqk, s.k_rows, true);
    gemm<P>(bk, bq, dqk, kr.ptr, kr.ld, ua, s.q_t, s.st, ldq, false, ldq);  // S^T = K_j·Q_i^T
    if (kind == TileKind::masked) {
      ++state.counts.masked;
      p.apply_mask(b, qb, kb, s.st, ldq);
    }
    const E* pa;  // P as the A operand of P·V_j: element (i, key) at pa[i·rs + key·cs]
    int64_t rs, cs;
    if constexpr (P::kAvx && P::kPairs) {
#if MLACP_X86
      softmax_step_bf16(bk, ldq, s.st, scale, s.m, s.l, s.alpha, s.pw);
#endif
      pa = s.pw, rs = 2, cs = 2 * ldq;
    } else {
      if constexpr (P::kAvx) {
#if MLACP_X86
        softmax_step_f32(bk, ldq, s.st, scale, s.m, s.l, s.alpha);
#endif
      } else if constexpr (P::kAvx2) {
#if MLACP_X86
        softmax_step_f32_avx2(bk, ldq, s.st, scale, s.m, s.l, s.alpha);
#endif
      } else {
        softmax_step_portable<Acc>(bk, ldq, s.st, scale, s.m, s.l, s.alpha, s.safe, s.sum);
      }
      pa = s.st, rs = 1, cs = ldq;
    }
    for (int64_t i = 0; i < bq; ++i) {
      const Acc a = s.alpha[i];
      if (a != Acc(1))
        for (int64_t d = 0; d < dv; ++d) s.o_acc[i * dv + d] *= a;
    }
    pack_b_rows<P>(rows_as<P>(io.v, b, h, kj.begin, bk, dv, s.v_rows, false), bk, dv, s.v_panel);
    gemm<P>(bq, dv, bk, pa, rs, cs, s.v_panel, s.o_acc, dv, true);  // O += P·V_j
  }
  Acc* lse = static_cast<Acc*>(io.lse) + bh * p.sq + qi.begin;
  for (int64_t i = 0; i < bq; ++i) {
    const Acc l = s.l[i];
    store_row<Acc>(s.o_acc + i * dv, dv, l > 0 ? Acc(1) / l : Acc(0), io.out.row(b, h, qi.begin + i), p.in_dtype);
    lse[i] = l > 0 ? s.m[i] + std::log(l) : -std::numeric_limits<Acc>::infinity();
  }
}

template <class P>
void run_forward(const Plan& p, const ForwardIO& io, BlockwiseStats* stats) {
  std::vector<int64_t> cost(p.batch * p.heads * p.nqb);
  for (int64_t qb = 0; qb < p.nqb; ++qb) {
    int64_t c = 1;
    for (int64_t kb = 0; kb < p.nkb; ++kb) c += p.classify(qb, kb) != TileKind::skip;
    for (int64_t bh = 0; bh < p.batch * p.heads; ++bh) cost[bh * p.nqb + qb] = c;
  }
  std::atomic<int64_t> computed{0}, masked{0};
  run_tasks<ForwardState<P>>(
      order_by_cost(cost), [&](int64_t) { return ForwardState<P>{Buffers<P>::make(p, Phase::forward, false), {}}; },
      [&](int64_t t, ForwardState<P>& s) { forward_tile_row<P>(p, io, t / p.nqb, t % p.nqb, s); },
      [&](ForwardState<P>& s) {
        computed += s.counts.computed;
        masked += s.counts.masked;
      });
  if (stats) {
    stats->forward_blocks_computed = computed;
    stats->forward_blocks_masked = masked;
  }
}

// ---------------------------------------------------------------------------------------------
// Backward: one task = (batch·head, group g of query blocks g, g+G, ...). dQ_i is local to a
// query block; dK/dV accumulate over the task's query blocks into `dk`/`dv` targets:
//   direct   G = 1, accumulator dtype = gradient dtype: straight into the gradient tensors
//   head     G = 1, bf16 gradients: a per-worker float32 [Sk, D] head buffer, flushed per task
//   partial  G > 1 (few heads, many threads): float32/64 [B·H, G, Sk, D] partials, summed after
enum class AccMode { direct, head, partial };

struct BackwardIO {
  Rows4 q, k, v, dout, dq, dk, dv;
  const void* lse;    // Acc [B·H·Sq]
  const void* delta;  // Acc [B·H·Sq]
  AccMode mode;
  bool accumulate_kv;  // add to the dK/dV targets' contents instead of overwriting them
  int64_t groups;
  void* dk_part;  // Acc [B·H·G·Sk·Dqk] (partial mode)
  void* dv_part;
};

template <class P>
struct BackwardState {
  Buffers<P> buf;
  Counts counts;
};

template <class P>
void backward_task(const Plan& p, const BackwardIO& io, int64_t bh, int64_t g, BackwardState<P>& state) {
  using E = typename P::E;
  using Acc = typename P::Acc;
  Buffers<P>& s = state.buf;
  const int64_t b = bh / p.heads, h = bh % p.heads, dqk = p.dqk, dv = p.dv;
  const Acc scale = static_cast<Acc>(p.scaling);
  const int64_t ua = P::kPairs ? 2 : 1;
  Acc *dk_base, *dv_base;
  int64_t dk_ld = dqk, dv_ld = dv;
  if (io.mode == AccMode::direct) {
    dk_base = reinterpret_cast<Acc*>(io.dk.row(b, h, 0)), dk_ld = io.dk.ss;
    dv_base = reinterpret_cast<Acc*>(io.dv.row(b, h, 0)), dv_ld = io.dv.ss;
  } else if (io.mode == AccMode::head) {
    dk_base = s.dk_head, dv_base = s.dv_head;
  } else {
    dk_base = static_cast<Acc*>(io.dk_part) + (bh * io.groups + g) * p.sk * dqk;
    dv_base = static_cast<Acc*>(io.dv_part) + (bh * io.groups + g) * p.sk * dv;
  }
  if (io.accumulate_kv && io.mode == AccMode::head) {  // start from the targets' sums
    for (int64_t j = 0; j < p.sk; ++j) {
      load_row_acc(io.dk.row(b, h, j), io.dk.dtype, dqk, dk_base + j * dk_ld);
      load_row_acc(io.dv.row(b, h, j), io.dv.dtype, dv, dv_base + j * dv_ld);
    }
  } else if (!(io.accumulate_kv && io.mode == AccMode::direct)) {  // direct + accumulate: add in place
    for (int64_t j = 0; j < p.sk; ++j) {
      std::fill(dk_base + j * dk_ld, dk_base + j * dk_ld + dqk, Acc(0));
      std::fill(dv_base + j * dv_ld, dv_base + j * dv_ld + dv, Acc(0));
    }
  }
  const Acc* lse_all = static_cast<const Acc*>(io.lse) + bh * p.sq;
  const Acc* delta_all = static_cast<const Acc*>(io.delta) + bh * p.sq;
  for (int64_t qb = g; qb < p.nqb; qb += io.groups) {
    const BlockInfo& qi = p.q_blocks[qb];
    const int64_t bq = qi.size, ldq = round_up(bq, kLanes);
    const RowsE<E> qr = rows_as<P>(io.q, b, h, qi.begin, bq, dqk, s.q_rows, false);
    const RowsE<E> dor = rows_as<P>(io.dout, b, h, qi.begin, bq, dv, s.do_rows, false);
    pack_b_cols<P>(qr, bq, dqk, s.q_t);       // Q_i^T  [Dqk, bq]
    pack_b_cols<P>(dor, bq, dv, s.do_t);      // dO_i^T [Dv, bq]
    pack_b_rows<P>(qr, bq, dqk, s.q_panel);   // Q_i    [bq, Dqk]
    pack_b_rows<P>(dor, bq, dv, s.do_panel);  // dO_i   [bq, Dv]
    for (int64_t i = 0; i < ldq; ++i) {
      // Rows without keys have lse = −inf: +inf makes every P exactly 0. Padding lanes: 0.
      const Acc l = i < bq ? lse_all[qi.begin + i] : Acc(0);
      s.lse[i] = l == -std::numeric_limits<Acc>::infinity() ? std::numeric_limits<Acc>::infinity() : l;
      s.delta[i] = i < bq ? delta_all[qi.begin + i] : Acc(0);
    }
    std::fill(s.dq_acc, s.dq_acc + bq * dqk, Acc(0));
    for (int64_t kb = 0; kb < p.nkb; ++kb) {
      const TileKind kind = p.classify(qb, kb);
      if (kind == TileKind::skip || (kind == TileKind::masked && !p.mask_any(b, qb, kb))) continue;
      const BlockInfo& kj = p.k_blocks[kb];
      const int64_t bk = kj.size;
      ++state.counts.computed;
      const RowsE<E> kr = rows_as<P>(io.k, b, h, kj.begin, bk, dqk, s.k_rows, true);
      const RowsE<E> vr = rows_as<P>(io.v, b, h, kj.begin, bk, dv, s.v_rows, true);
      gemm<P>(bk, bq, dqk, kr.ptr, kr.ld, ua, s.q_t, s.st, ldq, false, ldq);   // S^T  = K_j·Q_i^T
      if (kind == TileKind::masked) p.apply_mask(b, qb, kb, s.st, ldq);
      gemm<P>(bk, bq, dv, vr.ptr, vr.ld, ua, s.do_t, s.dpt, ldq, false, ldq);  // dP^T = V_j·dO_i^T
      const E *pt_a, *dst_a, *ds_a;  // P^T rows, dS^T rows, dS (query, key)
      int64_t row_rs, ds_rs, ds_cs;
      if constexpr (P::kAvx && P::kPairs) {
#if MLACP_X86
        backward_step_bf16(bk, ldq, s.st, s.dpt, scale, s.lse, s.delta, s.pt, s.dst, s.pw);
#endif
        pt_a = s.pt, dst_a = s.dst, row_rs = ldq, ds_a = s.pw, ds_rs = 2, ds_cs = 2 * ldq;
      } else {
        if constexpr (P::kAvx) {
#if MLACP_X86
          backward_step_f32(bk, ldq, s.st, s.dpt, scale, s.lse, s.delta);
#endif
        } else if constexpr (P::kAvx2) {
#if MLACP_X86
          backward_step_f32_avx2(bk, ldq, s.st, s.dpt, scale, s.lse, s.delta);
#endif
        } else {
          backward_step_portable<Acc>(bk, ldq, s.st, s.dpt, scale, s.lse, s.delta);
        }
        pt_a = s.st, dst_a = s.dpt, row_rs = ldq, ds_a = s.dpt, ds_rs = 1, ds_cs = ldq;
      }
      gemm<P>(bk, dv, bq, pt_a, row_rs, ua, s.do_panel, dv_base + kj.begin * dv_ld, dv_ld, true);   // dV_j += P^T·dO_i
      gemm<P>(bk, dqk, bq, dst_a, row_rs, ua, s.q_panel, dk_base + kj.begin * dk_ld, dk_ld, true);  // dK_j += dS^T·Q_i
      pack_b_rows<P>(kr, bk, dqk, s.k_panel);
      gemm<P>(bq, dqk, bk, ds_a, ds_rs, ds_cs, s.k_panel, s.dq_acc, dqk, true);  // dQ_i += dS·K_j
    }
    for (int64_t i = 0; i < bq; ++i)
      store_row<Acc>(s.dq_acc + i * dqk, dqk, Acc(1), io.dq.row(b, h, qi.begin + i), p.in_dtype);
  }
  if (io.mode == AccMode::head) {
    for (int64_t j = 0; j < p.sk; ++j) {
      store_row<Acc>(dk_base + j * dqk, dqk, Acc(1), io.dk.row(b, h, j), p.in_dtype);
      store_row<Acc>(dv_base + j * dv, dv, Acc(1), io.dv.row(b, h, j), p.in_dtype);
    }
  }
}

// delta[bh, i] = Σ_d dO·O − dlse (accumulator precision).
template <class Acc>
void compute_delta(const Plan& p, const Rows4& out, const Rows4& dout, const at::Tensor& dlse, Acc* delta) {
  const Acc* dl = dlse.defined() ? dlse.data_ptr<Acc>() : nullptr;
  std::vector<int64_t> order(p.batch * p.heads);
  std::iota(order.begin(), order.end(), 0);
  run_tasks<std::vector<Acc>>(
      order, [&](int64_t) { return std::vector<Acc>(2 * p.dv); },
      [&](int64_t bh, std::vector<Acc>& rows) {
        const int64_t b = bh / p.heads, h = bh % p.heads;
        for (int64_t i = 0; i < p.sq; ++i) {
          load_row_acc(out.row(b, h, i), out.dtype, p.dv, rows.data());
          load_row_acc(dout.row(b, h, i), dout.dtype, p.dv, rows.data() + p.dv);
          Acc sum = 0;
          for (int64_t d = 0; d < p.dv; ++d) sum += rows[d] * rows[p.dv + d];
          delta[bh * p.sq + i] = sum - (dl ? dl[bh * p.sq + i] : Acc(0));
        }
      },
      [](std::vector<Acc>&) {});
}

template <class P>
void run_backward(const Plan& p, const BackwardIO& io, BlockwiseStats* stats) {
  const int64_t bh_count = p.batch * p.heads;
  std::vector<int64_t> cost(bh_count * io.groups);
  for (int64_t g = 0; g < io.groups; ++g) {
    int64_t c = 1;
    for (int64_t qb = g; qb < p.nqb; qb += io.groups)
      for (int64_t kb = 0; kb < p.nkb; ++kb) c += p.classify(qb, kb) != TileKind::skip;
    for (int64_t bh = 0; bh < bh_count; ++bh) cost[bh * io.groups + g] = c;
  }
  std::atomic<int64_t> computed{0};
  run_tasks<BackwardState<P>>(
      order_by_cost(cost),
      [&](int64_t) { return BackwardState<P>{Buffers<P>::make(p, Phase::backward, io.mode == AccMode::head), {}}; },
      [&](int64_t t, BackwardState<P>& s) { backward_task<P>(p, io, t / io.groups, t % io.groups, s); },
      [&](BackwardState<P>& s) { computed += s.counts.computed; });
  if (stats) stats->backward_blocks_computed = computed;
}

// ---------------------------------------------------------------------------------------------
// Entry points.
template <class Fn>
void dispatch_path(BlockwisePath path, Fn&& fn) {
  switch (path) {
    case BlockwisePath::float64_portable: return fn(F64Portable{});
    case BlockwisePath::float32_portable: return fn(F32Portable{});
#if MLACP_X86
    case BlockwisePath::float32_avx512: return fn(F32Avx512{});
    case BlockwisePath::bf16_avx512: return fn(Bf16Avx512{});
    case BlockwisePath::bf16_via_f32_avx512: return fn(Bf16ViaF32Avx512{});
    case BlockwisePath::bf16_amx: return fn(Bf16Amx{});
    case BlockwisePath::float32_avx2: return fn(F32Avx2{});
    case BlockwisePath::bf16_via_f32_avx2: return fn(Bf16ViaF32Avx2{});
#endif
    default: fail(kWhat, "internal: unsupported path", {got("path", path_name(path))}, "report this");
  }
}

// `out_into`: where the output rows go (checked by check_target), or undefined for a new tensor.
BlockwiseResult forward_impl(const Plan& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             BlockwiseStats* stats, const at::Tensor& out_into = {}) {
  const at::Tensor qd = dense_rows(q), kd = swept_rows(k, p.nqb), vd = swept_rows(v, p.nqb);
  BlockwiseResult r;
  r.out = out_into.defined() ? out_into : empty_rows_like(qd, p.dv, p.in_dtype);
  r.lse = at::empty({p.batch, p.heads, p.sq}, q.options().dtype(p.acc_dtype));
  if (stats) {
    *stats = BlockwiseStats{};
    stats->path = p.path, stats->block_q = p.block_q, stats->block_k = p.block_k;
    stats->blocks_total = p.batch * p.heads * p.nqb * p.nkb;
  }
  if (r.out.numel() == 0 && r.lse.numel() == 0) return r;
  const ForwardIO io{rows_of(qd), rows_of(kd), rows_of(vd), rows_of(r.out), r.lse.data_ptr()};
  dispatch_path(p.path, [&](auto path) { run_forward<decltype(path)>(p, io, stats); });
  return r;
}

// `into`: where dq, dk, dv go (checked by check_target), or undefined tensors for new ones;
// `accumulate_kv`: add dK/dV to into.dk/into.dv instead of overwriting them.
BlockwiseGrads backward_impl(const Plan& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dout,
                             const at::Tensor& dlse, BlockwiseStats* stats, const BlockwiseGrads& into = {},
                             bool accumulate_kv = false) {
  const at::Tensor qd = dense_rows(q), kd = swept_rows(k, p.nqb), vd = swept_rows(v, p.nqb);
  const at::Tensor od = dense_rows(out), dod = dense_rows(dout);
  const at::Tensor lse_c = lse.contiguous();
  const at::Tensor dlse_c = dlse.defined() ? dlse.to(p.acc_dtype).contiguous() : at::Tensor();
  BlockwiseGrads g{into.dq.defined() ? into.dq : empty_rows_like(qd, p.dqk, p.in_dtype),
                   into.dk.defined() ? into.dk : empty_rows_like(dense_rows(k), p.dqk, p.in_dtype),
                   into.dv.defined() ? into.dv : empty_rows_like(dense_rows(v), p.dv, p.in_dtype)};
  if (g.dq.numel() + g.dk.numel() + g.dv.numel() == 0) return g;
  if (p.sq == 0) {  // no queries: no gradient reaches k, v
    if (!accumulate_kv) g.dk.zero_(), g.dv.zero_();
    return g;
  }
  at::Tensor delta = at::empty({p.batch, p.heads, p.sq}, q.options().dtype(p.acc_dtype));
  BackwardIO io{rows_of(qd),   rows_of(kd),   rows_of(vd),   rows_of(dod), rows_of(g.dq),
                rows_of(g.dk), rows_of(g.dv), lse_c.data_ptr(), delta.data_ptr(), AccMode::direct,
                accumulate_kv, 1,             nullptr,       nullptr};
  if (p.acc_dtype == at::kDouble)
    compute_delta<double>(p, rows_of(od), rows_of(dod), dlse_c, delta.data_ptr<double>());
  else
    compute_delta<float>(p, rows_of(od), rows_of(dod), dlse_c, delta.data_ptr<float>());
  // Query-block groups per head: enough tasks to keep every worker busy (G > 1 only when there
  // are fewer than 2 heads·batches per worker; then dK/dV go through per-group partials).
  const int64_t bh_count = p.batch * p.heads;
  io.groups = std::clamp<int64_t>(ceil_div(2 * worker_count(), std::max<int64_t>(bh_count, 1)), 1,
                                  std::max<int64_t>(p.nqb, 1));
  at::Tensor dk_part, dv_part;
  if (io.groups > 1) {
    io.mode = AccMode::partial;
    dk_part = at::empty({p.batch, p.heads, io.groups, p.sk, p.dqk}, q.options().dtype(p.acc_dtype));
    dv_part = at::empty({p.batch, p.heads, io.groups, p.sk, p.dv}, q.options().dtype(p.acc_dtype));
    io.dk_part = dk_part.data_ptr(), io.dv_part = dv_part.data_ptr();
  } else {
    // Straight into the gradients only when they hold the accumulator dtype and one head's rows
    // are adjacent (dK_j/dV_j are updated once per query block: the sweep of swept_rows).
    const bool adjacent = p.nqb < 2 || (head_rows_adjacent(g.dk) && head_rows_adjacent(g.dv));
    io.mode = p.acc_dtype == p.in_dtype && adjacent ? AccMode::direct : AccMode::head;
  }
  dispatch_path(p.path, [&](auto path) { run_backward<decltype(path)>(p, io, stats); });
  if (io.mode == AccMode::partial && accumulate_kv) {
    g.dk.add_(dk_part.sum(2));
    g.dv.add_(dv_part.sum(2));
  } else if (io.mode == AccMode::partial) {
    g.dk.copy_(dk_part.sum(2));
    g.dv.copy_(dv_part.sum(2));
  }
  return g;
}

void check_backward_args(const Plan& p, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dout,
                         const at::Tensor& dlse) {
  const std::vector<int64_t> out_shape{p.batch, p.heads, p.sq, p.dv}, lse_shape{p.batch, p.heads, p.sq};
  MLACP_REQUIRE(out.defined() && dout.defined() && out.sizes().vec() == out_shape && dout.sizes().vec() == out_shape,
                kWhat, "out and dout must be [B,H,Sq,Dv]",
                {got("out.shape", shape_of(out)), got("dout.shape", shape_of(dout)), got("expected", out_shape)},
                "pass the forward's output and its gradient");
  MLACP_REQUIRE(out.scalar_type() == p.in_dtype && dout.scalar_type() == p.in_dtype, kWhat,
                "out and dout must have the inputs' dtype",
                {got("out.dtype", c10::toString(out.scalar_type())),
                 got("dout.dtype", c10::toString(dout.scalar_type())), got("q.dtype", c10::toString(p.in_dtype))},
                "cast dout to the output dtype");
  MLACP_REQUIRE(
      lse.defined() && lse.sizes().vec() == lse_shape && lse.scalar_type() == p.acc_dtype, kWhat,
      "lse must be the forward's log-sum-exp [B,H,Sq] (float32; float64 for float64 inputs)",
      {got("lse.shape", shape_of(lse)), got("lse.dtype", lse.defined() ? c10::toString(lse.scalar_type()) : "-")},
      "pass BlockwiseResult::lse");
  MLACP_REQUIRE(!dlse.defined() || dlse.sizes().vec() == lse_shape, kWhat, "dlse must be [B,H,Sq] or undefined",
                {got("dlse.shape", shape_of(dlse))}, "pass the gradient of lse or nothing");
}

BlockwiseResult forward_with_graph(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scaling,
                                   const AttentionStructure& st, const BlockwiseOptions& opt, bool with_lse) {
  std::shared_ptr<const Plan> plan = make_plan(q, k, v, scaling, st, opt);
  BlockwiseResult r = forward_impl(*plan, q, k, v, opt.stats);
  std::vector<at::Tensor> outputs{r.out};
  if (with_lse) outputs.push_back(r.lse);
  const SavedForBackward saved({q.detach(), k.detach(), v.detach(), r.out}, {"q", "k", "v", "out"});
  BackwardFn backward = [plan, saved, lse = r.lse, stats = opt.stats,
                         with_lse](std::vector<at::Tensor> grads) -> std::vector<at::Tensor> {
    saved.check(kWhat);
    const at::Tensor& out = saved[3];
    const at::Tensor dout = grads[0].scalar_type() == out.scalar_type() ? grads[0] : grads[0].to(out.scalar_type());
    const at::Tensor dlse = with_lse ? grads[1] : at::Tensor();
    BlockwiseGrads g = backward_impl(*plan, saved[0], saved[1], saved[2], out, lse, dout, dlse, stats);
    return {g.dq, g.dk, g.dv};
  };
  outputs = attach_backward({q, k, v}, std::move(outputs), "BlockwiseAttentionBackward", std::move(backward));
  return {outputs[0], with_lse ? outputs[1] : r.lse};
}

// A caller-provided output or gradient target: the expected shape and dtype, on q's device, last
// dim dense (rows, heads and batches may have any strides, e.g. a row range of a larger tensor).
void check_target(const char* name, const at::Tensor& t, const std::vector<int64_t>& shape, at::ScalarType dtype,
                  const at::Device& device) {
  MLACP_REQUIRE(t.defined() && t.sizes().vec() == shape && t.scalar_type() == dtype && t.device() == device &&
                    (t.size(3) <= 1 || t.stride(3) == 1),
                kWhat, "an output target must have the result's shape and dtype, on the inputs' device, last dim dense",
                {got("target", name), got("shape", shape_of(t)), got("expected", shape),
                 got("dtype", t.defined() ? c10::toString(t.scalar_type()) : "-"), got("expected_dtype", c10::toString(dtype))},
                "pass a view of a tensor allocated like the result (e.g. out.narrow(2, begin, rows))");
}

}  // namespace

at::Tensor blockwise_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scaling,
                               const AttentionStructure& structure, const BlockwiseOptions& options) {
  return forward_with_graph(q, k, v, scaling, structure, options, false).out;
}

BlockwiseResult blockwise_attention_with_lse(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             double scaling, const AttentionStructure& structure,
                                             const BlockwiseOptions& options) {
  return forward_with_graph(q, k, v, scaling, structure, options, true);
}

BlockwiseResult blockwise_attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            double scaling, const AttentionStructure& structure,
                                            const BlockwiseOptions& options) {
  const std::shared_ptr<const Plan> plan = make_plan(q, k, v, scaling, structure, options);
  return forward_impl(*plan, q.detach(), k.detach(), v.detach(), options.stats);
}

BlockwiseGrads blockwise_attention_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dout,
                                            const at::Tensor& dlse, double scaling,
                                            const AttentionStructure& structure, const BlockwiseOptions& options) {
  const std::shared_ptr<const Plan> plan = make_plan(q, k, v, scaling, structure, options);
  check_backward_args(*plan, out, lse, dout, dlse);
  return backward_impl(*plan, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), dout.detach(),
                       dlse.defined() ? dlse.detach() : dlse, options.stats);
}

at::Tensor blockwise_attention_forward_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           double scaling, const AttentionStructure& structure, const at::Tensor& out,
                                           const BlockwiseOptions& options) {
  const std::shared_ptr<const Plan> plan = make_plan(q, k, v, scaling, structure, options);
  check_target("out", out, {plan->batch, plan->heads, plan->sq, plan->dv}, plan->in_dtype, q.device());
  return forward_impl(*plan, q.detach(), k.detach(), v.detach(), options.stats, out.detach()).lse;
}

void blockwise_attention_backward_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dout,
                                       const at::Tensor& dlse, double scaling, const AttentionStructure& structure,
                                       const BlockwiseGrads& into, bool accumulate_kv, const BlockwiseOptions& options) {
  const std::shared_ptr<const Plan> plan = make_plan(q, k, v, scaling, structure, options);
  check_backward_args(*plan, out, lse, dout, dlse);
  check_target("dq", into.dq, {plan->batch, plan->heads, plan->sq, plan->dqk}, plan->in_dtype, q.device());
  check_target("dk", into.dk, {plan->batch, plan->heads, plan->sk, plan->dqk}, plan->in_dtype, q.device());
  check_target("dv", into.dv, {plan->batch, plan->heads, plan->sk, plan->dv}, plan->in_dtype, q.device());
  backward_impl(*plan, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), dout.detach(),
                dlse.defined() ? dlse.detach() : dlse, options.stats, {into.dq.detach(), into.dk.detach(), into.dv.detach()},
                accumulate_kv);
}

}  // namespace mlacp
