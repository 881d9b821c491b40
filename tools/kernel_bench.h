// `mlacp bench-kernel`: forward and forward+backward GFLOP/s of the blockwise attention kernel
// next to this machine's measured GEMM rate (same dtype, same thread count, same run: re-measured
// just before each row), with the peak extra tensor memory of each call (counting CPU allocator)
// and the share of the CPUs the process actually got (shared hosts depress every rate).
//   mlacp bench-kernel                  S = 2048, 8192; float32, bf16; causal, full (2-4 min on 2 cores)
//   mlacp bench-kernel --seq 32768 --mask causal --dtype float32 --repeats 1   (minutes)
//   mlacp --threads 2 bench-kernel --json kernel.json
//   mlacp bench-kernel --vs-torch       also torch's scaled_dot_product_attention on the same
//                                       operands (V padded to Dqk; the backend it took named),
//                                       timed alternately with mlacp's kernel; mlacp's ratio to it
// Useful FLOPs: forward 2·B·H·Sq·Sk·(Dqk+Dv) (causal: half), backward 2.5× forward, so
// forward+backward = 3.5× forward. Table on stdout, progress on stderr.
#pragma once

#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "commands.h"

namespace mlacp::tools {

struct KernelBenchArgs {
  std::vector<int64_t> seq_lens{2048, 8192};
  std::vector<std::string> dtypes{"float32", "bfloat16"};
  std::vector<std::string> masks{"causal", "full"};
  int64_t batch = 1, heads = 16, dqk = 192, dv = 128;
  int repeats = 3;
  int64_t gemm_size = 2048;
  int64_t block_q = 0, block_k = 0;  // 0: the kernel's defaults
  bool skip_backward = false;
  // Kernel code paths to time (automatic: the kernel's own choice); each runs for the dtypes it
  // computes (float32 paths for float32, bf16 paths for bfloat16).
  std::vector<std::string> paths{"automatic"};
  // Memory layout of q, k, v (and dO): bhsd (head-major) or bshd (sequence-major, as the CP
  // runtime hands them over: [B,S,H,D] tensors viewed as [B,H,S,D]).
  std::vector<std::string> layouts{"bhsd"};
  std::string json_path;
  bool vs_torch = false;  // also time torch's SDPA (kernels/torch_sdpa.h; LibTorch 2.x)
};

CLI::App* add_kernel_bench_command(CLI::App& app, KernelBenchArgs& args);
int run_kernel_bench(const CommonArgs& common, const KernelBenchArgs& args);

}  // namespace mlacp::tools
