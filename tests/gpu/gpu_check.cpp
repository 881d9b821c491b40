// mlacp_gpu_check OUT_DIR: the single-GPU part of scripts/gpu-check.sh (issue 14). NOT A TEST of the
// suite (CI has no GPU); built with the PyTorch 2.x wheel's LibTorch, run on a lent GPU machine.
//
//   exactness   every structure of tests/support/attention_structures.h through piece_attention
//               on CUDA, with each CUDA kernel (LibTorch's memory-efficient kernel in float32 and
//               bf16 autocast; flash with V padded, bf16), against the float64 CPU reference:
//               output, dQ, dK, dV; then the MLA layer's default single-device cases (causal,
//               packed documents, masks) on CUDA against the float64 CPU layer: output and every
//               input/parameter gradient.
//   sync        attention forward + backward (each kernel), and the MLA layer's, with CUDA's sync
//               debug mode at "error": a host synchronisation inside the step throws.
//   rates       attention TFLOP/s forward and forward + backward at S = 8K..64K (causal, 16 heads,
//               Dqk 192, Dv 128, bf16), each kernel, next to the same GPU's bf16 GEMM rate; the
//               MLA layer forward + backward at DeepSeek-V3 dimensions (128 heads), bf16 autocast.
// Every line of output is also written to OUT_DIR/gpu_check.tsv. Exit code 1 when a check fails.
#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/cuda.h>

#include "check/cases.h"
#include "check/compare.h"
#include "check/single_device_checks.h"
#include "core/compat.h"
#include "kernels/piece_attention.h"
#include "kernels/reference_attention.h"
#include "mlacp/attention.h"
#include "support/attention_structures.h"

