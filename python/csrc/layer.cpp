#include "layer.h"

#include <memory>
#include <mutex>
#include <unordered_map>

#include <ATen/ATen.h>
#include <ATen/SavedTensorHooks.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/autograd.h>

#include "mlacp/c10d_groups.h"
#include "mlacp/errors.h"
#include "mlacp/runtime.h"

namespace mlacp::python {
namespace {

constexpr const char* kWhat = "mlacp layer";

// A boxed forward: the output with its graph, and the leaves it was computed from (hidden, then
// the weights; undefined where no gradient is needed).
struct Box {
  at::Tensor output;
  std::vector<at::Tensor> leaves;
};

// The live boxes by key. Leaked on purpose: a key may be freed during interpreter shutdown.
class Boxes {
 public:
  static Boxes& get() {
    static Boxes* boxes = new Boxes;
    return *boxes;
  }
  at::Tensor add(Box box) {
    int64_t id;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      id = ++next_;
      boxes_[id] = std::make_shared<Box>(std::move(box));
    }
    // The key's storage owns the box: freeing the key (after backward, or when a checkpoint drops
    // its saved tensors) frees the graph and every activation it saved.
    auto* data = new int64_t(id);
    return at::from_blob(
        data, {1}, [](void* p) {
          auto* held = static_cast<int64_t*>(p);
          Boxes::get().take(*held);  // destroyed here, outside the lock
          delete held;
        },
        at::TensorOptions().dtype(at::kLong));
  }
  std::shared_ptr<Box> take(int64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = boxes_.find(id);
    if (it == boxes_.end()) return nullptr;
    std::shared_ptr<Box> box = std::move(it->second);
    boxes_.erase(it);
    return box;
  }
  int64_t size() {
    std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<int64_t>(boxes_.size());
  }

 private:
  std::mutex mutex_;
  std::unordered_map<int64_t, std::shared_ptr<Box>> boxes_;
  int64_t next_ = 0;
};

// Autograd as the library's own code expects it, inside a custom op's kernel (which the dispatcher
// calls with the autograd keys excluded): the keys back, grad mode as asked, and no saved-tensor
// hooks (a checkpoint's hooks see the op's key, which stands for everything the box saves).
class AutogradInside {
 public:
  explicit AutogradInside(bool grad)
      : keys_(without_autograd_exclusion()), grad_(grad), hooks_(at::SavedTensorDefaultHooks::get_tls_state()) {
    at::SavedTensorDefaultHooks::set_tls_state(at::impl::SavedTensorDefaultHooksTLS{});
  }
  ~AutogradInside() { at::SavedTensorDefaultHooks::set_tls_state(hooks_); }
  AutogradInside(const AutogradInside&) = delete;
  AutogradInside& operator=(const AutogradInside&) = delete;

 private:
  static c10::impl::LocalDispatchKeySet without_autograd_exclusion() {
    c10::impl::LocalDispatchKeySet keys = c10::impl::tls_local_dispatch_key_set();
    keys.excluded_ = keys.excluded_ - c10::autograd_dispatch_keyset_with_ADInplaceOrView;
    return keys;
  }
  c10::impl::ForceDispatchKeyGuard keys_;
  at::AutoGradMode grad_;
  at::impl::SavedTensorDefaultHooksTLS hooks_;
};

at::Tensor leaf(const at::Tensor& t, bool needs_grad) {
  at::Tensor l = t.detach();  // shares data and version counter: an in-place change is caught
  if (needs_grad) l.requires_grad_(true);
  return l;
}

}  // namespace

Layer::Layer(const MlaConfig& config, at::ScalarType dtype, const c10::Device& device)
    : module_(config, at::TensorOptions().dtype(dtype).device(device)), device_(device) {
  // No parameter memory of its own: until a forward adopts the caller's tensors, one-element
  // placeholders broadcast to each parameter's shape stand for them (on the caller's device and
  // dtype, which the CP install checks its groups against); the module's own draw is freed here.
  std::map<std::string, at::Tensor> placeholders;
  for (const auto& item : module_->named_parameters()) {
    parameters_.emplace_back(item.key(), item.value().sizes().vec());
    placeholders[item.key()] = at::zeros({}, at::TensorOptions().dtype(dtype).device(device)).expand(item.value().sizes());
  }
  module_->adopt_parameters(placeholders);
}

