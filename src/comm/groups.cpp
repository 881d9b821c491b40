// Rendezvous and group construction: one store, one prefix per group, created in the same order
// on every rank (each rank builds only the groups it belongs to). Every rank first reports where it
// runs (the roll call), so the groups know the hosts (docs/DESIGN.md §2 "Several hosts").
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "comm/backend.h"
#include "comm/hosts.h"
#include "comm/quiet_log.h"
#include "mlacp/errors.h"

namespace mlacp {
namespace {

constexpr const char* kWhat = "process groups";

std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

bool contains_nocase(std::string text, const std::string& lower_needle) {
  for (char& c : text) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return text.find(lower_needle) != std::string::npos;
}

int64_t env_int(const char* name, bool required, int64_t fallback) {
  const char* text = std::getenv(name);
  if (!text) {
    MLACP_REQUIRE(!required, kWhat, "environment variable is not set", {got("variable", name)},
                  "launch with torchrun, or use mlacp's --nproc N local launcher");
    return fallback;
  }
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  MLACP_REQUIRE(end != text && *end == '\0' && value >= 0, kWhat, "environment variable must be an integer >= 0",
                {got("variable", name), got("value", text)}, "fix the launcher's environment");
  return value;
}

// The backend a group's tensors take (GroupOptions): Gloo for CPU tensors, NCCL for CUDA ones,
// Gloo's CUDA path when asked (several ranks on one GPU).
std::string backend_for(const GroupOptions& options) {
  // device: Gloo moves CPU tensors
  if (options.device.is_cpu()) return "gloo";
  return options.backend == CommBackend::gloo ? "gloo" : "nccl";
}

// MASTER_ADDR must name a host this one can resolve (c10d's store would retry a name that does
// not until the timeout): an input error, or a fault when the resolver itself did not answer.
void check_master_addr(const WorldInfo& world) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = world.master_addr.empty() ? EAI_NONAME : getaddrinfo(world.master_addr.c_str(), nullptr, &hints, &found);
  if (found) freeaddrinfo(found);
  if (rc == 0) return;
  std::vector<ErrorValue> values{got("MASTER_ADDR", world.master_addr), got("rank", world.rank),
                                 got("cause", world.master_addr.empty() ? "empty" : gai_strerror(rc))};
  if (rc == EAI_AGAIN)
    fail_fault(kWhat, "MASTER_ADDR could not be resolved: the name resolver did not answer", values,
               "check this host's network and DNS, or set MASTER_ADDR to rank 0's IP address");
  fail(kWhat, "MASTER_ADDR must be a host name or address that resolves on this host", values,
       "set MASTER_ADDR to rank 0's host name or IP address (127.0.0.1 when every rank runs on this host)");
}

}  // namespace

// Every rule of the options, before any rank connects (the same on every rank).
void check_group_options(const GroupOptions& options) {
  const std::string backend = backend_for(options);
  // device: the backends mlacp builds: Gloo (CPU, CUDA) and NCCL (CUDA)
  MLACP_REQUIRE(options.device.is_cpu() || options.device.is_cuda(), kWhat,
                "process groups move CPU or CUDA tensors", {got("device", options.device)},
                "use --device cpu or --device cuda");
  // device: NCCL moves CUDA tensors only
  MLACP_REQUIRE(!(options.device.is_cpu() && options.backend == CommBackend::nccl), kWhat,
                "NCCL moves CUDA tensors only", {got("device", options.device), got("backend", "nccl")},
                "use --device cuda with --backend nccl, or --backend gloo (auto) for CPU tensors");
  // device: the emulated link sleeps on the host
  MLACP_REQUIRE(options.device.is_cpu() || !options.link.enabled(), kWhat,
                "the emulated link is host-timed and serves CPU groups only",
                {got("device", options.device), got("latency_s", options.link.latency_seconds),
                 got("bandwidth_bytes_per_s", options.link.bandwidth_bytes_per_second)},
                "drop --bandwidth-gbps/--latency-us/--auto-link on a GPU: its link is real");
#ifndef USE_C10D_NCCL
  MLACP_REQUIRE(backend != "nccl", kWhat, "CUDA tensors over NCCL need a LibTorch with c10d NCCL, and this one has none",
                {got("device", options.device), got("libtorch", TORCH_VERSION)},
                "build against the CUDA wheel of PyTorch 2.x, or pass --backend gloo");
#endif
}

