#include <algorithm>
#include <chrono>
#include <thread>
#include <tuple>

#include <ATen/ATen.h>

#include "comm/backend.h"
#include "comm/hosts.h"
#include "core/format.h"
#include "mlacp/errors.h"

namespace mlacp {

// --- counters and link ----------------------------------------------------------------------
std::string collective_kind_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::all_to_all: return "all_to_all";
    case CollectiveKind::all_gather: return "all_gather";
    case CollectiveKind::reduce_scatter: return "reduce_scatter";
    case CollectiveKind::all_reduce: return "all_reduce";
  }
  return "?";
}

void CommCounters::add(CollectiveKind kind, const std::string& label, int64_t bytes) {
  by_kind_[kind].bytes += bytes;
  by_kind_[kind].calls += 1;
  by_label_[label].bytes += bytes;
  by_label_[label].calls += 1;
}
void CommCounters::add_wire_time(CollectiveKind kind, const std::string& label, double seconds) {
  by_kind_[kind].wire_seconds += seconds;
  by_label_[label].wire_seconds += seconds;
}
void CommCounters::reset() {
  by_kind_.clear();
  by_label_.clear();
}
CommTotals CommCounters::by_kind(CollectiveKind kind) const {
  auto it = by_kind_.find(kind);
  return it == by_kind_.end() ? CommTotals{} : it->second;
}
int64_t CommCounters::total_bytes() const {
  int64_t total = 0;
  for (const auto& item : by_kind_) total += item.second.bytes;
  return total;
}

double LinkModel::transfer_seconds(int64_t bytes) const {
  double seconds = latency_seconds;
  if (bandwidth_bytes_per_second > 0.0) seconds += static_cast<double>(bytes) / bandwidth_bytes_per_second;
  return seconds;
}

std::pair<std::chrono::steady_clock::time_point, std::chrono::steady_clock::time_point> LinkModel::book(
    std::chrono::steady_clock::time_point launch, int64_t bytes) {
  const auto start = std::max(launch, busy_until);
  const auto done = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                std::chrono::duration<double>(transfer_seconds(bytes)));
  busy_until = done;
  return {start, done};
}

int64_t CommGroup::rank() const { return impl_->rank; }
int64_t CommGroup::size() const { return impl_->size; }
const std::string& CommGroup::name() const { return impl_->name; }
const c10::Device& CommGroup::device() const { return impl_->device; }
const std::string& CommGroup::backend_name() const { return impl_->backend_name; }
bool CommGroup::first_time(const std::string& key) const {
  std::lock_guard<std::mutex> lock(impl_->once_mutex);
  return impl_->once.insert(key).second;
}

// --- the handle -----------------------------------------------------------------------------
using Clock = std::chrono::steady_clock;

struct AsyncHandle::State {
  c10::intrusive_ptr<c10d::Work> work;        // null when nothing was sent (group of 1)
  std::vector<at::Tensor> buffers;            // send/receive buffers kept alive until wait
  std::function<std::vector<at::Tensor>()> finish;  // restores the layout after completion
  Clock::time_point launched_at;
  Clock::time_point link_start, link_done;  // emulated link: when it carries this transfer
  int64_t bytes = 0;
  std::string label;
  std::shared_ptr<LinkModel> link;
  std::shared_ptr<CommCounters> counters;  // null for groups of size 1
  std::shared_ptr<Timeline> timeline;
  TimePoint launched_point;  // the timeline's clock (a device point on a device-timed timeline)
  CollectiveKind kind = CollectiveKind::all_to_all;
  bool waited = false;
  CommGroup group;  // for fault messages: its name, rank, size, timeout and members' hosts
};

