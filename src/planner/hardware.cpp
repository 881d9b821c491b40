// Hardware profiles and hardware files (include/mlacp/planner.h, docs/DESIGN.md §15).
#include <algorithm>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "mlacp/errors.h"
#include "mlacp/planner.h"

namespace mlacp {
namespace {

using nlohmann::json;
constexpr const char* kWhat = "hardware";

// NVIDIA Hopper SXM, one node of 8 GPUs on NVLink 4 / NVSwitch, one InfiniBand NDR NIC per GPU.
// Peak figures from NVIDIA's H100/H200 datasheets; the achieved fractions are the assumptions
// written in docs/DESIGN.md §15 (GEMM ~70% of dense peak as cuBLAS reaches on large GEMMs;
// attention forward ~60% and backward ~45% of peak, the range FlashAttention-3 reports for
// head dims 128-256; NCCL's all-gather bus bandwidth ~80% of the link's).
Hardware hopper(const std::string& name, double memory_gib, double nvlink_gbps_per_direction, const std::string& note) {
  Hardware hw;
  hw.name = name;
  hw.source = note +
              "; dense BF16 989 TFLOP/s and FP32 67 TFLOP/s peak (NVIDIA datasheet); achieved: GEMM 70%, "
              "attention forward 60% / backward 45% of peak (FlashAttention-3's range, Shah et al. 2024), "
              "links 80% of nominal (NCCL bus bandwidth); InfiniBand NDR 400 Gb/s per GPU";
  const double bf16 = 989e12, fp32 = 67e12;
  for (const auto& [dtype, peak] : {std::pair<const char*, double>{"bfloat16", bf16}, {"float32", fp32}}) {
    ComputeRates r;
    r.gemm_flops = 0.70 * peak;
    r.attention_forward_flops = 0.60 * peak;
    r.attention_backward_flops = 0.45 * peak;
    hw.rates[dtype] = r;
  }
  hw.devices_per_node = 8;
  hw.memory_bytes = memory_gib * 1024.0 * 1024.0 * 1024.0;
  hw.intra_node = {0.8 * nvlink_gbps_per_direction * 1e9, 10e-6};
  hw.inter_node = {0.8 * 50e9, 20e-6};
  return hw;
}

double number(const json& j, const char* key, double fallback, bool required) {
  if (!j.contains(key)) {
    MLACP_REQUIRE(!required, kWhat, "the hardware file lacks a required field", {got("field", key)},
                  "write it (see mlacp plan --hardware h200-nvlink-ib --show-hardware for the format)");
    return fallback;
  }
  MLACP_REQUIRE(j.at(key).is_number() && j.at(key).get<double>() >= 0, kWhat,
                "a hardware figure must be a number >= 0", {got("field", key), got("value", j.at(key).dump())},
                "fix the hardware file");
  return j.at(key).get<double>();
}

}  // namespace

std::vector<std::string> hardware_profile_names() { return {"h100-nvlink-ib", "h200-nvlink-ib", "h800-nvlink-ib"}; }

Hardware hardware_profile(const std::string& name) {
  if (name == "h100-nvlink-ib") return hopper(name, 80, 450, "H100 SXM5 80 GB, NVLink 4 900 GB/s bidirectional");
  if (name == "h200-nvlink-ib") return hopper(name, 141, 450, "H200 SXM 141 GB, NVLink 4 900 GB/s bidirectional");
  if (name == "h800-nvlink-ib") return hopper(name, 80, 200, "H800 SXM5 80 GB, NVLink 400 GB/s bidirectional");
  std::string names;
  for (const std::string& n : hardware_profile_names()) names += (names.empty() ? "" : ", ") + n;
  fail(kWhat, "unknown hardware profile", {got("profile", name)},
       "use one of " + names + ", or a hardware file written by mlacp plan --calibrate --save-hardware FILE");
}

std::string Hardware::to_json() const {
  json j;
  j["name"] = name;
  j["source"] = source;
  j["devices_per_node"] = devices_per_node;
  j["cores_per_node"] = cores_per_node;
  j["shared_node_link"] = shared_node_link;
  j["memory_bytes"] = memory_bytes;
  j["intra_node"] = {{"bandwidth_bytes_per_s", intra_node.bandwidth_bytes_per_s}, {"latency_s", intra_node.latency_s}};
  j["inter_node"] = {{"bandwidth_bytes_per_s", inter_node.bandwidth_bytes_per_s}, {"latency_s", inter_node.latency_s}};
  for (const auto& [dtype, r] : rates)
    j["rates"][dtype] = {{"gemm_flops", r.gemm_flops},
                         {"attention_forward_flops", r.attention_forward_flops},
                         {"attention_backward_flops", r.attention_backward_flops},
                         {"seconds_per_element", r.seconds_per_element},
                         {"gemm_flops_by_tokens", r.gemm_flops_by_tokens}};
  return j.dump(2);
}

Hardware Hardware::from_json(const std::string& text) {
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) {
    fail(kWhat, "the hardware file is not valid JSON", {got("cause", std::string(e.what()))}, "fix the file");
  }
  MLACP_REQUIRE(j.is_object() && j.contains("rates") && j.at("rates").is_object() && !j.at("rates").empty(), kWhat,
                "the hardware file must be an object with a non-empty \"rates\" object", {},
                "write it with mlacp plan --calibrate --save-hardware FILE");
  Hardware hw;
  hw.name = j.value("name", std::string("hardware file"));
  hw.source = j.value("source", std::string(""));
  hw.devices_per_node = static_cast<int64_t>(number(j, "devices_per_node", 8, false));
  hw.cores_per_node = static_cast<int64_t>(number(j, "cores_per_node", 0, false));
  hw.shared_node_link = static_cast<int64_t>(number(j, "shared_node_link", 0, false));
  MLACP_REQUIRE(hw.shared_node_link == 0 || hw.shared_node_link == 1, kWhat, "shared_node_link must be 0 or 1",
                {got("shared_node_link", hw.shared_node_link)}, "fix the hardware file");
  hw.memory_bytes = number(j, "memory_bytes", 0, true);
  MLACP_REQUIRE(hw.devices_per_node >= 1, kWhat, "devices_per_node must be >= 1", {got("devices_per_node", hw.devices_per_node)},
                "fix the hardware file");
  for (const char* level : {"intra_node", "inter_node"}) {
    LinkLevel link;
    if (j.contains(level)) {
      link.bandwidth_bytes_per_s = number(j.at(level), "bandwidth_bytes_per_s", 0, true);
      link.latency_s = number(j.at(level), "latency_s", 0, false);
    }
    (std::string(level) == "intra_node" ? hw.intra_node : hw.inter_node) = link;
  }
  for (const auto& [dtype, r] : j.at("rates").items()) {
    MLACP_REQUIRE(dtype == "float32" || dtype == "bfloat16" || dtype == "float64", kWhat,
                  "rates are given per dtype: float32, bfloat16 or float64", {got("dtype", dtype)}, "fix the hardware file");
    ComputeRates c;
    c.gemm_flops = number(r, "gemm_flops", 0, true);
    c.attention_forward_flops = number(r, "attention_forward_flops", 0, true);
    c.attention_backward_flops = number(r, "attention_backward_flops", 0, true);
    c.seconds_per_element = number(r, "seconds_per_element", 0, false);
    if (r.contains("gemm_flops_by_tokens")) {
      const json& curve = r.at("gemm_flops_by_tokens");
      MLACP_REQUIRE(curve.is_array(), kWhat, "gemm_flops_by_tokens must be a list of [tokens, FLOP/s] pairs",
                    {got("dtype", dtype)}, "fix the hardware file");
      for (const json& point : curve) {
        MLACP_REQUIRE(point.is_array() && point.size() == 2 && point[0].is_number() && point[1].is_number() &&
                          point[0].get<double>() > 0 && point[1].get<double>() > 0 &&
                          (c.gemm_flops_by_tokens.empty() || point[0].get<double>() > c.gemm_flops_by_tokens.back().first),
                      kWhat, "gemm_flops_by_tokens must be [tokens, FLOP/s] pairs, both > 0, tokens ascending",
                      {got("dtype", dtype), got("point", point.dump())}, "fix the hardware file");
        c.gemm_flops_by_tokens.emplace_back(point[0].get<double>(), point[1].get<double>());
      }
    }
    hw.rates[dtype] = c;
  }
  return hw;
}

Hardware load_hardware_file(const std::string& path) {
  std::ifstream in(path);
  MLACP_REQUIRE(in.good(), kWhat, "cannot read the hardware file", {got("path", path)},
                "pass a file written by mlacp plan --calibrate --save-hardware, or a profile name");
  std::stringstream text;
  text << in.rdbuf();
  return Hardware::from_json(text.str());
}

Hardware hardware_named(const std::string& profile_or_path) {
  const std::vector<std::string> names = hardware_profile_names();
  if (std::find(names.begin(), names.end(), profile_or_path) != names.end()) return hardware_profile(profile_or_path);
  if (!std::ifstream(profile_or_path).good()) {
    std::string list;
    for (const std::string& n : names) list += (list.empty() ? "" : ", ") + n;
    fail(kWhat, "the hardware is neither a profile nor a readable hardware file", {got("hardware", profile_or_path)},
         "use one of " + list + ", or a file written by mlacp plan --calibrate --save-hardware FILE");
  }
  return load_hardware_file(profile_or_path);
}

}  // namespace mlacp