namespace {

c10::intrusive_ptr<C10dBackend> make_backend(const c10::intrusive_ptr<c10d::Store>& store, int64_t rank,
                                             int64_t size, const GroupOptions& options, const GlooEndpoint& endpoint) {
#ifdef USE_C10D_NCCL
  if (backend_for(options) == "nccl") {
    auto nccl = c10d::ProcessGroupNCCL::Options::create();
    nccl->timeout = options.timeout;
    auto group = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, static_cast<int>(rank), static_cast<int>(size), nccl);
    // The rank's GPU for every communicator of the group (NCCL would otherwise guess it from the
    // group rank, which is not the local rank for sub-groups).
    group->setBoundDeviceId(options.device);
    return group;
  }
#endif
  auto gloo = c10d::ProcessGroupGloo::Options::create(options.timeout);
  // The interfaces named (GLOO_SOCKET_IFNAME, --iface), else the address on the route to MASTER_ADDR
  // (127.0.0.1 for a local launch): peers on other hosts dial what this device binds.
  for (const std::string& name : endpoint.interfaces)
    gloo->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(name));
  if (endpoint.interfaces.empty()) gloo->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(endpoint.address));
  gloo->threads = 2;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, static_cast<int>(rank), static_cast<int>(size), gloo);
}

struct GroupContext {
  const GroupOptions& options;
  const Instruments& instruments;
  const GlooEndpoint& endpoint;
  std::shared_ptr<const Topology> topology;
};

