// Where the ranks run (private to src/comm): the address and interfaces a rank's Gloo device binds,
// the roll call that tells every rank which host each rank runs on, and the watchdog that bounds
// group building (docs/DESIGN.md §2 "Several hosts").
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "mlacp/comm.h"

namespace c10d {
class Store;
}

namespace mlacp {

// What this rank's Gloo device binds: the named interfaces (GLOO_SOCKET_IFNAME, as c10d reads it),
// else one address: 127.0.0.1 for a local launch (a FileStore) or a MASTER_ADDR on this host's
// loopback, else this host's address on the route to MASTER_ADDR (the interface that reaches it).
// Throws mlacp::Error (input) for an interface this host lacks, naming those it has.
struct GlooEndpoint {
  std::vector<std::string> interfaces;
  std::string address;       // empty when interfaces are named
  std::string description;   // "interface eth1" / "10.0.0.2 (the route to MASTER_ADDR)"
};
GlooEndpoint gloo_endpoint(const WorldInfo& world);

// Every rank writes where it runs (its Gloo address, host name, torchrun's node rank) under
// `prefix` and reads everyone's, waiting until `deadline`. A rank that never writes is a fault
// naming the missing ranks and, where LOCAL_WORLD_SIZE says how ranks fill the hosts, their node.
Topology roll_call(c10d::Store& store, const WorldInfo& world, const GlooEndpoint& endpoint,
                   std::chrono::steady_clock::time_point deadline, std::chrono::milliseconds timeout);

// The hosts of `world_ranks` other than this rank's, for fault messages:
// "10.0.0.2 (node 1): world ranks 2, 3".
std::string other_hosts_of(const Topology& topology, int64_t world_rank, const std::vector<int64_t>& world_ranks);
// The host whose address appears in a backend's error text ("[10.0.0.2]:4711"), if any, and the
// group members on it: "10.0.0.2 (node 1) world ranks [2, 3]"; its index in `host` (-1: none).
std::string host_named_in(const Topology& topology, const std::string& text, const std::vector<int64_t>& world_ranks,
                          int64_t* host = nullptr);

// Calls `expired` from its own thread if it is still alive `limit` after construction (a blocked
// c10d connect cannot be interrupted: the tool's callback prints the fault and ends the process).
class Watchdog {
 public:
  Watchdog(std::chrono::milliseconds limit, std::function<void()> expired);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

 private:
  std::mutex mutex_;
  std::condition_variable done_;
  bool finished_ = false;
  std::thread thread_;
};

}  // namespace mlacp