namespace {

// Waits for a backend collective; its failure (the backend's own text, e.g. Gloo's "Connection
// reset by peer" or "Timed out waiting") becomes an mlacp fault that says what it means here and,
// across hosts, which host the rank lost: the one whose address the backend names, else the
// group's members on other hosts (a link that went down shows only as a timeout).
void wait_or_fault(c10d::Work& work, const std::string& label, const CommGroup& group) {
  try {
    work.wait();
  } catch (const std::exception& e) {
    std::string cause = e.what();
    cause = cause.substr(0, cause.find('\n'));
    const CommGroup::Impl& g = group.impl();
    std::vector<ErrorValue> values{got("collective", label), got("group", g.name),
                                   got("group_rank", std::to_string(g.rank) + " of " + std::to_string(g.size)),
                                   got("timeout_s", static_cast<double>(g.timeout.count()) / 1000.0)};
    if (g.topology && g.topology->hosts() > 1) {
      int64_t host = -1;
      const std::string named = host_named_in(*g.topology, e.what(), g.members, &host);
      const std::string others = other_hosts_of(*g.topology, g.world_rank, g.members);
      if (!named.empty() && host != g.topology->host_of_rank.at(g.world_rank)) {
        values.push_back(got("lost_host", named));
      } else if (!named.empty()) {  // a rank of this host closed first: it lost the other host
        values.push_back(got("closed_by", "a rank of this host, which ended first (its own error says why)"));
        if (!others.empty()) values.push_back(got("members_on_other_hosts", others));
      } else if (!others.empty()) {  // a timeout names nobody: a link that went down looks so
        values.push_back(got("lost_contact_with", others));
      } else {
        values.push_back(got("lost", "a rank of this host (every member of the group runs here)"));
      }
    }
    values.push_back(got("cause", cause));
    fail_fault("communication", "a collective failed: a peer rank exited or stalled longer than the timeout", values,
               "the launcher names the rank that failed first; raise --timeout if a rank is only slow");
  }
}

void wait_or_fault(const CommGroup& group, const c10::intrusive_ptr<c10d::Work>& work, const std::string& label) {
  wait_or_fault(*work, label, group);
}

}  // namespace

AsyncHandle::AsyncHandle() = default;
AsyncHandle::AsyncHandle(std::unique_ptr<State> state) : state_(std::move(state)) {}
AsyncHandle::AsyncHandle(AsyncHandle&&) noexcept = default;
AsyncHandle& AsyncHandle::operator=(AsyncHandle&&) noexcept = default;
AsyncHandle::~AsyncHandle() {
  // A launched but never waited collective still owns its buffers: finish the transfer so the
  // backend never writes into freed memory. Errors are swallowed here (we may be unwinding).
  if (state_ && !state_->waited && state_->work) {
    try {
      state_->work->wait();
    } catch (...) {
    }
  }
}

bool AsyncHandle::valid() const { return state_ && !state_->waited; }
int64_t AsyncHandle::bytes() const { return state_ ? state_->bytes : 0; }
const std::string& AsyncHandle::label() const {
  static const std::string none = "";
  return state_ ? state_->label : none;
}

std::vector<at::Tensor> AsyncHandle::wait() {
  MLACP_REQUIRE(state_ != nullptr, "async collective", "wait() on a handle that was never launched", {},
                "launch the collective before waiting for it");
  MLACP_REQUIRE(!state_->waited, "async collective", "a handle may be waited exactly once",
                {got("label", state_->label)}, "keep the result of the first wait()");
  state_->waited = true;
  TimePoint wait_begin;
  if (state_->timeline) wait_begin = state_->timeline->now();
  // On a CUDA backend (NCCL) wait() makes the current stream wait for the collective and returns
  // at once: the host is not blocked (docs/DESIGN.md §16).
  if (state_->work)
    wait_or_fault(*state_->work, state_->label, state_->group);
  const bool emulated = state_->link && state_->link->enabled() && state_->work;
  if (emulated) std::this_thread::sleep_until(state_->link_done);
  if (state_->timeline) {
    const TimePoint end = state_->timeline->now();
    state_->timeline->record(state_->label, EventKind::wait, wait_begin, end);
    // The transfer: when the emulated link carries it; without one, launch to end of wait.
    if (emulated) {
      const auto offset_us = [&](Clock::time_point t) {
        return state_->launched_point.host_us +
               std::chrono::duration<double, std::micro>(t - state_->launched_at).count();
      };
      state_->timeline->record(state_->label, EventKind::transfer, offset_us(state_->link_start),
                               offset_us(state_->link_done));
    } else {
      state_->timeline->record(state_->label, EventKind::transfer, state_->launched_point, end);
    }
  }
  if (state_->counters) {
    state_->counters->add_wire_time(state_->kind, state_->label,
                                    std::chrono::duration<double>(Clock::now() - state_->launched_at).count());
  }
  std::vector<at::Tensor> results = state_->finish();
  state_->buffers.clear();
  state_->work.reset();
  return results;
}

at::Tensor AsyncHandle::wait_one() {
  std::vector<at::Tensor> results = wait();
  MLACP_REQUIRE(results.size() == 1, "async collective", "wait_one() on a collective with several results",
                {got("results", results.size())}, "use wait()");
  return results[0];
}