// Builds the group of `members` (world ranks) if this rank is one of them.
CommGroup make_group(const c10::intrusive_ptr<c10d::Store>& store, const std::string& name,
                     const std::vector<int64_t>& members, int64_t world_rank, const GroupContext& ctx) {
  const GroupOptions& options = ctx.options;
  const Instruments& instruments = ctx.instruments;
  auto impl = std::make_shared<CommGroup::Impl>();
  impl->members = members;
  impl->world_rank = world_rank;
  impl->topology = ctx.topology;
  impl->size = static_cast<int64_t>(members.size());
  impl->name = name;
  impl->counters = instruments.counters;
  impl->link = instruments.link;
  impl->timeline = instruments.timeline;
  impl->timeout = options.timeout;
  impl->device = options.device;
  for (size_t i = 0; i < members.size(); ++i)
    if (members[i] == world_rank) impl->rank = static_cast<int64_t>(i);
  if (impl->size > 1) {
    std::string prefix = name + "/";
    for (int64_t m : members) prefix += std::to_string(m) + ",";
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(prefix, store);
    try {
      const QuietC10dLog quiet;  // 2.x's store client logs each timed-out wait for a missing rank
      impl->backend = make_backend(prefixed, impl->rank, impl->size, options, ctx.endpoint);
      impl->backend_name = backend_for(options);
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {  // a rank that never came, or a connection refused
      std::vector<ErrorValue> values{got("group", name), got("group_size", impl->size), got("world_rank", world_rank),
                                     got("timeout_s", static_cast<double>(options.timeout.count()) / 1000.0)};
      const std::string others = other_hosts_of(*ctx.topology, world_rank, members);
      if (!others.empty()) values.push_back(got("members_on_other_hosts", others));
      values.push_back(got("cause", first_line(e.what())));
      fail_fault(kWhat, "not every rank of the group arrived within the timeout", values,
                 "start every rank (WORLD_SIZE of them) with the same MASTER_ADDR and MASTER_PORT; raise --timeout "
                 "if some start late");
    }
  }
  return CommGroup(impl);
}

ParallelGroups build_groups(const c10::intrusive_ptr<c10d::Store>& base_store, const std::string& generation,
                            const WorldInfo& world, const MeshShape& requested, const GroupOptions& options,
                            const GlooEndpoint& endpoint, const std::shared_ptr<const Topology>& topology) {
  auto store = c10::make_intrusive<c10d::PrefixStore>(generation, base_store);
  ParallelGroups g;
  g.world_info = world;
  g.topology = *topology;
  g.shape = requested;
  if (g.shape.ulysses == 0) g.shape.ulysses = host_local_ulysses(g.shape, *topology);
  const MeshShape& s = g.shape;
  g.instruments.counters = std::make_shared<CommCounters>();
  g.instruments.link = std::make_shared<LinkModel>(options.link);
  g.instruments.timeline = std::make_shared<Timeline>();
  g.instruments.timeline->set_device(options.device);  // spans timed where the tensors are
  const int64_t r = world.rank;
  g.tp_rank = r % s.tp;
  g.cp_rank = (r / s.tp) % s.cp;
  g.dp_rank = r / (s.tp * s.cp);
  auto world_rank = [&](int64_t dp, int64_t cp, int64_t tp) { return (dp * s.cp + cp) * s.tp + tp; };
  std::vector<int64_t> all, dp_members, cp_members, tp_members, ulysses_members, gather_members;
  for (int64_t i = 0; i < world.size; ++i) all.push_back(i);
  for (int64_t d = 0; d < s.dp; ++d) dp_members.push_back(world_rank(d, g.cp_rank, g.tp_rank));
  for (int64_t c = 0; c < s.cp; ++c) cp_members.push_back(world_rank(g.dp_rank, c, g.tp_rank));
  for (int64_t t = 0; t < s.tp; ++t) tp_members.push_back(world_rank(g.dp_rank, g.cp_rank, t));
  const int64_t u = s.ulysses, a = g.cp_rank / u;
  for (int64_t j = 0; j < u; ++j) ulysses_members.push_back(world_rank(g.dp_rank, a * u + j, g.tp_rank));
  for (int64_t i = 0; i < s.cp / u; ++i) gather_members.push_back(world_rank(g.dp_rank, i * u + g.cp_rank % u, g.tp_rank));
  // Every group of the set within one --timeout: a peer that dies while they connect would
  // otherwise cost each remaining group its own timeout (c10d's connect cannot be interrupted:
  // the caller's callback ends the process).
  std::unique_ptr<Watchdog> watchdog;
  if (options.on_group_timeout) {
    std::string message = Error(kWhat, "the ranks did not finish connecting their groups within the timeout",
                                {got("world_rank", r), got("timeout_s", static_cast<double>(options.timeout.count()) / 1000.0),
                                 got("hosts", topology->describe())},
                                "a peer exited or stalled while the groups connected: the launcher names the rank that "
                                "failed first; raise --timeout if a rank is only slow", ErrorKind::fault)
                              .what();
    watchdog = std::make_unique<Watchdog>(options.timeout, [callback = options.on_group_timeout, message] { callback(message); });
  }
  const GroupContext ctx{options, g.instruments, endpoint, topology};
  g.world = make_group(store, "world", all, r, ctx);
  g.dp = make_group(store, "dp", dp_members, r, ctx);
  g.cp = make_group(store, "cp", cp_members, r, ctx);
  g.tp = make_group(store, "tp", tp_members, r, ctx);
  g.ulysses = make_group(store, "ulysses", ulysses_members, r, ctx);
  g.all_gather = make_group(store, "all_gather", gather_members, r, ctx);
  // Nobody leaves before every peer has finished connecting (a rank that exits right after
  // creation would otherwise break a peer's half-built connection).
  barrier(g.world);
  return g;
}

}  // namespace

std::string comm_backend_name(CommBackend backend) {
  switch (backend) {
    case CommBackend::automatic: return "auto";
    case CommBackend::gloo: return "gloo";
    case CommBackend::nccl: return "nccl";
  }
  return "?";
}

CommBackend parse_comm_backend(const std::string& name) {
  if (name == "auto") return CommBackend::automatic;
  if (name == "gloo") return CommBackend::gloo;
  if (name == "nccl") return CommBackend::nccl;
  fail(kWhat, "the communication backend must be auto, gloo or nccl", {got("backend", name)},
       "auto takes Gloo for CPU tensors and NCCL for CUDA tensors; gloo on CUDA runs several ranks on one GPU");
}