namespace mlacp {
namespace {

std::ofstream tsv;
bool all_passed = true;

std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

void row(const std::string& section, const std::string& name, const std::string& quantity, double value,
         double bound = -1) {
  const bool ok = bound < 0 || value <= bound;
  if (!ok) all_passed = false;
  std::ostringstream line;
  line << section << '\t' << name << '\t' << quantity << '\t' << value << '\t'
       << (bound < 0 ? std::string("-") : (ok ? "PASS <= " : "FAIL > ") + std::to_string(bound));
  std::cout << line.str() << std::endl;
  tsv << line.str() << '\n';
  tsv.flush();
}

double seconds_of(const std::function<void()>& f, int reps) {
  f();  // warm-up
  torch::cuda::synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) f();
  torch::cuda::synchronize();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
}

struct NamedKernel {
  std::string name;
  const VarlenKernel* kernel;
  bool bf16_only;
};
std::vector<NamedKernel> cuda_kernels() {
  return {{"efficient", memory_efficient_varlen_kernel(), false}, {"flash", flash_padded_varlen_kernel(), true}};
}

void attention_exactness(const c10::Device& cuda) {
  for (const test::AttentionCase& c : test::attention_cases()) {
    const AttentionStructure st = test::structure_of(c);
    AttentionStructure st_cuda = st;  // token indices stay host metadata; a mask lives with the tensors
    if (st.mask.defined()) st_cuda.mask = st.mask.to(cuda);
    const int64_t sq = static_cast<int64_t>(c.q_tokens.size()), sk = static_cast<int64_t>(c.k_tokens.size());
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
    at::Tensor q = at::randn({c.batch, sq, c.heads, c.dqk}, gen, at::kDouble).transpose(1, 2);
    at::Tensor k = at::randn({c.batch, sk, c.heads, c.dqk}, gen, at::kDouble).transpose(1, 2);
    at::Tensor v = at::randn({c.batch, sk, c.heads, c.dv}, gen, at::kDouble).transpose(1, 2);
    at::Tensor w = at::randn({c.batch, c.heads, sq, c.dv}, gen, at::kDouble);
    const double scaling = 1.0 / std::sqrt(static_cast<double>(c.dqk));
    auto grads = [&](at::Tensor qq, at::Tensor kk, at::Tensor vv, const std::function<at::Tensor(at::Tensor, at::Tensor, at::Tensor)>& f) {
      qq.requires_grad_(true), kk.requires_grad_(true), vv.requires_grad_(true);
      at::Tensor out = f(qq, kk, vv);
      (out.to(at::kDouble) * w.to(out.device())).sum().backward();
      return std::vector<at::Tensor>{out.detach().to(at::kDouble).cpu(), qq.grad().to(at::kDouble).cpu(),
                                     kk.grad().to(at::kDouble).cpu(), vv.grad().to(at::kDouble).cpu()};
    };
    const std::vector<at::Tensor> want = grads(q.clone(), k.clone(), v.clone(), [&](auto a, auto b, auto d) {
      return reference_attention(a, b, d, scaling, st);
    });
    for (const NamedKernel& kernel : cuda_kernels()) {
      for (bool bf16 : {false, true}) {
        if (kernel.bf16_only && !bf16) continue;
        const std::string name = c.name + "/" + kernel.name + (bf16 ? "/bf16" : "/float32");
        try {
          PieceStats stats;
          std::vector<at::Tensor> got;
          {
            std::unique_ptr<compat::AutocastGuard> autocast;
            if (bf16) autocast = std::make_unique<compat::AutocastGuard>(c10::DeviceType::CUDA, true, at::kBFloat16);
            got = grads(q.to(cuda, at::kFloat), k.to(cuda, at::kFloat), v.to(cuda, at::kFloat), [&](auto a, auto b, auto d) {
              return piece_attention(a, b, d, scaling, st_cuda, kernel.kernel, &stats);
            });
          }
          const char* names[] = {"out", "dq", "dk", "dv"};
          for (int i = 0; i < 4; ++i)
            row("attention", name + (stats.masked ? "/masked" : "/pieces"), names[i], norm_rel_error(got[i], want[i]),
                bf16 ? (i == 0 ? kBf16OutputTolerance : kBf16GradTolerance) : kFloat32RelTolerance * 10);
        } catch (const std::exception& e) {
          row("attention", name, std::string("ERROR ") + first_line(e.what()), 1, 0);
        }
      }
    }
  }
}

void layer_exactness(const c10::Device& cuda) {
  for (const VerifyCase& c : default_single_device_cases()) {
    MlaAttention reference = make_case_module(c, at::kDouble);
    const ForwardBackward want = run_forward_backward(reference, make_case_inputs(c, at::kDouble));
    for (bool bf16 : {false, true}) {
      try {
        MlaAttention module = make_case_module(c, at::kFloat);
        module->set_attention_kernel(AttentionKernel::blockwise);  // blockwise on CUDA tensors = pieces
        module->to(cuda);
        const CaseInputs in = inputs_on(make_case_inputs(c, at::kFloat), cuda);
        std::unique_ptr<compat::AutocastGuard> autocast;
        if (bf16) autocast = std::make_unique<compat::AutocastGuard>(c10::DeviceType::CUDA, true, at::kBFloat16);
        const ForwardBackward got = run_forward_backward(module, in);
        const std::string name = c.name + (bf16 ? "/bf16" : "/float32");
        row("layer", name, "output", norm_rel_error(got.output.to(at::kDouble).cpu(), want.output),
            bf16 ? kBf16OutputTolerance : kFloat32RelTolerance * 10);
        for (size_t i = 0; i < got.gradients.size(); ++i)
          row("layer", name, "grad " + got.gradients[i].first,
              norm_rel_error(got.gradients[i].second.to(at::kDouble).cpu(), want.gradients[i].second),
              bf16 ? kBf16GradTolerance : kFloat32RelTolerance * 10);
      } catch (const std::exception& e) {
        row("layer", c.name, std::string("ERROR ") + first_line(e.what()), 1, 0);
      }
    }
  }
}

// Causal attention at MLA head dims on one GPU, bf16; FLOPs of the allowed half.
void attention_rates(const c10::Device& cuda) {
  const int64_t h = 16, dqk = 192, dv = 128;
  at::Tensor a = at::randn({8192, 8192}, at::TensorOptions().device(cuda).dtype(at::kBFloat16));
  const double gemm_s = seconds_of([&] { at::matmul(a, a); }, 10);
  const double gemm_tflops = 2.0 * 8192.0 * 8192.0 * 8192.0 / gemm_s / 1e12;
  row("rate", "bf16 GEMM 8192^3", "TFLOP/s", gemm_tflops);
  for (int64_t s : {8192, 16384, 32768, 65536}) {
    for (const NamedKernel& kernel : cuda_kernels()) {
      const std::string n = "causal S=" + std::to_string(s) + " H=16 Dqk=192 Dv=128 " + kernel.name;
      try {
        auto opts = at::TensorOptions().device(cuda).dtype(at::kBFloat16);
        at::Tensor q = at::randn({1, s, h, dqk}, opts).transpose(1, 2).requires_grad_(true);
        at::Tensor k = at::randn({1, s, h, dqk}, opts).transpose(1, 2).requires_grad_(true);
        at::Tensor v = at::randn({1, s, h, dv}, opts).transpose(1, 2).requires_grad_(true);
        AttentionStructure st;
        st.causal = true;
        st.query_token_index = at::arange(s, at::kLong);
        st.key_token_index = st.query_token_index;
        const double scaling = 1.0 / std::sqrt(192.0);
        const double pairs = 0.5 * static_cast<double>(s) * static_cast<double>(s + 1) * h;
        const double fwd_flops = 2.0 * pairs * (dqk + dv);
        const double fwd = seconds_of([&] {
          at::NoGradGuard no_grad;
          piece_attention(q, k, v, scaling, st, kernel.kernel);
        }, 3);
        at::Tensor dout = at::randn({1, s, h, dv}, opts).transpose(1, 2);
        const double fwd_bwd = seconds_of([&] {
          at::Tensor out = piece_attention(q, k, v, scaling, st, kernel.kernel);
          out.backward(dout);
        }, 3);
        row("rate", n, "forward TFLOP/s", fwd_flops / fwd / 1e12);
        row("rate", n, "forward share of bf16 GEMM", fwd_flops / fwd / 1e12 / gemm_tflops);
        // backward = 2.5x the forward's FLOPs (five GEMM-shaped products against two)
        row("rate", n, "forward+backward TFLOP/s", 3.5 * fwd_flops / fwd_bwd / 1e12);
        row("rate", n, "forward+backward share of bf16 GEMM", 3.5 * fwd_flops / fwd_bwd / 1e12 / gemm_tflops);
      } catch (const std::exception& e) {
        row("rate", n, std::string("ERROR ") + first_line(e.what()), 1, 0);
      }
    }
  }
}

// Runs f with CUDA's sync debug mode at "error": 1 when a host synchronisation threw inside it.
double synchronised_in(const std::function<void()>& f, const std::string& what) {
  f();  // warm-up (allocations, the pinned pool)
  torch::cuda::synchronize();
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
  double synchronised = 0;
  try {
    f();
  } catch (const std::exception& e) {
    synchronised = 1;
    std::cout << "host synchronisation in " << what << ": " << first_line(e.what()) << std::endl;
  }
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  torch::cuda::synchronize();
  return synchronised;
}

void no_host_sync(const c10::Device& cuda) {
  const test::AttentionCase c = test::attention_cases()[4];  // head_tail shard with documents
  const AttentionStructure st = test::structure_of(c);
  auto opts = at::TensorOptions().device(cuda).dtype(at::kBFloat16);
  const int64_t sq = static_cast<int64_t>(c.q_tokens.size()), sk = static_cast<int64_t>(c.k_tokens.size());
  at::Tensor q = at::randn({c.batch, sq, c.heads, 16}, opts).transpose(1, 2).requires_grad_(true);
  at::Tensor k = at::randn({c.batch, sk, c.heads, 16}, opts).transpose(1, 2).requires_grad_(true);
  at::Tensor v = at::randn({c.batch, sk, c.heads, 8}, opts).transpose(1, 2).requires_grad_(true);
  for (const NamedKernel& kernel : cuda_kernels()) {
    const double n = synchronised_in([&] {
      at::Tensor out = piece_attention(q, k, v, 0.25, st, kernel.kernel);
      out.backward(at::ones_like(out));
    }, "attention " + kernel.name);
    row("sync", c.name + "/" + kernel.name, "host synchronisations in attention forward+backward", n, 0);
  }
  // The single-device MLA layer (positions, rope, projections, attention, output) under autocast.
  try {
    VerifyCase vc = default_single_device_cases()[0];
    vc.seq_len = 64;
    MlaAttention module = make_case_module(vc, at::kFloat);
    module->set_attention_kernel(AttentionKernel::blockwise);
    module->to(cuda);
    const CaseInputs in = inputs_on(make_case_inputs(vc, at::kFloat), cuda);
    const double n = synchronised_in([&] {
      compat::AutocastGuard autocast(c10::DeviceType::CUDA, true, at::kBFloat16);
      at::Tensor hidden = in.hidden.detach().requires_grad_(true);
      (module->forward(hidden, in.options).to(at::kFloat) * in.output_weight).sum().backward();
    }, "the MLA layer");
    row("sync", "MLA layer " + vc.name + " S=64 bf16", "host synchronisations in forward+backward", n, 0);
  } catch (const std::exception& e) {
    row("sync", "MLA layer", std::string("ERROR ") + first_line(e.what()), 1, 0);
  }
}

void layer_rate(const c10::Device& cuda) {
  try {
    MlaConfig config = preset_config("deepseek-v3");
    MlaAttention module(config, at::TensorOptions().dtype(at::kFloat).device(cuda));
    for (int64_t s : {4096, 16384}) {
      at::Tensor hidden = at::randn({1, s, config.hidden_size}, at::TensorOptions().device(cuda)).requires_grad_(true);
      compat::AutocastGuard autocast(c10::DeviceType::CUDA, true, at::kBFloat16);
      const double t = seconds_of([&] { module->forward(hidden).to(at::kFloat).sum().backward(); }, 3);
      row("rate", "MLA layer deepseek-v3 (128 heads) S=" + std::to_string(s), "forward+backward tokens/s", s / t);
    }
  } catch (const std::exception& e) {
    row("rate", "MLA layer deepseek-v3", std::string("ERROR ") + first_line(e.what()), 1, 0);
  }
}

}  // namespace
}  // namespace mlacp

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: mlacp_gpu_check OUT_DIR\n";
    return 2;
  }
  mlacp::tsv.open(std::string(argv[1]) + "/gpu_check.tsv");
  if (!torch::cuda::is_available()) {
    std::cerr << "mlacp_gpu_check: no CUDA device visible (torch::cuda::is_available() is false)\n";
    return 2;
  }
  const c10::Device cuda(c10::kCUDA, 0);
  std::cout << "CUDA devices: " << torch::cuda::device_count() << std::endl;
  for (auto step : {mlacp::attention_exactness, mlacp::layer_exactness, mlacp::no_host_sync, mlacp::attention_rates,
                    mlacp::layer_rate}) {
    try {
      step(cuda);
    } catch (const std::exception& e) {
      mlacp::row("error", "step", mlacp::first_line(e.what()), 1, 0);
    }
  }
  std::cout << (mlacp::all_passed ? "gpu check: every check passed" : "gpu check: FAILED checks above") << std::endl;
  return mlacp::all_passed ? 0 : 1;
}
