// The communication layer: process groups, asynchronous collectives over the sequence and head
// dims, byte counters and an emulated link. This folder is the only code that includes c10d
// headers; everything here is visible through tensors and plain types.
//
// Contract of every launch_* function:
//   - inputs are read at launch; every send buffer is made contiguous here (Gloo silently
//     corrupts non-contiguous all-to-all inputs);
//   - the returned AsyncHandle owns the c10d work, the send and receive buffers and the layout
//     restore; wait() may be called exactly once and returns the result in its documented layout;
//   - bf16/fp16 travel as 16-bit bit copies; reductions accumulate in float32;
//   - a group of size 1 moves nothing and counts nothing;
//   - tensors are on the group's device (CPU for Gloo groups, the rank's GPU for NCCL or Gloo-on-
//     CUDA groups). On a CUDA backend a launch enqueues on the collective's own stream and returns;
//     wait() makes the current stream wait for it without blocking the host (docs/DESIGN.md §16).
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace mlacp {

class Timeline;  // src/core/timeline.h: launches and waits are recorded there when enabled

enum class CollectiveKind { all_to_all, all_gather, reduce_scatter, all_reduce };
std::string collective_kind_name(CollectiveKind kind);

// Bytes this rank put on the wire, per collective kind (and per label, e.g. "qkv", "latent").
struct CommTotals {
  int64_t bytes = 0;
  int64_t calls = 0;
  double wire_seconds = 0.0;  // launch -> end of wait, summed (with an emulated link: at least the modelled time)
};
class CommCounters {
 public:
  void add(CollectiveKind kind, const std::string& label, int64_t bytes);
  void add_wire_time(CollectiveKind kind, const std::string& label, double seconds);
  void reset();
  CommTotals by_kind(CollectiveKind kind) const;
  const std::map<std::string, CommTotals>& by_label() const { return by_label_; }
  int64_t total_bytes() const;

 private:
  std::map<CollectiveKind, CommTotals> by_kind_;
  std::map<std::string, CommTotals> by_label_;
};

// A collective completes no earlier than latency + bytes / bandwidth after the link is free for
// it (see book()); waits sleep (not spin) until then. Zero bandwidth = infinite.
struct LinkModel {
  double latency_seconds = 0.0;
  double bandwidth_bytes_per_second = 0.0;
  bool enabled() const { return latency_seconds > 0.0 || bandwidth_bytes_per_second > 0.0; }
  double transfer_seconds(int64_t bytes) const;
  // One link per process, like one network interface: a transfer starts when the link is free
  // (after the transfers launched before it) and occupies it for transfer_seconds(bytes).
  // Returns {start, done} and books the link. Launches of one process come from one thread.
  std::pair<std::chrono::steady_clock::time_point, std::chrono::steady_clock::time_point> book(
      std::chrono::steady_clock::time_point launch, int64_t bytes);
  std::chrono::steady_clock::time_point busy_until{};
};

class AsyncHandle {
 public:
  AsyncHandle();
  AsyncHandle(AsyncHandle&&) noexcept;
  AsyncHandle& operator=(AsyncHandle&&) noexcept;
  ~AsyncHandle();
  // Waits for the collective and returns its results (in restored layout). Second call throws.
  std::vector<at::Tensor> wait();
  at::Tensor wait_one();  // for single-result collectives
  bool valid() const;     // launched and not yet waited
  int64_t bytes() const;
  const std::string& label() const;

  struct State;
  explicit AsyncHandle(std::unique_ptr<State> state);

 private:
  std::unique_ptr<State> state_;
};

// One 1-D process group (a c10d backend) with its rank, size, counters and link model.
class CommGroup {
 public:
  CommGroup() = default;
  int64_t rank() const;
  int64_t size() const;
  const std::string& name() const;
  // The device its tensors live on (CPU for a Gloo group over CPU tensors, a GPU otherwise) and
  // the backend's name ("gloo", "nccl"; "none" for a group of size 1).
  const c10::Device& device() const;
  const std::string& backend_name() const;
  // True the first time it is asked with `key` on this group (its copies share the answer): a
  // check that reads a device value, run once per group instead of every step.
  bool first_time(const std::string& key) const;
  bool defined() const { return static_cast<bool>(impl_); }

  struct Impl;
  explicit CommGroup(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  Impl& impl() const { return *impl_; }

 private:
  std::shared_ptr<Impl> impl_;
};

// --- collectives ----------------------------------------------------------------------------
// Ulysses seq->head: x [B, S_l, H, D] -> [B, G*S_l, H/G, D], tokens in source-rank order,
// this rank's head block [rank*H/G, (rank+1)*H/G).
AsyncHandle launch_seq_to_head(const CommGroup& group, const at::Tensor& x, const std::string& label);
// One packed exchange of tensors [B, S_l, H, D_i] with unequal D_i; wait() returns each
// [B, G*S_l, H/G, D_i].
AsyncHandle launch_seq_to_head_packed(const CommGroup& group, const std::vector<at::Tensor>& xs,
                                      const std::string& label);
// Ulysses head->seq (exact inverse): x [B, G*S_l, Hc, D] -> [B, S_l, G*Hc, D].
AsyncHandle launch_head_to_seq(const CommGroup& group, const at::Tensor& x, const std::string& label);
AsyncHandle launch_head_to_seq_packed(const CommGroup& group, const std::vector<at::Tensor>& xs,
                                      const std::string& label);
// All-gather along the sequence: x [B, S_l, ...] -> [B, G*S_l, ...] in group-rank order.
AsyncHandle launch_all_gather_seq(const CommGroup& group, const at::Tensor& x, const std::string& label);
// Reduce-scatter (sum) along the sequence: x [B, G*S_l, ...] -> [B, S_l, ...], this rank's
// block, summed over the group. Moves (G-1)/G of x, not a full all-reduce.
AsyncHandle launch_reduce_scatter_seq(const CommGroup& group, const at::Tensor& x, const std::string& label);
// All-reduce (sum), any shape; bf16/fp16 accumulate in float32. Returns a new tensor.
AsyncHandle launch_all_reduce_sum(const CommGroup& group, const at::Tensor& x, const std::string& label);
// All-reduce (max / min) of doubles, waited at once: for error reports, agreement checks and
// combining per-rank measurements.
std::vector<double> all_reduce_max(const CommGroup& group, const std::vector<double>& values);
std::vector<double> all_reduce_min(const CommGroup& group, const std::vector<double>& values);
// Exchanges one uint64 per rank (e.g. plan fingerprints): returns every rank's value.
std::vector<uint64_t> all_gather_u64(const CommGroup& group, uint64_t value);
void barrier(const CommGroup& group);

// --- groups ---------------------------------------------------------------------------------
// torchrun's variables: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (the node's
// rank), MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE; c10d's GLOO_SOCKET_IFNAME; and MLACP_RENDEZVOUS_FILE, set by
// mlacp's local launcher (--nproc): the ranks then meet over a FileStore in the launcher's private
// folder, and nothing listens on a network port.
struct WorldInfo {
  int64_t rank = 0;
  int64_t size = 1;
  int64_t local_rank = 0;
  int64_t local_world_size = 0;  // ranks on this host (LOCAL_WORLD_SIZE); 0: not given
  int64_t node_rank = -1;        // torchrun's GROUP_RANK; -1: not given
  std::string master_addr = "127.0.0.1";
  int port = 29500;
  std::string store_file;  // non-empty: rendezvous over this FileStore instead of TCP
  // torchrun's agent serves the store at MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True):
  // every rank connects to it as a client; otherwise rank 0 serves it.
  bool agent_store = false;
  // The interfaces Gloo binds (GLOO_SOCKET_IFNAME, comma-separated); empty: the one on the route to
  // MASTER_ADDR (docs/DESIGN.md §2 "Several hosts").
  std::string interfaces;
};
// Reads the variables; throws mlacp::Error naming a missing or malformed one.
WorldInfo world_from_env();

// Which host each rank runs on, learnt at the rendezvous (every rank reports where it runs before
// any group is built) and identical on every rank. A host is torchrun's node (GROUP_RANK) where
// it is set, else the address a rank's Gloo device binds together with the host's name.
struct Topology {
  std::vector<int64_t> host_of_rank;    // world rank -> host index (hosts numbered by their first rank)
  std::vector<std::string> host_names;  // host index -> "10.0.0.2 (node 1)", as its ranks reported it
  std::vector<std::string> host_addresses;  // host index -> the address its first rank's Gloo device binds
  int64_t hosts() const { return static_cast<int64_t>(host_names.size()); }
  bool one_host(const std::vector<int64_t>& world_ranks) const;  // every one of them on one host
  std::vector<int64_t> ranks_on(int64_t host) const;
  std::string describe() const;  // "2 hosts: 10.0.0.1 (node 0) ranks [0, 1] | 10.0.0.2 (node 1) ranks [2, 3]"
};

struct MeshShape {
  int64_t dp = 1;
  int64_t cp = 1;
  int64_t tp = 1;
  int64_t ulysses = 0;  // 0 = cp (pure Ulysses)
};

// World = dp x cp x tp, TP innermost: world_rank = (dp_rank * cp + cp_rank) * tp + tp_rank.
// The CP group's A x U grid: Ulysses groups are U consecutive CP ranks, all-gather groups are
// {u, u+U, u+2U, ...}.
// What observes the collectives of one set of groups (shared by all its groups): byte counters,
// the emulated link, the timeline. Not part of the groups' identity: a trainer never needs them,
// the checks and the bench read them.
struct Instruments {
  std::shared_ptr<CommCounters> counters;
  std::shared_ptr<LinkModel> link;
  std::shared_ptr<Timeline> timeline;
};

struct ParallelGroups {
  WorldInfo world_info;
  MeshShape shape;
  int64_t dp_rank = 0, cp_rank = 0, tp_rank = 0;
  CommGroup world, dp, cp, tp, ulysses, all_gather;
  Instruments instruments;
  Topology topology;
  std::string describe() const;  // the rank order and, on several hosts, which groups cross them
};

// The Ulysses degree a shape with ulysses == 0 gets: P on one host; on several, the largest U
// dividing P whose Ulysses groups (U consecutive CP ranks) each lie on one host, so the
// all-to-alls stay inside hosts and the all-gathers cross them.
int64_t host_local_ulysses(const MeshShape& shape, const Topology& topology);
// The world ranks of every Ulysses group (or every all-gather group) of the shape.
std::vector<std::vector<int64_t>> ulysses_groups(const MeshShape& shape);
std::vector<std::vector<int64_t>> all_gather_groups(const MeshShape& shape);

// Which c10d backend moves a group's tensors. automatic: Gloo for CPU tensors, NCCL for CUDA
// tensors. gloo on a CUDA device: Gloo's CUDA path (it stages through host memory): slower, but it
// runs several ranks on one GPU, which NCCL refuses.
enum class CommBackend { automatic, gloo, nccl };
std::string comm_backend_name(CommBackend backend);
CommBackend parse_comm_backend(const std::string& name);

struct GroupOptions {
  std::chrono::milliseconds timeout{60000};  // a dead peer is an error after this
  // Called from a watchdog thread with the fault when building a set of groups takes longer than
  // `timeout` (a peer died while they connect: c10d's connect cannot be interrupted, and each of
  // the six groups would wait its own timeout). The tool prints it and ends the process; unset,
  // there is no watchdog (library code never exits).
  std::function<void(const std::string& message)> on_group_timeout;
  LinkModel link;  // the emulated link: host-timed (CPU) groups only
  // device: the default; tools and bindings set the rank's device
  c10::Device device{c10::DeviceType::CPU};  // where the groups' tensors live: this rank's GPU for CUDA
  CommBackend backend = CommBackend::automatic;
};
// The options' rules (CPU or CUDA tensors; NCCL moves CUDA tensors only; the emulated link is
// CPU-only; NCCL where this LibTorch has it). Rendezvous::groups checks them before connecting;
// a launcher calls it before starting any rank. Throws mlacp::Error naming the rule.
void check_group_options(const GroupOptions& options);

// One store shared by every set of groups a process builds (rank 0 serves the TCP store).
// groups() validates the shape against the world size before any collective, then builds a fresh
// set of groups under its own store prefix: call it in the same order on every rank.
class Rendezvous {
 public:
  static Rendezvous tcp(const WorldInfo& world, std::chrono::milliseconds timeout);
  static Rendezvous file(const std::string& path, const WorldInfo& world, std::chrono::milliseconds timeout);
  // world.store_file ? file(...) : tcp(...): what the tool's commands use.
  static Rendezvous of(const WorldInfo& world, std::chrono::milliseconds timeout);
  ParallelGroups groups(const MeshShape& shape, const GroupOptions& options);
  const WorldInfo& world() const;
  const Topology& topology() const;

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

// One-shot forms: a rendezvous used for a single set of groups.
ParallelGroups create_parallel_groups(const WorldInfo& world, const MeshShape& shape, const GroupOptions& options);
// Same over a FileStore (tests; the file must not exist before rank 0 starts).
ParallelGroups create_parallel_groups_file(const std::string& path, const WorldInfo& world, const MeshShape& shape,
                                           const GroupOptions& options);
// Checks dp*cp*tp == world size and cp % ulysses == 0; throws mlacp::Error otherwise.
void check_mesh_shape(const MeshShape& shape, int64_t world_size);

}  // namespace mlacp