WorldInfo world_from_env() {
  WorldInfo w;
  w.rank = env_int("RANK", true, 0);
  w.size = env_int("WORLD_SIZE", true, 1);
  w.local_rank = env_int("LOCAL_RANK", false, w.rank);
  w.local_world_size = env_int("LOCAL_WORLD_SIZE", false, 0);
  w.node_rank = std::getenv("GROUP_RANK") ? env_int("GROUP_RANK", true, 0) : -1;
  if (const char* names = std::getenv("GLOO_SOCKET_IFNAME")) w.interfaces = names;
  if (const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE")) w.agent_store = std::string(agent) == "True";
  const char* addr = std::getenv("MASTER_ADDR");
  w.master_addr = addr ? addr : "127.0.0.1";
  if (const char* file = std::getenv("MLACP_RENDEZVOUS_FILE")) w.store_file = file;
  w.port = static_cast<int>(env_int("MASTER_PORT", w.size > 1 && w.store_file.empty(), 29500));
  MLACP_REQUIRE(w.port >= 1 && w.port <= 65535, kWhat, "MASTER_PORT must be a TCP port in [1, 65535]",
                {got("MASTER_PORT", w.port)}, "pick a free port, e.g. 29500");
  MLACP_REQUIRE(w.size >= 1 && w.rank < w.size, kWhat, "RANK must be below WORLD_SIZE",
                {got("RANK", w.rank), got("WORLD_SIZE", w.size)}, "fix the launcher's environment");
  MLACP_REQUIRE(!std::getenv("LOCAL_WORLD_SIZE") || (w.local_world_size >= 1 && w.local_world_size <= w.size &&
                                                     w.local_rank < w.local_world_size),
                kWhat, "LOCAL_RANK must be below LOCAL_WORLD_SIZE, and LOCAL_WORLD_SIZE at most WORLD_SIZE",
                {got("LOCAL_RANK", w.local_rank), got("LOCAL_WORLD_SIZE", w.local_world_size), got("WORLD_SIZE", w.size)},
                "fix the launcher's environment (torchrun sets all three)");
  return w;
}

namespace {

// The world ranks of the CP grid's groups of one kind (docs/DESIGN.md §2): Ulysses groups are U
// consecutive CP ranks, all-gather groups every U-th one; one set per (dp, tp) pair.
std::vector<std::vector<int64_t>> grid_groups(const MeshShape& s, bool ulysses) {
  const int64_t u = s.ulysses == 0 ? s.cp : s.ulysses, a = s.cp / u;
  std::vector<std::vector<int64_t>> groups;
  for (int64_t d = 0; d < s.dp; ++d)
    for (int64_t t = 0; t < s.tp; ++t)
      for (int64_t g = 0; g < (ulysses ? a : u); ++g) {
        std::vector<int64_t> members;
        for (int64_t m = 0; m < (ulysses ? u : a); ++m)
          members.push_back((d * s.cp + (ulysses ? g * u + m : m * u + g)) * s.tp + t);
        groups.push_back(members);
      }
  return groups;
}

}  // namespace

std::vector<std::vector<int64_t>> ulysses_groups(const MeshShape& s) { return grid_groups(s, true); }
std::vector<std::vector<int64_t>> all_gather_groups(const MeshShape& s) { return grid_groups(s, false); }

int64_t host_local_ulysses(const MeshShape& shape, const Topology& topology) {
  if (topology.hosts() <= 1) return shape.cp;
  for (int64_t u = shape.cp; u > 1; --u) {
    if (shape.cp % u != 0) continue;
    MeshShape s = shape;
    s.ulysses = u;
    bool inside = true;
    for (const auto& members : ulysses_groups(s)) inside = inside && topology.one_host(members);
    if (inside) return u;
  }
  return 1;
}

void check_mesh_shape(const MeshShape& s, int64_t world_size) {
  MLACP_REQUIRE(s.dp >= 1 && s.cp >= 1 && s.tp >= 1, kWhat, "dp, cp and tp degrees must be >= 1",
                {got("dp", s.dp), got("cp", s.cp), got("tp", s.tp)}, "use 1 for an unused dimension");
  MLACP_REQUIRE(s.dp * s.cp * s.tp == world_size, kWhat, "dp * cp * tp must equal the world size",
                {got("dp", s.dp), got("cp", s.cp), got("tp", s.tp), got("world_size", world_size)},
                "adjust the degrees or the number of processes (--nproc)");
  const int64_t u = s.ulysses == 0 ? s.cp : s.ulysses;
  MLACP_REQUIRE(u >= 1 && s.cp % u == 0, kWhat, "cp degree must be divisible by the ulysses degree",
                {got("cp", s.cp), got("ulysses", u)}, "choose U dividing P");
}

struct Rendezvous::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  WorldInfo world;
  GlooEndpoint endpoint;
  std::shared_ptr<const Topology> topology;
  int64_t generation = 0;
};

