// mlacp._C: the Python binding of the C++ library (built against the torch of the environment).
// The boundary is typed and keyword-only: configs cross as mlacp.MlaConfig objects (read from a
// transformers config's dict by the library's one config reader), options as named arguments,
// reports as dicts; tensors cross as torch tensors and process groups come from
// torch.distributed. mlacp::Error surfaces as mlacp.MlacpError with the same "mlacp: ..." text.
#include <optional>
#include <string>
#include <vector>

#include <torch/extension.h>

#include "collectives.h"
#include "layer.h"
#include "mlacp/config.h"
#include "mlacp/errors.h"
#include "mlacp/plan.h"
#include "mlacp/planner.h"
#include "mlacp/runtime.h"

namespace py = pybind11;
using mlacp::python::Layer;
using mlacp::python::ProcessGroupPtr;

namespace {

// A dict to the library's config reader (which reads transformers' config.json spellings), and
// JSON text from the library back to a dict: JSON stays inside the binding.
std::string dumps(const py::dict& d) { return py::module_::import("json").attr("dumps")(d).cast<std::string>(); }
py::object loads(const std::string& text) { return py::module_::import("json").attr("loads")(text); }

py::object optional_int(const std::optional<int64_t>& v) { return v ? py::object(py::int_(*v)) : py::object(py::none()); }

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

  py::class_<mlacp::MlaConfig>(m, "MlaConfig", "One MLA attention layer's shape and numerics (include/mlacp/config.h).")
      .def_static(
          "from_hf", [](const py::dict& config) { return mlacp::parse_config_json(dumps(config)); }, py::arg("config"),
          "The attention of a transformers DeepSeek config (its to_dict()); every field that changes the math is "
          "read or rejected.")
      .def_static("preset", &mlacp::preset_config, py::arg("name"))
      .def_readonly("hidden_size", &mlacp::MlaConfig::hidden_size)
      .def_readonly("num_heads", &mlacp::MlaConfig::num_heads)
      .def_property_readonly("q_lora_rank", [](const mlacp::MlaConfig& c) { return optional_int(c.q_lora_rank); })
      .def_readonly("kv_lora_rank", &mlacp::MlaConfig::kv_lora_rank)
      .def_readonly("qk_nope_head_dim", &mlacp::MlaConfig::qk_nope_head_dim)
      .def_readonly("qk_rope_head_dim", &mlacp::MlaConfig::qk_rope_head_dim)
      .def_readonly("v_head_dim", &mlacp::MlaConfig::v_head_dim)
      .def_readonly("rms_norm_eps", &mlacp::MlaConfig::rms_norm_eps)
      .def_property_readonly("rope_interleave",
                             [](const mlacp::MlaConfig& c) { return c.rope_layout == mlacp::RopeLayout::interleaved; })
      .def_property_readonly("scaling", &mlacp::MlaConfig::scaling)
      .def("to_dict", [](const mlacp::MlaConfig& c) { return loads(mlacp::config_to_json(c)); })
      .def("__eq__", [](const mlacp::MlaConfig& a, const mlacp::MlaConfig& b) { return a == b; })
      .def("__repr__", [](const mlacp::MlaConfig& c) { return "MlaConfig(" + mlacp::config_to_json(c, -1) + ")"; });

  py::class_<Layer>(m, "Layer", "One MLA layer of the C++ library run on the caller's parameters (python/csrc/layer.h).")
      .def(py::init([](const mlacp::MlaConfig& config, at::ScalarType dtype, const c10::Device& device,
                       std::optional<double> rms_norm_eps, bool rms_norm_float32) {
             mlacp::MlaConfig c = config;
             if (rms_norm_eps) c.rms_norm_eps = *rms_norm_eps;
             c.rms_norm_float32 = rms_norm_float32;
             return std::make_unique<Layer>(c, dtype, device);
           }),
           py::arg("config"), py::kw_only(), py::arg("dtype"), py::arg("device"), py::arg("rms_norm_eps") = py::none(),
           py::arg("rms_norm_float32") = false)
      .def_property_readonly("parameter_names",
                             [](const Layer& l) {
                               std::vector<std::string> names;
                               for (const auto& p : l.parameters()) names.push_back(p.first);
                               return names;
                             })
      .def_property_readonly("parameter_shapes",
                             [](const Layer& l) {
                               py::dict shapes;
                               for (const auto& p : l.parameters()) shapes[py::str(p.first)] = py::tuple(py::cast(p.second));
                               return shapes;
                             })
      .def(
          "parallelize",
          [](Layer& l, const ProcessGroupPtr& cp_group, int64_t ulysses, const ProcessGroupPtr& ulysses_group,
             const ProcessGroupPtr& all_gather_group, const std::string& strategy, const std::string& partition,
             bool overlap, const std::string& kernel, bool kv_recompute) {
            mlacp::CpOptions options;
            options.strategy = mlacp::parse_strategy(strategy);
            options.partition = mlacp::parse_partition(partition);
            options.overlap = overlap;
            options.kernel = mlacp::parse_kernel(kernel);
            options.kv_recompute = kv_recompute;
            py::gil_scoped_release release;
            return l.parallelize(cp_group, ulysses, ulysses_group, all_gather_group, options);
          },
          py::kw_only(), py::arg("cp_group"), py::arg("ulysses"), py::arg("ulysses_group"), py::arg("all_gather_group"),
          py::arg("strategy"), py::arg("partition"), py::arg("overlap"), py::arg("kernel"),
          py::arg("kv_recompute") = false,
          "Installs CP over torch.distributed groups (one fingerprint collective); returns the plan's text.")
      .def(
          "forward",
          [](Layer& l, const at::Tensor& hidden, std::vector<at::Tensor> weights, std::vector<bool> needs_grad,
             const at::Tensor& cos, const at::Tensor& sin, std::optional<std::vector<int64_t>> document_ends,
             bool training) {
            mlacp::python::LayerInputs inputs{std::move(weights), std::move(needs_grad), cos, sin,
                                              std::move(document_ends), training};
            py::gil_scoped_release release;
            return l.forward(hidden, inputs);
          },
          py::arg("hidden"), py::kw_only(), py::arg("weights"), py::arg("needs_grad"), py::arg("cos"), py::arg("sin"),
          py::arg("document_ends") = py::none(), py::arg("training") = true,
          "(output, key): the layer's forward with its graph kept under key for layer_backward.")
      .def("comm_bytes", &Layer::comm_bytes, "Bytes sent since the last reset, per transfer label.")
      .def("expected_comm_bytes", &Layer::expected_comm_bytes, py::kw_only(), py::arg("batch"), py::arg("seq_len"),
           py::arg("wire_bytes"), "docs/DESIGN.md §4.6's bytes per layer, forward + backward.")
      .def("reset_comm_counters", &Layer::reset_comm_counters)
      .def_property_readonly("description", &Layer::description)
      .def_property_readonly("config", &Layer::config);

