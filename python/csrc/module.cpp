// mlacp._C: the Python binding of the C++ library (built against the torch of the environment).
// Tensors cross as torch tensors (the same objects: autograd runs through the C++ nodes);
// process groups come from torch.distributed; mlacp::Error surfaces as mlacp.MlacpError with the
// same "mlacp: ..." text.
#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <torch/extension.h>

#include "mlacp/attention.h"
#include "mlacp/c10d_groups.h"
#include "mlacp/config.h"
#include "mlacp/errors.h"
#include "mlacp/plan.h"
#include "mlacp/planner.h"
#include "mlacp/runtime.h"

namespace py = pybind11;

namespace {

using ProcessGroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;

// One attention layer: the C++ module over the caller's parameter tensors, and its CP install.
class Attention {
 public:
  Attention(const std::string& config_json, const std::map<std::string, at::Tensor>& parameters,
            std::optional<double> rms_norm_eps, bool rms_norm_float32) {
    mlacp::MlaConfig config = mlacp::parse_config_json(config_json);
    if (rms_norm_eps) config.rms_norm_eps = *rms_norm_eps;
    config.rms_norm_float32 = rms_norm_float32;
    MLACP_REQUIRE(!parameters.empty(), "adopt parameters", "the layer's parameters must be given", {},
                  "pass the attention module's named parameters");
    const at::Tensor& any = parameters.begin()->second;
    module_ = mlacp::MlaAttention(config, at::TensorOptions().dtype(any.scalar_type()).device(any.device()));
    module_->adopt_parameters(parameters);
  }

  std::string parallelize(const ProcessGroupPtr& cp, int64_t ulysses, const ProcessGroupPtr& ulysses_group,
                          const ProcessGroupPtr& all_gather_group, const std::string& strategy,
                          const std::string& partition, bool overlap, const std::string& kernel,
                          const std::string& device_name) {
    mlacp::CpOptions options;
    options.strategy = mlacp::parse_strategy(strategy);
    options.partition = mlacp::parse_partition(partition);
    options.overlap = overlap;
    options.kernel = mlacp::parse_kernel(kernel);
    // The parameters' device ("cpu", "cuda:1"): the groups move tensors there (gloo / nccl backend).
    const c10::Device device(device_name);
    groups_ = mlacp::parallel_groups_from_c10d(cp, ulysses, ulysses_group, all_gather_group, device);
    py::gil_scoped_release release;
    plan_ = mlacp::parallelize(module_, groups_, options);
    return plan_->to_text();
  }

  at::Tensor forward(const at::Tensor& hidden, const std::optional<at::Tensor>& position_ids,
                     const std::optional<std::vector<int64_t>>& document_ends,
                     const std::optional<std::pair<at::Tensor, at::Tensor>>& position_embeddings,
                     const std::optional<bool>& is_causal, bool training) {
    mlacp::MlaForwardOptions options;
    if (position_ids) options.position_ids = *position_ids;
    options.document_ends = document_ends;
    options.position_embeddings = position_embeddings;
    options.is_causal = is_causal;
    module_->train(training);
    py::gil_scoped_release release;
    return module_->forward(hidden, options);
  }

  // Bytes this rank put on the wire since the last reset, per transfer label (the counters of
  // mlacp's collectives: the same ones `mlacp bench` reports). Empty before parallelize().
  std::map<std::string, int64_t> comm_bytes() const {
    std::map<std::string, int64_t> out;
    if (!groups_.instruments.counters) return out;
    for (const auto& item : groups_.instruments.counters->by_label()) out[item.first] = item.second.bytes;
    return out;
  }
  // What docs/DESIGN.md §4.6 says this rank sends per layer, forward + backward, for B sequences
  // of S tokens at `wire_bytes` per element (the reduce-scatter of 16-bit gradients travels as
  // float32). The formula the counters are checked against by `mlacp verify`.
  int64_t expected_comm_bytes(int64_t batch, int64_t seq_len, int64_t wire_bytes) const {
    MLACP_REQUIRE(plan_.has_value(), "expected bytes", "the layer must be parallelized first", {},
                  "call parallelize()");
    const mlacp::CommVolume v = mlacp::expected_comm_elements(*plan_, batch, seq_len);
    return (v.forward_all_to_all + v.forward_all_gather + v.forward_output + v.backward_all_to_all) * wire_bytes +
           v.backward_reduce * std::max<int64_t>(wire_bytes, 4);
  }
  void reset_comm_counters() {
    if (groups_.instruments.counters) groups_.instruments.counters->reset();
  }

  std::string description() const { return module_->parallel_description(); }
  double scaling() const { return module_->scaling(); }
  std::string config_json() const { return mlacp::config_to_json(module_->config()); }

