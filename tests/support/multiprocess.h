// Multi-process test harness: runs a test body in `world_size` forked children (one per rank)
// that rendezvous over a fresh FileStore, and reports whether every rank passed.
//
// Usage inside a TEST:
//   EXPECT_TRUE(mlacp::test::run_ranks(2, [](int rank, int world, const std::string& store) {
//     auto groups = mlacp::test::make_groups(rank, world, store, mlacp::MeshShape{1, world, 1});
//     EXPECT_EQ(groups.cp.rank(), rank);  // EXPECT/ASSERT work inside the body
//   }));
//
// Rules for bodies:
//   - a body runs in a child forked from the gtest process: it must not rely on state created by
//     other tests, and must create its own process groups from `store_path`;
//   - the child calls at::set_num_threads(1) before the body;
//   - a child exits 1 if the body threw (the exception is printed with the rank to stderr) or if
//     any gtest expectation failed in it, else 0; the parent sees only these exit codes.
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include "mlacp/comm.h"

namespace mlacp::test {

using RankBody = std::function<void(int rank, int world_size, const std::string& store_path)>;

// Forks world_size children, each running body(rank, world_size, store_path). The parent makes
// a unique FileStore path under /tmp (removed before and after), waits for every child, and kills
// all of them on `timeout` (or a few seconds after one rank failed, since its peers then usually
// block on it). Returns true only if every child exited with status 0. Failures are described on
// stderr (rank, exit status or signal).
bool run_ranks(int world_size, const RankBody& body,
               std::chrono::seconds timeout = std::chrono::seconds(120));

// create_parallel_groups_file with WorldInfo{rank, world}, followed by a barrier over the world
// group so that every rank has finished building its groups before any rank goes on (and may
// exit): see the GroupsCreation test in tests/comm/groups_test.cpp for why.
ParallelGroups make_groups(int rank, int world, const std::string& path, MeshShape shape,
                           GroupOptions options = {});

}  // namespace mlacp::test