namespace {

#if TORCH_VERSION_MAJOR >= 2
// 2.x: rank 0's store listens on MASTER_ADDR only (c10d would listen on every interface): the
// socket is made here and handed to the TCPStore. -1 where it cannot be (errno set).
int listen_on_master_addr(const WorldInfo& world) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(world.master_addr.c_str(), std::to_string(world.port).c_str(), &hints, &found) != 0) return -1;
  int fd = -1, error = 0;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int on = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, 2048) != 0) {
      error = errno;
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  if (fd < 0) errno = error;
  return fd;
}
#endif

void meet(Rendezvous::Impl& impl, std::chrono::milliseconds timeout, std::chrono::steady_clock::time_point deadline) {
  impl.topology = std::make_shared<const Topology>(roll_call(*impl.store, impl.world, impl.endpoint, deadline, timeout));
}

}  // namespace

Rendezvous Rendezvous::tcp(const WorldInfo& world, std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<std::uint16_t>(world.port);
  store_options.isServer = world.rank == 0 && !world.agent_store;  // under torchrun its agent serves it
  store_options.numWorkers = static_cast<size_t>(world.size);
  store_options.timeout = timeout;
  // Rank 0 does not wait here for the others to connect: the groups' own rendezvous waits for
  // them, so a missing rank costs one --timeout, not two.
  store_options.waitWorkers = false;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  check_master_addr(world);
  Rendezvous r;
  r.impl_ = std::make_shared<Impl>();
  r.impl_->endpoint = gloo_endpoint(world);
#if TORCH_VERSION_MAJOR >= 2
  if (store_options.isServer) {
    const int fd = listen_on_master_addr(world);
    if (fd < 0 && errno == EADDRNOTAVAIL)
      fail(kWhat, "rank 0 serves the rendezvous store on MASTER_ADDR, so it must run on that host",
           {got("MASTER_ADDR", world.master_addr), got("MASTER_PORT", world.port), got("rank", world.rank)},
           "set MASTER_ADDR to an address of rank 0's host (torchrun: the --master_addr of node 0)");
    if (fd < 0 && errno == EADDRINUSE)
      fail(kWhat, "rank 0 cannot serve the rendezvous store: MASTER_PORT is taken on this host",
           {got("MASTER_ADDR", world.master_addr), got("MASTER_PORT", world.port), got("rank", world.rank),
            got("cause", std::strerror(EADDRINUSE))},
           "pick a free MASTER_PORT (mlacp's own --nproc launcher needs none)");
    if (fd >= 0) store_options.masterListenFd = fd;
  }
#endif
  try {
    const QuietC10dLog quiet;
    r.impl_->store = c10::make_intrusive<c10d::TCPStore>(world.master_addr, store_options);
  } catch (const std::exception& e) {
    const std::string cause = first_line(e.what());
    const std::vector<ErrorValue> values{got("MASTER_ADDR", world.master_addr), got("MASTER_PORT", world.port),
                                         got("rank", world.rank), got("cause", cause)};
    if (store_options.isServer && (contains_nocase(e.what(), "address already in use") ||
                            contains_nocase(e.what(), "failed to listen") || contains_nocase(e.what(), "eaddrinuse")))
      fail(kWhat, "rank 0 cannot serve the rendezvous store: MASTER_PORT is taken on this host", values,
           "pick a free MASTER_PORT (mlacp's own --nproc launcher needs none)");
    fail_fault(kWhat, "the rendezvous store at MASTER_ADDR:MASTER_PORT could not be reached within the timeout",
               {got("MASTER_ADDR", world.master_addr), got("MASTER_PORT", world.port), got("rank", world.rank),
                got("timeout_s", static_cast<double>(timeout.count()) / 1000.0), got("cause", cause)},
               "start rank 0 (it serves the store) and check MASTER_ADDR and MASTER_PORT");
  }
  r.impl_->world = world;
  meet(*r.impl_, timeout, deadline);
  return r;
}

