// Process groups: mesh-shape validation, torchrun's environment, the dp x cp x tp rank order
// across 8 real processes, and a dead peer turning into an error instead of a hang.
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "core/timeline.h"
#include "support/error_of.h"
#include "mlacp/comm.h"
#include "mlacp/errors.h"
#include "support/multiprocess.h"

namespace mlacp {
namespace {

using test::make_groups;
using test::run_ranks;

using test::error_of;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

MeshShape mesh(int64_t dp, int64_t cp, int64_t tp, int64_t ulysses = 0) {
  MeshShape s;
  s.dp = dp;
  s.cp = cp;
  s.tp = tp;
  s.ulysses = ulysses;
  return s;
}

// --- check_mesh_shape ------------------------------------------------------------------------
TEST(MeshShapeCheck, AcceptsShapesThatFitTheWorld) {
  EXPECT_NO_THROW(check_mesh_shape(mesh(1, 1, 1), 1));
  EXPECT_NO_THROW(check_mesh_shape(mesh(1, 4, 1), 4));
  EXPECT_NO_THROW(check_mesh_shape(mesh(1, 4, 1, 2), 4));
  EXPECT_NO_THROW(check_mesh_shape(mesh(1, 4, 1, 1), 4));
  EXPECT_NO_THROW(check_mesh_shape(mesh(1, 4, 1, 4), 4));
  EXPECT_NO_THROW(check_mesh_shape(mesh(2, 2, 2), 8));
  EXPECT_NO_THROW(check_mesh_shape(mesh(2, 1, 3), 6));
}

TEST(MeshShapeCheck, RejectsAProductOtherThanTheWorldSize) {
  const std::string m = error_of([] { check_mesh_shape(mesh(1, 3, 1), 4); });
  EXPECT_TRUE(contains(m, "dp * cp * tp must equal the world size")) << m;
  EXPECT_TRUE(contains(m, "dp=1")) << m;
  EXPECT_TRUE(contains(m, "cp=3")) << m;
  EXPECT_TRUE(contains(m, "tp=1")) << m;
  EXPECT_TRUE(contains(m, "world_size=4")) << m;
  const std::string m2 = error_of([] { check_mesh_shape(mesh(2, 2, 2), 4); });
  EXPECT_TRUE(contains(m2, "dp=2")) << m2;
  EXPECT_TRUE(contains(m2, "world_size=4")) << m2;
}

TEST(MeshShapeCheck, RejectsACpDegreeNotDivisibleByUlysses) {
  const std::string m = error_of([] { check_mesh_shape(mesh(1, 4, 1, 3), 4); });
  EXPECT_TRUE(contains(m, "divisible by the ulysses degree")) << m;
  EXPECT_TRUE(contains(m, "cp=4")) << m;
  EXPECT_TRUE(contains(m, "ulysses=3")) << m;
  const std::string m2 = error_of([] { check_mesh_shape(mesh(1, 4, 1, 8), 4); });
  EXPECT_TRUE(contains(m2, "ulysses=8")) << m2;
  const std::string m3 = error_of([] { check_mesh_shape(mesh(1, 4, 1, -2), 4); });
  EXPECT_TRUE(contains(m3, "ulysses=-2")) << m3;
}

TEST(MeshShapeCheck, RejectsDegreesBelowOne) {
  for (const auto& [shape, name] : std::vector<std::pair<MeshShape, std::string>>{
           {mesh(0, 4, 1), "dp=0"}, {mesh(1, 0, 4), "cp=0"}, {mesh(4, 1, 0), "tp=0"}, {mesh(-1, -4, 1), "dp=-1"}}) {
    const std::string m = error_of([&] { check_mesh_shape(shape, 4); });
    EXPECT_TRUE(contains(m, "must be >= 1")) << m;
    EXPECT_TRUE(contains(m, name)) << m;
  }
}

TEST(MeshShapeCheck, GroupCreationRejectsABadShapeBeforeAnyRendezvous) {
  // No other rank exists: a rendezvous would hang; the shape check must fire first.
  const std::string path = "/tmp/mlacp_groups_test_never_created_" + std::to_string(::getpid());
  WorldInfo w;
  w.rank = 0;
  w.size = 4;
  const std::string m = error_of([&] { create_parallel_groups_file(path, w, mesh(1, 3, 1), GroupOptions{}); });
  EXPECT_TRUE(contains(m, "world_size=4")) << m;
  const std::string m2 = error_of([&] { create_parallel_groups(w, mesh(1, 4, 1, 3), GroupOptions{}); });
  EXPECT_TRUE(contains(m2, "ulysses=3")) << m2;
  ::unlink(path.c_str());
}

// --- the device and backend of the groups (docs/DESIGN.md §16) -------------------------------
TEST(GroupDevice, BackendRulesFireBeforeAnyRendezvous) {
  // Rank 0 of 2 alone: a rendezvous would wait for the missing rank; each rule must fire first.
  const std::string path = "/tmp/mlacp_groups_test_device_" + std::to_string(::getpid());
  WorldInfo w;
  w.rank = 0;
  w.size = 2;
  GroupOptions nccl_on_cpu;
  nccl_on_cpu.backend = CommBackend::nccl;
  const std::string m = error_of([&] { create_parallel_groups_file(path, w, mesh(1, 2, 1), nccl_on_cpu); });
  EXPECT_TRUE(contains(m, "NCCL moves CUDA tensors only") && contains(m, "backend=nccl")) << m;
  GroupOptions link_on_gpu;
  link_on_gpu.device = c10::Device(c10::DeviceType::CUDA, 0);
  link_on_gpu.link.bandwidth_bytes_per_second = 1e9;
  const std::string m2 = error_of([&] { create_parallel_groups_file(path, w, mesh(1, 2, 1), link_on_gpu); });
  EXPECT_TRUE(contains(m2, "emulated link") && contains(m2, "device=cuda:0")) << m2;
  GroupOptions on_meta;
  on_meta.device = c10::Device(c10::DeviceType::Meta);
  const std::string m3 = error_of([&] { create_parallel_groups_file(path, w, mesh(1, 2, 1), on_meta); });
  EXPECT_TRUE(contains(m3, "CPU or CUDA tensors") && contains(m3, "device=meta")) << m3;
#ifndef USE_C10D_NCCL
  GroupOptions cuda;  // automatic backend: NCCL, which this LibTorch lacks
  cuda.device = c10::Device(c10::DeviceType::CUDA, 0);
  const std::string m4 = error_of([&] { create_parallel_groups_file(path, w, mesh(1, 2, 1), cuda); });
  EXPECT_TRUE(contains(m4, "c10d NCCL") && contains(m4, "--backend gloo")) << m4;
#endif
  ::unlink(path.c_str());
}

// Hosts of consecutive ranks, as torchrun assigns them.
Topology hosts_of(int64_t hosts, int64_t per_host) {
  Topology t;
  for (int64_t h = 0; h < hosts; ++h) {
    t.host_names.push_back("10.0.0." + std::to_string(h + 1) + " (node " + std::to_string(h) + ")");
    t.host_addresses.push_back("10.0.0." + std::to_string(h + 1));
    for (int64_t r = 0; r < per_host; ++r) t.host_of_rank.push_back(h);
  }
  return t;
}

TEST(Topology, TheDefaultUlyssesDegreeKeepsTheAllToAllsInsideHosts) {
  EXPECT_EQ(host_local_ulysses(mesh(1, 4, 1), hosts_of(1, 4)), 4);  // one host: U = P
  EXPECT_EQ(host_local_ulysses(mesh(1, 4, 1), hosts_of(2, 2)), 2);
  EXPECT_EQ(host_local_ulysses(mesh(1, 4, 1), hosts_of(4, 1)), 1);
  EXPECT_EQ(host_local_ulysses(mesh(1, 8, 1), hosts_of(2, 4)), 4);
  EXPECT_EQ(host_local_ulysses(mesh(1, 8, 1), hosts_of(4, 2)), 2);
  EXPECT_EQ(host_local_ulysses(mesh(1, 4, 2), hosts_of(2, 4)), 2);  // TP innermost: 2 CP ranks a host
  EXPECT_EQ(host_local_ulysses(mesh(2, 2, 1), hosts_of(2, 2)), 2);  // a DP replica a host
  EXPECT_EQ(host_local_ulysses(mesh(2, 2, 1), hosts_of(4, 1)), 1);
  // Every Ulysses group of U = 2 on one host, its all-gather groups across
  const Topology t = hosts_of(2, 2);
  MeshShape s = mesh(1, 4, 1);
  s.ulysses = 2;
  for (const auto& g : ulysses_groups(s)) EXPECT_TRUE(t.one_host(g));
  for (const auto& g : all_gather_groups(s)) EXPECT_FALSE(t.one_host(g));
  EXPECT_EQ(ulysses_groups(s), (std::vector<std::vector<int64_t>>{{0, 1}, {2, 3}}));
  EXPECT_EQ(all_gather_groups(s), (std::vector<std::vector<int64_t>>{{0, 2}, {1, 3}}));
  EXPECT_EQ(t.ranks_on(1), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(t.describe(), "2 hosts: 10.0.0.1 (node 0) ranks [0, 1] | 10.0.0.2 (node 1) ranks [2, 3]");
}

TEST(Topology, GroupsSayWhichOfThemCrossHosts) {
  ParallelGroups g;
  g.world_info.size = 4;
  g.shape = mesh(1, 4, 1);
  g.topology = hosts_of(2, 2);
  g.shape.ulysses = 4;
  EXPECT_TRUE(contains(g.describe(), "the Ulysses all-to-alls CROSS hosts")) << g.describe();
  g.shape.ulysses = 2;
  EXPECT_TRUE(contains(g.describe(), "the Ulysses all-to-alls stay inside hosts, the all-gathers cross hosts"))
      << g.describe();
  g.topology = hosts_of(1, 4);
  EXPECT_FALSE(contains(g.describe(), "hosts")) << g.describe();
}

TEST(Topology, ALocalRendezvousIsOneHost) {
  EXPECT_TRUE(run_ranks(2, [](int rank, int world, const std::string& store) {
    WorldInfo w;
    w.rank = rank;
    w.size = world;
    Rendezvous r = Rendezvous::file(store, w, std::chrono::seconds(30));
    const Topology& t = r.topology();
    EXPECT_EQ(t.hosts(), 1);
    EXPECT_EQ(t.host_of_rank, (std::vector<int64_t>{0, 0}));
    EXPECT_EQ(t.host_addresses.at(0), "127.0.0.1");
    ParallelGroups g = r.groups(MeshShape{1, 2, 1, 0}, GroupOptions{});
    EXPECT_EQ(g.shape.ulysses, 2);  // one host: U = P
    barrier(g.world);
  }));
}

TEST(GroupDevice, BackendNamesParseAndUnknownOnesAreNamed) {
  EXPECT_EQ(parse_comm_backend("auto"), CommBackend::automatic);
  EXPECT_EQ(parse_comm_backend("gloo"), CommBackend::gloo);
  EXPECT_EQ(parse_comm_backend("nccl"), CommBackend::nccl);
  for (CommBackend b : {CommBackend::automatic, CommBackend::gloo, CommBackend::nccl})
    EXPECT_EQ(parse_comm_backend(comm_backend_name(b)), b);
  const std::string m = error_of([] { parse_comm_backend("mpi"); });
  EXPECT_TRUE(contains(m, "auto, gloo or nccl") && contains(m, "backend=mpi")) << m;
}

TEST(GroupDevice, CpuGroupsAreGlooOnTheCpuAndControlValuesCrossThere) {
  EXPECT_TRUE(run_ranks(2, [](int rank, int world, const std::string& store) {
    GroupOptions options;
    options.timeout = std::chrono::seconds(20);
    ParallelGroups g = make_groups(rank, world, store, mesh(1, 2, 1), options);
    EXPECT_EQ(g.cp.device(), c10::Device(c10::DeviceType::CPU));
    EXPECT_EQ(g.cp.backend_name(), "gloo");
    EXPECT_EQ(g.tp.backend_name(), "none");  // a group of size 1 has no backend
    EXPECT_FALSE(g.instruments.timeline->device_timed());
    EXPECT_EQ(all_reduce_max(g.cp, {static_cast<double>(rank)}), std::vector<double>{1.0});
    EXPECT_EQ(all_gather_u64(g.cp, 40 + rank), (std::vector<uint64_t>{40, 41}));
  }));
}

// --- world_from_env --------------------------------------------------------------------------
// Sets/unsets torchrun's variables for one test and restores them afterwards.
class EnvVars : public ::testing::Test {
 protected:
  const std::vector<std::string> names{"RANK",        "WORLD_SIZE",  "LOCAL_RANK",         "LOCAL_WORLD_SIZE",
                                       "GROUP_RANK",  "MASTER_ADDR", "MASTER_PORT",        "GLOO_SOCKET_IFNAME",
                                       "TORCHELASTIC_USE_AGENT_STORE"};
  void SetUp() override {
    for (const auto& n : names) {
      const char* v = std::getenv(n.c_str());
      saved[n] = v ? std::optional<std::string>(v) : std::nullopt;
      ::unsetenv(n.c_str());
    }
  }
  void TearDown() override {
    for (const auto& [n, v] : saved) {
      if (v)
        ::setenv(n.c_str(), v->c_str(), 1);
      else
        ::unsetenv(n.c_str());
    }
  }
  void set(const std::map<std::string, std::string>& values) {
    for (const auto& [n, v] : values) ::setenv(n.c_str(), v.c_str(), 1);
  }
  std::map<std::string, std::optional<std::string>> saved;
};

TEST_F(EnvVars, ReadsAllVariables) {
  set({{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "10.1.2.3"}, {"MASTER_PORT", "1234"}});
  WorldInfo w = world_from_env();
  EXPECT_EQ(w.rank, 3);
  EXPECT_EQ(w.size, 8);
  EXPECT_EQ(w.local_rank, 1);
  EXPECT_EQ(w.master_addr, "10.1.2.3");
  EXPECT_EQ(w.port, 1234);
}

TEST_F(EnvVars, ReadsTorchrunsNodeVariables) {
  set({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"}, {"GROUP_RANK", "1"},
       {"MASTER_PORT", "1234"}, {"GLOO_SOCKET_IFNAME", "eth1,eth2"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"}});
  const WorldInfo w = world_from_env();
  EXPECT_EQ(w.local_world_size, 2);
  EXPECT_EQ(w.node_rank, 1);
  EXPECT_EQ(w.interfaces, "eth1,eth2");
  EXPECT_TRUE(w.agent_store);
  set({{"LOCAL_RANK", "2"}});  // not below LOCAL_WORLD_SIZE
  const std::string m = error_of([] { world_from_env(); });
  EXPECT_TRUE(contains(m, "LOCAL_RANK must be below LOCAL_WORLD_SIZE") && contains(m, "LOCAL_RANK=2")) << m;
  set({{"LOCAL_RANK", "1"}, {"GROUP_RANK", "x"}});
  EXPECT_TRUE(contains(error_of([] { world_from_env(); }), "variable=GROUP_RANK"));
}

TEST_F(EnvVars, OptionalVariablesHaveDefaults) {
  set({{"RANK", "0"}, {"WORLD_SIZE", "1"}});
  WorldInfo w = world_from_env();
  EXPECT_EQ(w.rank, 0);
  EXPECT_EQ(w.size, 1);
  EXPECT_EQ(w.local_rank, 0);
  EXPECT_EQ(w.master_addr, "127.0.0.1");
  EXPECT_EQ(w.port, 29500);
  set({{"RANK", "2"}, {"WORLD_SIZE", "4"}, {"MASTER_PORT", "29600"}});
  WorldInfo w2 = world_from_env();
  EXPECT_EQ(w2.local_rank, 2) << "LOCAL_RANK defaults to RANK";
  EXPECT_EQ(w2.master_addr, "127.0.0.1");
}

TEST_F(EnvVars, MissingRequiredVariablesAreNamed) {
  const std::string none = error_of([] { world_from_env(); });
  EXPECT_TRUE(contains(none, "is not set")) << none;
  EXPECT_TRUE(contains(none, "variable=RANK")) << none;
  set({{"RANK", "0"}});
  const std::string no_size = error_of([] { world_from_env(); });
  EXPECT_TRUE(contains(no_size, "variable=WORLD_SIZE")) << no_size;
  set({{"WORLD_SIZE", "2"}});  // a multi-rank world needs MASTER_PORT
  const std::string no_port = error_of([] { world_from_env(); });
  EXPECT_TRUE(contains(no_port, "variable=MASTER_PORT")) << no_port;
}

TEST_F(EnvVars, MalformedValuesAreNamedWithTheirText) {
  for (const auto& [name, value] : std::vector<std::pair<std::string, std::string>>{
           {"RANK", "abc"}, {"RANK", "1x"}, {"RANK", ""}, {"RANK", "-1"}, {"WORLD_SIZE", "two"},
           {"LOCAL_RANK", "0.5"}, {"MASTER_PORT", "port"}}) {
    set({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"MASTER_PORT", "29500"}});
    set({{name, value}});
    const std::string m = error_of([] { world_from_env(); });
    EXPECT_TRUE(contains(m, "variable=" + name)) << name << "='" << value << "': " << m;
    EXPECT_TRUE(contains(m, "value=" + value)) << name << "='" << value << "': " << m;
  }
}

TEST_F(EnvVars, RankMustBeBelowWorldSize) {
  set({{"RANK", "4"}, {"WORLD_SIZE", "4"}, {"MASTER_PORT", "29500"}});
  const std::string m = error_of([] { world_from_env(); });
  EXPECT_TRUE(contains(m, "RANK must be below WORLD_SIZE")) << m;
  EXPECT_TRUE(contains(m, "RANK=4")) << m;
  EXPECT_TRUE(contains(m, "WORLD_SIZE=4")) << m;
  set({{"RANK", "0"}, {"WORLD_SIZE", "0"}});
  const std::string m0 = error_of([] { world_from_env(); });
  EXPECT_TRUE(contains(m0, "WORLD_SIZE=0")) << m0;
}

TEST_F(EnvVars, PortOutOfRangeIsRejected) {
  set({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}});
  try {
    WorldInfo w = world_from_env();
    // A port that does not fit 16 bits would be silently truncated by create_parallel_groups.
    ADD_FAILURE() << "MASTER_PORT=70000 accepted as " << w.port;
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "MASTER_PORT")) << e.what();
  }
}

// --- rank order over 8 processes -------------------------------------------------------------
TEST(GroupsRankOrder, DpTimesCpTimesTpWithTpInnermost) {
  EXPECT_TRUE(run_ranks(8, [](int rank, int world, const std::string& store) {
    GroupOptions options;
    options.timeout = std::chrono::milliseconds(30000);
    auto g = make_groups(rank, world, store, mesh(2, 2, 2), options);
    const int64_t tp = rank % 2, cp = (rank / 2) % 2, dp = rank / 4;
    EXPECT_EQ(g.tp_rank, tp);
    EXPECT_EQ(g.cp_rank, cp);
    EXPECT_EQ(g.dp_rank, dp);
    EXPECT_EQ(g.world_info.rank, rank);
    EXPECT_EQ(g.world_info.size, 8);
    EXPECT_EQ(g.shape.ulysses, 2) << "ulysses 0 means U = cp";
    auto world_rank = [](int64_t d, int64_t c, int64_t t) { return static_cast<uint64_t>((d * 2 + c) * 2 + t); };
    struct Expect {
      const CommGroup* group;
      const char* name;
      int64_t rank;
      std::vector<uint64_t> members;
    };
    const std::vector<Expect> expected{
        {&g.world, "world", rank, {0, 1, 2, 3, 4, 5, 6, 7}},
        {&g.dp, "dp", dp, {world_rank(0, cp, tp), world_rank(1, cp, tp)}},
        {&g.cp, "cp", cp, {world_rank(dp, 0, tp), world_rank(dp, 1, tp)}},
        {&g.tp, "tp", tp, {world_rank(dp, cp, 0), world_rank(dp, cp, 1)}},
        {&g.ulysses, "ulysses", cp, {world_rank(dp, 0, tp), world_rank(dp, 1, tp)}},
        {&g.all_gather, "all_gather", 0, {static_cast<uint64_t>(rank)}},
    };
    for (const auto& e : expected) {
      ASSERT_TRUE(e.group->defined()) << e.name;
      EXPECT_EQ(e.group->name(), e.name);
      EXPECT_EQ(e.group->size(), static_cast<int64_t>(e.members.size())) << e.name;
      EXPECT_EQ(e.group->rank(), e.rank) << e.name;
      EXPECT_EQ(all_gather_u64(*e.group, static_cast<uint64_t>(rank)), e.members) << e.name << " on rank " << rank;
    }
    // A tensor collective over the cp group agrees with the control-plane view.
    at::Tensor mine = at::full({1, 1}, static_cast<float>(rank));
    at::Tensor all = launch_all_gather_seq(g.cp, mine, "who").wait_one();
    EXPECT_EQ(all[0][0].item<float>(), float(world_rank(dp, 0, tp)));
    EXPECT_EQ(all[0][1].item<float>(), float(world_rank(dp, 1, tp)));
    const std::string text = g.describe();
    EXPECT_TRUE(contains(text, "world 8 = dp 2 x cp 2 x tp 2")) << text;
    EXPECT_TRUE(contains(text, "TP innermost")) << text;
    EXPECT_TRUE(contains(text, "world_rank = (dp_rank*cp + cp_rank)*tp + tp_rank")) << text;
    EXPECT_TRUE(contains(text, "A 1 x U 2")) << text;
  }, std::chrono::seconds(90)));
}

// --- group creation ------------------------------------------------------------------------
// A rank that exits right after create_parallel_groups_file returns must not break its peers'
// group creation. (test::make_groups works around this with a world barrier; this test calls the
// library directly.)
TEST(GroupsCreation, ARankExitingRightAfterCreationDoesNotBreakItsPeers) {
  for (int attempt = 0; attempt < 40; ++attempt) {
    ASSERT_TRUE(run_ranks(2, [](int rank, int world, const std::string& store) {
      WorldInfo w;
      w.rank = rank;
      w.size = world;
      GroupOptions options;
      options.timeout = std::chrono::milliseconds(20000);
      ParallelGroups g = create_parallel_groups_file(store, w, mesh(1, world, 1), options);
    }, std::chrono::seconds(30)))
        << "attempt " << attempt;
  }
}

// --- a dead peer -----------------------------------------------------------------------------
TEST(GroupsDeadPeer, ACollectiveWithAnExitedPeerThrowsInsteadOfHanging) {
  EXPECT_TRUE(run_ranks(2, [](int rank, int world, const std::string& store) {
    GroupOptions options;
    options.timeout = std::chrono::milliseconds(3000);
    auto g = make_groups(rank, world, store, mesh(1, 2, 1), options);
    if (rank == 1) {
      std::fflush(stdout);
      ::_exit(0);  // dies right after group creation, without a goodbye
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const auto start = std::chrono::steady_clock::now();
    bool threw = false;
    try {
      at::Tensor x = at::ones({1, 4, 2, 2});
      launch_all_reduce_sum(g.cp, x, "grad").wait();
      launch_all_gather_seq(g.cp, x, "kv").wait();
    } catch (const std::exception& e) {
      threw = true;
      std::fprintf(stderr, "[rank 0] expected error from the dead peer: %s\n", e.what());
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_TRUE(threw);
    EXPECT_LT(seconds, 10.0);
  }, std::chrono::seconds(40)));
}

}  // namespace
}  // namespace mlacp