namespace {

constexpr const char* kWhat = "collective";

// A contiguous send buffer that does not alias `t`: inputs are read at launch, so the caller may
// overwrite them before wait().
at::Tensor owned_contiguous(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return c.storage().is_alias_of(t.storage()) ? c.clone() : c;
}

// 16-bit floats travel as bit copies (Gloo 1.13 has no bf16).
at::Tensor wire_view(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? t.view(at::kHalf) : t;
}

std::unique_ptr<AsyncHandle::State> new_state(const CommGroup& group, const std::string& label, int64_t bytes,
                                              CollectiveKind kind) {
  auto state = std::make_unique<AsyncHandle::State>();
  state->launched_at = Clock::now();
  state->label = label;
  state->bytes = bytes;
  state->link = group.impl().link;
  state->kind = kind;
  state->group = group;
  if (group.size() > 1 && state->link && state->link->enabled())
    std::tie(state->link_start, state->link_done) = state->link->book(state->launched_at, bytes);
  if (group.size() > 1 && group.impl().timeline && group.impl().timeline->enabled()) {
    state->timeline = group.impl().timeline;
    state->launched_point = state->timeline->now();
    state->timeline->record(label, EventKind::launch, state->launched_point, state->launched_point);
  }
  if (group.size() > 1 && group.impl().counters) {
    state->counters = group.impl().counters;
    state->counters->add(kind, label, bytes);
  }
  return state;
}

AsyncHandle finished(const CommGroup& group, const std::string& label, CollectiveKind kind,
                     std::function<std::vector<at::Tensor>()> finish) {
  auto state = new_state(group, label, 0, kind);
  state->finish = std::move(finish);
  return AsyncHandle(std::move(state));
}

// Block layout of an all-to-all that leaves this rank's own block out of the backend: buffers are
// [G, ...] with the other ranks' blocks first, in rank order, and this rank's block last. The
// backend moves rows [0, G-1); the own block is written straight to where it is read from (the
// backend would otherwise copy it on its own thread, competing with the compute it overlaps).
struct BlockRows {
  int64_t rank, size;
  int64_t row_of(int64_t peer) const { return peer == rank ? size - 1 : (peer < rank ? peer : peer - 1); }
};

// All-to-all of rows [0, G-1) of send into rows [0, G-1) of receive (both [G, ...], contiguous,
// in BlockRows layout): one row to and from each other rank.
c10::intrusive_ptr<c10d::Work> all_to_all_others(const CommGroup& group, at::Tensor& send, at::Tensor& receive) {
  const int64_t g = group.size();
  at::Tensor send_wire = wire_view(send).narrow(0, 0, g - 1), receive_wire = wire_view(receive).narrow(0, 0, g - 1);
  std::vector<int64_t> splits(g, 1);
  splits[group.rank()] = 0;
  std::vector<int64_t> out_splits = splits, in_splits = splits;  // the backend may move them
  return group.impl().backend->alltoall_base(receive_wire, send_wire, out_splits, in_splits);
}

// Copies block j of every tensor in `blocked` (blocks along `block_dim`) into the row of rank j:
// send's row for the other ranks, receive's last row for this rank; the tensors sit side by side
// along the last dim (packed exchanges).
void pack_blocks(const std::vector<at::Tensor>& blocked, int64_t block_dim, const BlockRows& rows, at::Tensor& send,
                 at::Tensor& receive) {
  int64_t offset = 0;
  for (const auto& x : blocked) {
    const int64_t width = x.size(-1);
    for (int64_t j = 0; j < rows.size; ++j) {
      at::Tensor target = j == rows.rank ? receive[rows.size - 1] : send[rows.row_of(j)];
      target.narrow(-1, offset, width).copy_(x.select(block_dim, j));
    }
    offset += width;
  }
}

// The received blocks in source-rank order, concatenated along `dim`, split back into the packed
// tensors' widths.
std::vector<at::Tensor> unpack_by_source(const at::Tensor& receive, const BlockRows& rows, int64_t dim,
                                         const std::vector<int64_t>& widths) {
  std::vector<at::Tensor> by_source;
  for (int64_t j = 0; j < rows.size; ++j) by_source.push_back(receive[rows.row_of(j)]);
  return at::cat(by_source, dim).split_with_sizes(widths, -1);
}

// The all-to-all both Ulysses directions share: block j (index `block_dim` of each `blocked`
// tensor) of every tensor, side by side along the last dim, goes to rank j through send/receive
// buffers [G, B, S_l, Hc, sum D] in BlockRows layout (this rank's own block straight into its
// receive row); wait() unpacks the received blocks by source along `unpack_dim`.
AsyncHandle exchange_blocks(const CommGroup& group, const std::string& label, const std::vector<at::Tensor>& blocked,
                            int64_t block_dim, const std::vector<int64_t>& block_shape, int64_t unpack_dim,
                            const std::vector<int64_t>& widths) {
  const BlockRows rows{group.rank(), group.size()};
  std::vector<int64_t> buffer_shape{group.size()};
  buffer_shape.insert(buffer_shape.end(), block_shape.begin(), block_shape.end());
  at::Tensor send = at::empty(buffer_shape, blocked.front().options());
  at::Tensor receive = at::empty_like(send);
  pack_blocks(blocked, block_dim, rows, send, receive);
  const int64_t bytes = send.numel() * send.element_size() * (group.size() - 1) / group.size();
  auto state = new_state(group, label, bytes, CollectiveKind::all_to_all);
  state->work = all_to_all_others(group, send, receive);
  state->buffers = {send, receive};
  state->finish = [receive, rows, unpack_dim, widths] { return unpack_by_source(receive, rows, unpack_dim, widths); };
  return AsyncHandle(std::move(state));
}

void check_heads_divisible(const CommGroup& group, const at::Tensor& x, const std::string& label) {
  MLACP_REQUIRE(x.dim() == 4, kWhat, "Ulysses exchanges take [B, S, H, D] tensors",
                {got("label", label), got("shape", shape_text(x))}, "reshape to [batch, seq, heads, dim]");
  MLACP_REQUIRE(x.size(2) % group.size() == 0, kWhat, "heads must be divisible by the Ulysses group size",
                {got("label", label), got("heads", x.size(2)), got("group_size", group.size())},
                "choose a Ulysses degree that divides the local heads");
}

}  // namespace