std::string Layer::parallelize(const ProcessGroupPtr& cp, int64_t ulysses, const ProcessGroupPtr& ulysses_group,
                               const ProcessGroupPtr& all_gather_group, const CpOptions& options) {
  groups_ = parallel_groups_from_c10d(cp, ulysses, ulysses_group, all_gather_group, device_);
  plan_ = mlacp::parallelize(module_, groups_, options);
  return plan_->to_text();
}

std::tuple<at::Tensor, at::Tensor> Layer::forward(const at::Tensor& hidden, const LayerInputs& inputs) {
  MLACP_REQUIRE(inputs.weights.size() == parameters_.size() && inputs.needs_grad.size() == parameters_.size() + 1,
                kWhat, "the forward takes one weight per parameter and one needs_grad flag per input",
                {got("weights", inputs.weights.size()), got("needs_grad", inputs.needs_grad.size()),
                 got("parameters", parameters_.size())},
                "pass the parameters in Layer.parameter_names order");
  bool any = false;
  for (bool b : inputs.needs_grad) any = any || b;
  AutogradInside autograd(any);
  std::vector<at::Tensor> leaves{leaf(hidden, any && inputs.needs_grad[0])};
  std::map<std::string, at::Tensor> bound;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    leaves.push_back(leaf(inputs.weights[i], any && inputs.needs_grad[i + 1]));
    bound[parameters_[i].first] = leaves.back();
  }
  module_->adopt_parameters(bound);
  module_->train(inputs.training);
  MlaForwardOptions options;
  options.document_ends = inputs.document_ends;
  options.position_embeddings = std::make_pair(inputs.cos, inputs.sin);
  options.is_causal = true;
  at::Tensor output = module_->forward(leaves[0], options);
  at::Tensor none = at::zeros({1}, at::TensorOptions().dtype(at::kLong));
  if (!output.requires_grad()) return {output, none};
  for (size_t i = 0; i < leaves.size(); ++i)
    if (!leaves[i].requires_grad()) leaves[i] = at::Tensor();
  at::Tensor detached = output.detach();
  return {detached, Boxes::get().add(Box{std::move(output), std::move(leaves)})};
}

std::vector<at::Tensor> boxed_backward(const at::Tensor& key, const at::Tensor& grad_output) {
  MLACP_REQUIRE(key.defined() && key.numel() == 1 && key.scalar_type() == at::kLong, kWhat,
                "the backward takes the key its forward returned", {got("key_numel", key.defined() ? key.numel() : int64_t{0})},
                "pass the forward's second output");
  const int64_t id = key.item<int64_t>();
  std::shared_ptr<Box> box = id == 0 ? nullptr : Boxes::get().take(id);
  MLACP_REQUIRE(box != nullptr, kWhat, "the layer's forward state is gone: a backward ran through it already",
                {got("key", id)},
                "backward through an mlacp layer once per forward (retain_graph=True cannot replay its "
                "communication); run the forward again");
  AutogradInside autograd(false);
  std::vector<at::Tensor> wrt;
  for (const at::Tensor& l : box->leaves)
    if (l.defined()) wrt.push_back(l);
  std::vector<at::Tensor> grads = torch::autograd::grad({box->output}, wrt, {grad_output}, /*retain_graph=*/false,
                                                        /*create_graph=*/false, /*allow_unused=*/true);
  std::vector<at::Tensor> out(box->leaves.size());
  for (size_t i = 0, j = 0; i < box->leaves.size(); ++i)
    if (box->leaves[i].defined()) out[i] = grads[j++];
  return out;
}

int64_t live_boxes() { return Boxes::get().size(); }

std::map<std::string, int64_t> Layer::comm_bytes() const {
  std::map<std::string, int64_t> out;
  if (!groups_.instruments.counters) return out;
  for (const auto& item : groups_.instruments.counters->by_label()) out[item.first] = item.second.bytes;
  return out;
}

int64_t Layer::expected_comm_bytes(int64_t batch, int64_t seq_len, int64_t wire_bytes) const {
  MLACP_REQUIRE(plan_.has_value(), "expected bytes", "the layer must be parallelized first", {},
                "call parallelize()");
  // docs/DESIGN.md §4.6 per layer, forward + backward; the reduce-scatter of 16-bit gradients
  // travels as float32.
  const CommVolume v = expected_comm_elements(*plan_, batch, seq_len);
  return (v.forward_all_to_all + v.forward_all_gather + v.forward_output + v.backward_all_to_all) * wire_bytes +
         v.backward_reduce * std::max<int64_t>(wire_bytes, 4);
}

void Layer::reset_comm_counters() {
  if (groups_.instruments.counters) groups_.instruments.counters->reset();
}

}  // namespace mlacp::python