  m.def(
      "layer_backward",
      [](const at::Tensor& key, const at::Tensor& grad_output) {
        py::gil_scoped_release release;
        return mlacp::python::boxed_backward(key, grad_output);
      },
      py::arg("key"), py::arg("grad_output"),
      "The gradients of a Layer.forward: hidden's, then one per weight (None where not needed).");
  m.def(
      "all_reduce_sum_",
      [](const at::Tensor& tensor, const ProcessGroupPtr& group) {
        py::gil_scoped_release release;
        mlacp::python::all_reduce_sum_(tensor, group);
      },
      py::arg("tensor"), py::arg("group"),
      "Sums a contiguous tensor in place over a torch.distributed group (python/csrc/collectives.h: why not "
      "dist.all_reduce).");
  m.def(
      "all_gather",
      [](const at::Tensor& tensor, const ProcessGroupPtr& group) {
        py::gil_scoped_release release;
        return mlacp::python::all_gather(tensor, group);
      },
      py::arg("tensor"), py::arg("group"), "Every member's tensor, in group rank order (python/csrc/collectives.h).");
  m.def("live_layer_graphs", &mlacp::python::live_boxes, "How many layer forwards hold their graphs now.");

  m.def(
      "shard_sequence",
      [](const at::Tensor& t, const std::string& partition, int64_t cp, int64_t rank, int64_t dim) {
        return mlacp::shard_sequence(t, mlacp::parse_partition(partition), cp, rank, dim);
      },
      py::arg("tensor"), py::kw_only(), py::arg("partition"), py::arg("cp"), py::arg("rank"), py::arg("dim") = 1);
  m.def(
      "unshard_sequence",
      [](const std::vector<at::Tensor>& shards, const std::string& partition, int64_t dim) {
        return mlacp::unshard_sequence(shards, mlacp::parse_partition(partition), dim);
      },
      py::arg("shards"), py::kw_only(), py::arg("partition"), py::arg("dim") = 1);
  m.def(
      "plan",
      [](const mlacp::MlaConfig& config, int64_t seq_len, int64_t batch, int64_t cp, int64_t tp, const std::string& dtype,
         const std::vector<std::string>& strategies, int64_t ulysses, const std::vector<std::string>& partitions,
         std::optional<bool> overlap, const std::string& hardware, std::optional<double> bandwidth_gbps,
         std::optional<double> latency_us, bool kv_recompute_when_short) {
        std::string report;
        {
          py::gil_scoped_release no_gil;  // a calibration runs LibTorch's autograd engine
          mlacp::PlanRequest r;
          r.config = config;
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
          r.kv_recompute_when_short = kv_recompute_when_short;
          report = mlacp::plan_context_parallel(r).to_json();
        }
        return loads(report);
      },
      py::kw_only(), py::arg("config"), py::arg("seq_len"), py::arg("batch") = 1, py::arg("cp"), py::arg("tp") = 1,
      py::arg("dtype") = "float32", py::arg("strategies") = std::vector<std::string>{}, py::arg("ulysses") = 0,
      py::arg("partitions") = std::vector<std::string>{}, py::arg("overlap") = py::none(), py::arg("hardware"),
      py::arg("bandwidth_gbps") = py::none(), py::arg("latency_us") = py::none(),
      py::arg("kv_recompute_when_short") = false,
      "The planner's report (a dict) for one layer: include/mlacp/planner.h.");
  m.def("torch_version", [] { return std::string(TORCH_VERSION); });
}