AsyncHandle launch_seq_to_head_packed(const CommGroup& group, const std::vector<at::Tensor>& xs,
                                      const std::string& label) {
  const int64_t g = group.size();
  for (const auto& x : xs) check_heads_divisible(group, x, label);
  const at::Tensor& first = xs.front();
  const int64_t b = first.size(0), s = first.size(1), h = first.size(2), hc = h / g;
  std::vector<int64_t> widths;
  int64_t width = 0;
  for (const auto& x : xs) {
    MLACP_REQUIRE(x.size(0) == b && x.size(1) == s && x.size(2) == h && x.scalar_type() == first.scalar_type(),
                  kWhat, "packed tensors must share batch, seq, heads and dtype",
                  {got("label", label), got("first", shape_text(first)), got("other", shape_text(x))},
                  "exchange them separately");
    widths.push_back(x.size(3));
    width += x.size(3);
  }
  if (g == 1) {
    return finished(group, label, CollectiveKind::all_to_all, [xs] { return xs; });
  }
  // Head block j goes to rank j; received blocks [G, B, S_l, Hc, W] -> [B, G*S_l, Hc, W]:
  // tokens in source-rank order.
  std::vector<at::Tensor> blocked;
  for (const auto& x : xs) blocked.push_back(x.view({b, s, g, hc, x.size(3)}));
  return exchange_blocks(group, label, blocked, /*block_dim=*/2, {b, s, hc, width}, /*unpack_dim=*/1, widths);
}

AsyncHandle launch_seq_to_head(const CommGroup& group, const at::Tensor& x, const std::string& label) {
  return launch_seq_to_head_packed(group, {x}, label);
}

AsyncHandle launch_head_to_seq_packed(const CommGroup& group, const std::vector<at::Tensor>& xs,
                                      const std::string& label) {
  const int64_t g = group.size();
  const at::Tensor& first = xs.front();
  MLACP_REQUIRE(first.dim() == 4 && first.size(1) % g == 0, kWhat,
                "head->seq takes [B, G*S_l, Hc, D] with the sequence divisible by the group size",
                {got("label", label), got("shape", shape_text(first)), got("group_size", g)},
                "pass the attention output of this Ulysses group");
  const int64_t b = first.size(0), s = first.size(1) / g, hc = first.size(2);
  std::vector<int64_t> widths;
  int64_t width = 0;
  for (const auto& x : xs) {
    MLACP_REQUIRE(x.dim() == 4 && x.size(0) == b && x.size(1) == g * s && x.size(2) == hc &&
                      x.scalar_type() == first.scalar_type(),
                  kWhat, "packed tensors must share batch, seq, heads and dtype",
                  {got("label", label), got("first", shape_text(first)), got("other", shape_text(x))},
                  "exchange them separately");
    widths.push_back(x.size(3));
    width += x.size(3);
  }
  if (g == 1) {
    return finished(group, label, CollectiveKind::all_to_all, [xs] { return xs; });
  }
  // Sequence block j goes to its owner, rank j; received blocks [G, B, S_l, Hc, W] ->
  // [B, S_l, G*Hc, W]: heads in source-rank (head block) order.
  std::vector<at::Tensor> blocked;
  for (const auto& x : xs) blocked.push_back(x.view({b, g, s, hc, x.size(3)}));
  return exchange_blocks(group, label, blocked, /*block_dim=*/1, {b, s, hc, width}, /*unpack_dim=*/2, widths);
}