 private:
  mlacp::MlaAttention module_{nullptr};
  mlacp::ParallelGroups groups_;
  std::optional<mlacp::CpPlan> plan_;
};

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "mlacp C++ core (see the mlacp package for the documented API)";
  static py::exception<mlacp::Error> error(m, "MlacpError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const mlacp::Error& e) {
      PyErr_SetString(error.ptr(), e.what());
    }
  });

  py::class_<Attention>(m, "Attention")
      .def(py::init<const std::string&, const std::map<std::string, at::Tensor>&, std::optional<double>, bool>(),
           py::arg("config_json"), py::arg("parameters"), py::arg("rms_norm_eps") = py::none(),
           py::arg("rms_norm_float32") = false)
      .def("parallelize", &Attention::parallelize, py::arg("cp_group"), py::arg("ulysses"),
           py::arg("ulysses_group"), py::arg("all_gather_group"), py::arg("strategy"), py::arg("partition"),
           py::arg("overlap"), py::arg("kernel"), py::arg("device"))
      .def("forward", &Attention::forward, py::arg("hidden"), py::arg("position_ids") = py::none(),
           py::arg("document_ends") = py::none(), py::arg("position_embeddings") = py::none(),
           py::arg("is_causal") = py::none(), py::arg("training") = true)
      .def("comm_bytes", &Attention::comm_bytes)
      .def("expected_comm_bytes", &Attention::expected_comm_bytes, py::arg("batch"), py::arg("seq_len"),
           py::arg("wire_bytes"))
      .def("reset_comm_counters", &Attention::reset_comm_counters)
      .def_property_readonly("description", &Attention::description)
      .def_property_readonly("scaling", &Attention::scaling)
      .def_property_readonly("config_json", &Attention::config_json);

  m.def(
      "shard_sequence",
      [](const at::Tensor& t, const std::string& partition, int64_t cp, int64_t rank, int64_t dim) {
        return mlacp::shard_sequence(t, mlacp::parse_partition(partition), cp, rank, dim);
      },
      py::arg("tensor"), py::arg("partition"), py::arg("cp"), py::arg("rank"), py::arg("dim") = 1);
  m.def(
      "unshard_sequence",
      [](const std::vector<at::Tensor>& shards, const std::string& partition, int64_t dim) {
        return mlacp::unshard_sequence(shards, mlacp::parse_partition(partition), dim);
      },
      py::arg("shards"), py::arg("partition"), py::arg("dim") = 1);
  m.def("parse_config_json", [](const std::string& text) { return mlacp::config_to_json(mlacp::parse_config_json(text)); },
        py::arg("config_json"), "The config as mlacp reads it (JSON), or MlacpError.");
  m.def(
      "plan",
      [](const std::string& config_json, int64_t seq_len, int64_t batch, int64_t cp, int64_t tp, const std::string& dtype,
         const std::vector<std::string>& strategies, int64_t ulysses, const std::vector<std::string>& partitions,
         std::optional<bool> overlap, const std::string& hardware, std::optional<double> bandwidth_gbps,
         std::optional<double> latency_us) {
        py::gil_scoped_release no_gil;  // a calibration runs LibTorch's autograd engine
        mlacp::PlanRequest r;
        r.config = mlacp::parse_config_json(config_json);
        r.seq_len = seq_len;
        r.batch = batch;
        r.cp = cp;
        r.tp = tp;
        r.dtype = dtype;
        for (const std::string& s : strategies) r.strategies.push_back(mlacp::parse_strategy(s));
        r.ulysses = ulysses;
        for (const std::string& p : partitions) r.partitions.push_back(mlacp::parse_partition(p));
        if (overlap) r.overlaps = {*overlap};
        if (hardware == "calibrate") {
          mlacp::CalibrationOptions options;
          options.dtypes = {dtype};
          options.seq_len = 512;
          options.repeats = 1;
          options.concurrent = false;  // no fork inside a Python process:
          options.cp_step = false;     // the single-device layer instead, the link not measured
          r.hardware = mlacp::calibrate_host(r.config, options);
        } else {
          r.hardware = mlacp::hardware_named(hardware);
        }
        if (bandwidth_gbps) r.hardware.intra_node.bandwidth_bytes_per_s = *bandwidth_gbps * 1e9;
        if (latency_us) r.hardware.intra_node.latency_s = *latency_us * 1e-6;
        return mlacp::plan_context_parallel(r).to_json();
      },
      py::arg("config_json"), py::arg("seq_len"), py::arg("batch"), py::arg("cp"), py::arg("tp"), py::arg("dtype"),
      py::arg("strategies"), py::arg("ulysses"), py::arg("partitions"), py::arg("overlap"), py::arg("hardware"),
      py::arg("bandwidth_gbps"), py::arg("latency_us"),
      "The planner's report (JSON text) for one layer: include/mlacp/planner.h.");
  m.def("torch_version", [] { return std::string(TORCH_VERSION); });
}
