#include "comm/hosts.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/quiet_log.h"
#include "mlacp/errors.h"

namespace mlacp {
namespace {

constexpr const char* kWhat = "process groups";

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> parts;
  std::stringstream in(text);
  for (std::string part; std::getline(in, part, sep);)
    if (!part.empty()) parts.push_back(part);
  return parts;
}

std::string numeric_host(const sockaddr* addr, socklen_t length) {
  char host[NI_MAXHOST] = {0};
  if (getnameinfo(addr, length, host, sizeof(host), nullptr, 0, NI_NUMERICHOST) != 0) return "";
  return host;
}

// The interfaces of this host with their addresses ("eth0 10.0.0.2"), for messages; and one
// interface's first IPv4 (else IPv6) address.
std::map<std::string, std::string> interface_addresses() {
  std::map<std::string, std::string> found;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return found;
  for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || (a->ifa_addr->sa_family != AF_INET && a->ifa_addr->sa_family != AF_INET6)) continue;
    const socklen_t length = a->ifa_addr->sa_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    const std::string address = numeric_host(a->ifa_addr, length);
    auto it = found.find(a->ifa_name);
    if (it == found.end() || (a->ifa_addr->sa_family == AF_INET && it->second.find(':') != std::string::npos))
      found[a->ifa_name] = address;
  }
  freeifaddrs(list);
  return found;
}

std::string interface_list() {
  std::string out;
  for (const auto& [name, address] : interface_addresses()) out += (out.empty() ? "" : ", ") + name + " " + address;
  return out.empty() ? "(none found)" : out;
}

// The source address this host uses on its route to host:port (a UDP connect sends nothing).
std::string route_source_address(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return "";
  std::string source;
  for (addrinfo* a = found; a != nullptr && source.empty(); a = a->ai_next) {
    const int fd = socket(a->ai_family, SOCK_DGRAM, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t length = sizeof(local);
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0 && getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0)
      source = numeric_host(reinterpret_cast<sockaddr*>(&local), length);
    close(fd);
  }
  freeaddrinfo(found);
  return source;
}

std::string this_host_name() {
  char name[256] = {0};
  if (gethostname(name, sizeof(name) - 1) != 0) return "?";
  return name;
}

std::string roll_key(int64_t rank) { return "mlacp/roll/" + std::to_string(rank); }

struct RollEntry {
  std::string address, host_name;
  int64_t node_rank = -1;
};

RollEntry parse_entry(const std::vector<uint8_t>& bytes) {
  const std::vector<std::string> fields = split(std::string(bytes.begin(), bytes.end()), '\t');
  RollEntry e;
  if (fields.size() >= 3) {
    e.address = fields[0];
    e.host_name = fields[1];
    e.node_rank = std::stoll(fields[2]);
  }
  return e;
}

}  // namespace

bool Topology::one_host(const std::vector<int64_t>& world_ranks) const {
  std::set<int64_t> hosts;
  for (int64_t r : world_ranks)
    hosts.insert(r < static_cast<int64_t>(host_of_rank.size()) ? host_of_rank[r] : 0);
  return hosts.size() <= 1;
}

std::vector<int64_t> Topology::ranks_on(int64_t host) const {
  std::vector<int64_t> ranks;
  for (size_t r = 0; r < host_of_rank.size(); ++r)
    if (host_of_rank[r] == host) ranks.push_back(static_cast<int64_t>(r));
  return ranks;
}

std::string Topology::describe() const {
  std::ostringstream out;
  out << hosts() << (hosts() == 1 ? " host" : " hosts") << ":";
  for (int64_t h = 0; h < hosts(); ++h) out << (h ? " |" : "") << " " << host_names[h] << " ranks " << got("", ranks_on(h)).value;
  return out.str();
}

GlooEndpoint gloo_endpoint(const WorldInfo& world) {
  GlooEndpoint e;
  if (!world.store_file.empty()) {  // mlacp's local launcher: loopback only
    e.address = "127.0.0.1";
    e.description = "127.0.0.1 (a local launch)";
    return e;
  }
  if (!world.interfaces.empty()) {
    for (const std::string& name : split(world.interfaces, ',')) {
      MLACP_REQUIRE(if_nametoindex(name.c_str()) != 0, kWhat,
                    "GLOO_SOCKET_IFNAME (or --iface) must name network interfaces of this host",
                    {got("interface", name), got("rank", world.rank), got("interfaces_here", interface_list())},
                    "name one of this host's interfaces, or unset it to bind the interface that reaches MASTER_ADDR");
      e.interfaces.push_back(name);
    }
    const auto addresses = interface_addresses();
    const auto it = addresses.find(e.interfaces.front());
    e.address = it == addresses.end() ? "" : it->second;
    e.description = "interface " + world.interfaces + (e.address.empty() ? "" : " (" + e.address + ")");
    return e;
  }
  e.address = route_source_address(world.master_addr, world.port);
  MLACP_REQUIRE(!e.address.empty(), kWhat, "this host needs a route to MASTER_ADDR: Gloo binds the interface that reaches it",
                {got("MASTER_ADDR", world.master_addr), got("rank", world.rank), got("interfaces_here", interface_list())},
                "check this host's network, or name the interface with GLOO_SOCKET_IFNAME or --iface");
  e.description = e.address + " (the route to MASTER_ADDR)";
  return e;
}