AsyncHandle launch_head_to_seq(const CommGroup& group, const at::Tensor& x, const std::string& label) {
  return launch_head_to_seq_packed(group, {x}, label);
}

AsyncHandle launch_all_gather_seq(const CommGroup& group, const at::Tensor& x, const std::string& label) {
  const int64_t g = group.size();
  MLACP_REQUIRE(x.dim() >= 2, kWhat, "all-gather along the sequence takes [B, S_l, ...]",
                {got("label", label), got("shape", shape_text(x))}, "add the batch dim");
  if (g == 1) return finished(group, label, CollectiveKind::all_gather, [x] { return std::vector<at::Tensor>{x}; });
  at::Tensor send = owned_contiguous(x);
  std::vector<int64_t> shape{g};
  for (int64_t d : x.sizes()) shape.push_back(d);
  at::Tensor receive = at::empty(shape, x.options());  // [G, B, S_l, ...]
  std::vector<at::Tensor> inputs{wire_view(send)};
  at::Tensor receive_wire = wire_view(receive);
  const int64_t bytes = send.numel() * send.element_size() * (g - 1);
  auto state = new_state(group, label, bytes, CollectiveKind::all_gather);
  if (group.backend_name() == "nccl") {
    // One flat buffer: NCCL writes the ranks' blocks in place (the list form copies them out).
    state->work = group.impl().backend->_allgather_base(receive_wire, inputs[0]);
  } else {
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (int64_t r = 0; r < g; ++r) outputs[0].push_back(receive_wire[r]);
    state->work = group.impl().backend->allgather(outputs, inputs);
  }
  state->buffers = {send, receive};
  state->finish = [receive, g] {
    // [G, B, S_l, ...] -> [B, G*S_l, ...]
    std::vector<int64_t> out_shape{receive.size(1), g * receive.size(2)};
    for (int64_t d = 3; d < receive.dim(); ++d) out_shape.push_back(receive.size(d));
    return std::vector<at::Tensor>{receive.transpose(0, 1).reshape(out_shape)};
  };
  return AsyncHandle(std::move(state));
}

AsyncHandle launch_reduce_scatter_seq(const CommGroup& group, const at::Tensor& x, const std::string& label) {
  const int64_t g = group.size();
  MLACP_REQUIRE(x.dim() >= 2 && x.size(1) % g == 0, kWhat,
                "reduce-scatter along the sequence takes [B, G*S_l, ...]",
                {got("label", label), got("shape", shape_text(x)), got("group_size", g)},
                "pass the gradient of an all-gathered tensor");
  if (g == 1) return finished(group, label, CollectiveKind::reduce_scatter, [x] { return std::vector<at::Tensor>{x}; });
  const auto out_dtype = x.scalar_type();
  const bool widen = out_dtype == at::kBFloat16 || out_dtype == at::kHalf;  // accumulate in float32
  std::vector<int64_t> split_shape{x.size(0), g, x.size(1) / g};
  for (int64_t d = 2; d < x.dim(); ++d) split_shape.push_back(x.size(d));
  // send [G(dest), B, S_l, ...] in BlockRows layout: block j of the sequence goes to rank j; this
  // rank's own block goes straight into its receive row.
  const BlockRows rows{group.rank(), g};
  at::Tensor blocks = x.reshape(split_shape);  // [B, G, S_l, ...]
  std::vector<int64_t> buffer_shape{g, x.size(0), x.size(1) / g};
  for (int64_t d = 2; d < x.dim(); ++d) buffer_shape.push_back(x.size(d));
  at::Tensor send = at::empty(buffer_shape, x.options().dtype(widen ? at::kFloat : out_dtype));
  at::Tensor receive = at::empty_like(send);  // [G(source), B, S_l, ...], BlockRows layout
  pack_blocks({blocks}, 1, rows, send, receive);
  const int64_t bytes = send.numel() * send.element_size() * (g - 1) / g;
  auto state = new_state(group, label, bytes, CollectiveKind::reduce_scatter);
  state->work = all_to_all_others(group, send, receive);
  state->buffers = {send, receive};
  state->finish = [receive, out_dtype, rows] {
    // Summed in source-rank order.
    at::Tensor total = receive[rows.row_of(0)].clone();
    for (int64_t j = 1; j < rows.size; ++j) total.add_(receive[rows.row_of(j)]);
    return std::vector<at::Tensor>{total.to(out_dtype)};
  };
  return AsyncHandle(std::move(state));
}