Rendezvous Rendezvous::file(const std::string& path, const WorldInfo& world, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  Rendezvous r;
  r.impl_ = std::make_shared<Impl>();
  WorldInfo local = world;
  local.store_file = path;  // a FileStore: the ranks share this host
  auto store = c10::make_intrusive<c10d::FileStore>(path, static_cast<int>(world.size));
  store->setTimeout(timeout);
  r.impl_->store = store;
  r.impl_->world = local;
  r.impl_->endpoint = gloo_endpoint(local);
  meet(*r.impl_, timeout, deadline);
  return r;
}

Rendezvous Rendezvous::of(const WorldInfo& world, std::chrono::milliseconds timeout) {
  return world.store_file.empty() ? tcp(world, timeout) : file(world.store_file, world, timeout);
}

ParallelGroups Rendezvous::groups(const MeshShape& shape, const GroupOptions& options) {
  check_mesh_shape(shape, impl_->world.size);
  check_group_options(options);
  const std::string generation = "g" + std::to_string(impl_->generation++) + "/";
  return build_groups(impl_->store, generation, impl_->world, shape, options, impl_->endpoint, impl_->topology);
}

const WorldInfo& Rendezvous::world() const { return impl_->world; }
const Topology& Rendezvous::topology() const { return *impl_->topology; }

ParallelGroups create_parallel_groups(const WorldInfo& world, const MeshShape& shape, const GroupOptions& options) {
  check_mesh_shape(shape, world.size);
  check_group_options(options);  // before the rendezvous: a rule never waits for the peers
  return Rendezvous::of(world, options.timeout).groups(shape, options);
}

ParallelGroups create_parallel_groups_file(const std::string& path, const WorldInfo& world, const MeshShape& shape,
                                           const GroupOptions& options) {
  check_mesh_shape(shape, world.size);
  check_group_options(options);
  return Rendezvous::file(path, world, options.timeout).groups(shape, options);
}

std::string ParallelGroups::describe() const {
  std::ostringstream out;
  out << "world " << world_info.size << " = dp " << shape.dp << " x cp " << shape.cp << " x tp " << shape.tp
      << " (TP innermost: world_rank = (dp_rank*cp + cp_rank)*tp + tp_rank); CP grid A " << shape.cp / shape.ulysses
      << " x U " << shape.ulysses << " (Ulysses groups: U consecutive CP ranks)";
  if (topology.hosts() > 1) {
    auto crossing = [&](const std::vector<std::vector<int64_t>>& groups) {
      int64_t n = 0;
      for (const auto& members : groups) n += topology.one_host(members) ? 0 : 1;
      return n;
    };
    const int64_t a2a = shape.ulysses > 1 ? crossing(ulysses_groups(shape)) : 0;
    const int64_t gathers = shape.ulysses < shape.cp ? crossing(all_gather_groups(shape)) : 0;
    out << "; " << topology.describe() << "; "
        << (a2a > 0 ? "the Ulysses all-to-alls CROSS hosts (" + std::to_string(a2a) + " groups)"
                    : shape.ulysses > 1 ? std::string("the Ulysses all-to-alls stay inside hosts")
                                        : std::string("no Ulysses all-to-all"))
        << ", " << (gathers > 0 ? "the all-gathers cross hosts" : "no all-gather crosses hosts");
  }
  return out.str();
}

}  // namespace mlacp