namespace {

// A roll call that timed out: each rank that read who is missing says so in the store; rank 0,
// where it serves the store, waits (at most kRollLinger) for every rank that arrived to have read
// it, so that a rank whose own deadline falls a little later can still name the missing ranks
// instead of finding the store gone.
constexpr std::chrono::milliseconds kRollLinger{2500};

void report_roll_read(c10d::Store& store, const WorldInfo& world, int64_t arrived, bool read) {
  try {
    const QuietC10dLog quiet;
    if (read) store.add("mlacp/roll/failed_read", 1);
    if (world.rank != 0 || world.agent_store || !world.store_file.empty() || !read) return;
    const auto until = std::chrono::steady_clock::now() + kRollLinger;
    while (store.add("mlacp/roll/failed_read", 0) < arrived && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
  } catch (const std::exception&) {  // the store is gone: nothing to wait for
  }
}

}  // namespace

Topology roll_call(c10d::Store& store, const WorldInfo& world, const GlooEndpoint& endpoint,
                   std::chrono::steady_clock::time_point deadline, std::chrono::milliseconds timeout) {
  const std::string me = endpoint.address + "\t" + this_host_name() + "\t" + std::to_string(world.node_rank) + "\t" +
                         std::to_string(world.local_rank);
  std::vector<std::string> keys;
  for (int64_t r = 0; r < world.size; ++r) keys.push_back(roll_key(r));
  const auto remaining = std::max(std::chrono::milliseconds(1), std::chrono::duration_cast<std::chrono::milliseconds>(
                                                                     deadline - std::chrono::steady_clock::now()));
  try {
    const QuietC10dLog quiet;
    store.set(roll_key(world.rank), std::vector<uint8_t>(me.begin(), me.end()));
    store.wait(keys, remaining);
  } catch (const std::exception& e) {
    std::vector<int64_t> missing, arrived;
    std::set<int64_t> missing_nodes;
    std::set<std::string> arrived_hosts;
    try {
      const QuietC10dLog quiet;
      for (int64_t r = 0; r < world.size; ++r) {
        if (store.check({roll_key(r)})) {
          const RollEntry entry = parse_entry(store.get(roll_key(r)));
          arrived_hosts.insert(entry.address + (entry.node_rank >= 0 ? " (node " + std::to_string(entry.node_rank) + ")" : ""));
        } else {
          missing.push_back(r);
          if (world.local_world_size > 0) missing_nodes.insert(r / world.local_world_size);
        }
      }
    } catch (const std::exception&) {  // the store itself is gone (rank 0 ended): say what is known
    }
    report_roll_read(store, world, static_cast<int64_t>(world.size) - static_cast<int64_t>(missing.size()),
                     !missing.empty());
    std::vector<ErrorValue> values{got("rank", world.rank), got("world_size", world.size),
                                   got("timeout_s", static_cast<double>(timeout.count()) / 1000.0)};
    if (!missing.empty()) values.push_back(got("missing_ranks", missing));
    if (!missing_nodes.empty())
      values.push_back(got("missing_nodes", got("", std::vector<int64_t>(missing_nodes.begin(), missing_nodes.end())).value +
                                                " (LOCAL_WORLD_SIZE=" + std::to_string(world.local_world_size) +
                                                " consecutive ranks a node, as torchrun assigns them)"));
    std::string hosts;
    for (const std::string& h : arrived_hosts) hosts += (hosts.empty() ? "" : ", ") + h;
    if (!hosts.empty()) values.push_back(got("hosts_arrived", hosts));
    values.push_back(got("cause", std::string(e.what()).substr(0, std::string(e.what()).find('\n'))));
    fail_fault(kWhat, "not every rank arrived at the rendezvous within the timeout", values,
               "start every rank (WORLD_SIZE of them; on every host) with the same MASTER_ADDR and MASTER_PORT; a "
               "host that never joins: check its launch (torchrun --node_rank) and its network; raise --timeout if "
               "some start late");
  }
  Topology t;
  std::map<std::string, int64_t> host_index;
  std::vector<RollEntry> entries;
  try {
    const QuietC10dLog quiet;
    for (int64_t r = 0; r < world.size; ++r) entries.push_back(parse_entry(store.get(roll_key(r))));
    // Nobody goes on, or raises a rule below, before every rank has read the roll: rank 0 serves
    // the store, and a rank still reading when it ends would see a broken pipe.
    if (store.add("mlacp/roll/read", 1) == world.size) store.set("mlacp/roll/done", std::vector<uint8_t>{1});
    store.wait({"mlacp/roll/done"}, std::max(std::chrono::milliseconds(1),
                                             std::chrono::duration_cast<std::chrono::milliseconds>(
                                                 deadline - std::chrono::steady_clock::now())));
  } catch (const std::exception& e) {
    fail_fault(kWhat, "the rendezvous store stopped answering during the roll call",
               {got("rank", world.rank), got("MASTER_ADDR", world.master_addr), got("MASTER_PORT", world.port),
                got("cause", std::string(e.what()).substr(0, std::string(e.what()).find('\n')))},
               "rank 0 serves the store: it ended, or its host went away; its own error says why");
  }
  for (const RollEntry& e : entries) {
    // torchrun's node rank names the host where it is set; else the bound address and the host name
    const std::string key = e.node_rank >= 0 ? "node " + std::to_string(e.node_rank) : e.address + "|" + e.host_name;
    auto [it, added] = host_index.emplace(key, static_cast<int64_t>(t.host_names.size()));
    if (added) {
      std::string name = e.address.empty() ? e.host_name : e.address;
      if (e.node_rank >= 0) name += " (node " + std::to_string(e.node_rank) + ")";
      t.host_names.push_back(name);
      t.host_addresses.push_back(e.address);
    }
    t.host_of_rank.push_back(it->second);
  }
  // Several hosts: a Gloo device on a loopback address cannot be dialled from the others (each
  // would reach its own loopback): said on every rank before any group connects.
  if (t.hosts() > 1) {
    for (int64_t h = 0; h < t.hosts(); ++h) {
      const std::string& a = t.host_addresses[h];
      const bool loopback = a.rfind("127.", 0) == 0 || a == "::1";
      MLACP_REQUIRE(!loopback, kWhat,
                    "ranks on several hosts must bind addresses the other hosts can reach, not loopback",
                    {got("host", t.host_names[h]), got("address", a), got("hosts", t.describe())},
                    "set MASTER_ADDR to rank 0's address on the network between the hosts (not 127.0.0.1 or "
                    "localhost), or name that network's interface with GLOO_SOCKET_IFNAME or --iface");
    }
  }
  return t;
}

std::string other_hosts_of(const Topology& topology, int64_t world_rank, const std::vector<int64_t>& world_ranks) {
  if (topology.host_of_rank.empty()) return "";
  const int64_t mine = topology.host_of_rank.at(world_rank);
  std::map<int64_t, std::vector<int64_t>> others;
  for (int64_t r : world_ranks)
    if (topology.host_of_rank.at(r) != mine) others[topology.host_of_rank.at(r)].push_back(r);
  std::string out;
  for (const auto& [host, ranks] : others)
    out += (out.empty() ? "" : "; ") + topology.host_names[host] + " world ranks " + got("", ranks).value;
  return out;
}

std::string host_named_in(const Topology& topology, const std::string& text, const std::vector<int64_t>& world_ranks,
                          int64_t* host) {
  if (host) *host = -1;
  static const std::regex bracketed(R"(\[([0-9A-Fa-f:.]+)\])");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), bracketed); it != std::sregex_iterator(); ++it) {
    std::string address = (*it)[1];
    if (address.rfind("::ffff:", 0) == 0) address = address.substr(7);  // an IPv4 address as IPv6 prints it
    for (int64_t h = 0; h < topology.hosts(); ++h) {
      if (topology.host_addresses[h] != address) continue;
      std::vector<int64_t> ranks;
      for (int64_t r : world_ranks)
        if (topology.host_of_rank.at(r) == h) ranks.push_back(r);
      if (host) *host = h;
      return topology.host_names[h] + " world ranks " + got("", ranks).value;
    }
  }
  return "";
}

Watchdog::Watchdog(std::chrono::milliseconds limit, std::function<void()> expired) {
  thread_ = std::thread([this, limit, expired = std::move(expired)] {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!done_.wait_for(lock, limit, [this] { return finished_; })) expired();
  });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    finished_ = true;
  }
  done_.notify_all();
  thread_.join();
}

}  // namespace mlacp