AsyncHandle launch_all_reduce_sum(const CommGroup& group, const at::Tensor& x, const std::string& label) {
  const int64_t g = group.size();
  if (g == 1) {
    return finished(group, label, CollectiveKind::all_reduce, [x] { return std::vector<at::Tensor>{x.clone()}; });
  }
  const auto out_dtype = x.scalar_type();
  const bool widen = out_dtype == at::kBFloat16 || out_dtype == at::kHalf;
  at::Tensor buffer = x.to(widen ? at::kFloat : out_dtype).contiguous().clone();
  std::vector<at::Tensor> tensors{buffer};
  // Ring all-reduce volume: 2 (G-1)/G of the buffer.
  const int64_t bytes = 2 * buffer.numel() * buffer.element_size() * (g - 1) / g;
  auto state = new_state(group, label, bytes, CollectiveKind::all_reduce);
  state->work = group.impl().backend->allreduce(tensors);
  state->buffers = {buffer};
  state->finish = [buffer, out_dtype] { return std::vector<at::Tensor>{buffer.to(out_dtype)}; };
  return AsyncHandle(std::move(state));
}

namespace {
// Control values (doubles, u64) cross on the group's device (NCCL moves device tensors only) and
// come back to the host: these collectives are waited at once and read on the host, so they
// belong before a step or after it, never inside one.
at::Tensor on_group_device(const CommGroup& group, const at::Tensor& host) {
  // device: control values are made and read on the host
  return group.device().is_cpu() ? host : host.to(group.device());
}

std::vector<double> all_reduce_doubles(const CommGroup& group, const std::vector<double>& values, c10d::ReduceOp op) {
  if (group.size() == 1 || values.empty()) return values;
  at::Tensor t = on_group_device(group, at::tensor(values, at::TensorOptions().dtype(at::kDouble)));
  std::vector<at::Tensor> tensors{t};
  c10d::AllreduceOptions options;
  options.reduceOp = op;
  wait_or_fault(group, group.impl().backend->allreduce(tensors, options), "all-reduce (max/min)");
  // device: control values are read on the host (before or after a step)
  const at::Tensor host = t.cpu();
  return std::vector<double>(host.data_ptr<double>(), host.data_ptr<double>() + host.numel());
}
}  // namespace

std::vector<double> all_reduce_max(const CommGroup& group, const std::vector<double>& values) {
  return all_reduce_doubles(group, values, c10d::ReduceOp::MAX);
}
std::vector<double> all_reduce_min(const CommGroup& group, const std::vector<double>& values) {
  return all_reduce_doubles(group, values, c10d::ReduceOp::MIN);
}

std::vector<uint64_t> all_gather_u64(const CommGroup& group, uint64_t value) {
  if (group.size() == 1) return {value};
  at::Tensor mine = on_group_device(group, at::full({1}, static_cast<int64_t>(value), at::kLong));
  at::Tensor all = at::empty({group.size()}, mine.options());
  std::vector<at::Tensor> inputs{mine};
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int64_t r = 0; r < group.size(); ++r) outputs[0].push_back(all.narrow(0, r, 1));
  wait_or_fault(group, group.impl().backend->allgather(outputs, inputs), "all-gather (u64)");
  // device: control values are read on the host (before or after a step)
  const at::Tensor host = all.cpu();
  std::vector<uint64_t> values;
  for (int64_t r = 0; r < group.size(); ++r) values.push_back(static_cast<uint64_t>(host.data_ptr<int64_t>()[r]));
  return values;
}

void barrier(const CommGroup& group) {
  if (group.size() > 1) wait_or_fault(group, group.impl().backend->barrier(), "barrier");
}

}  // namespace mlacp
