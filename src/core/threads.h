// Intra-op threads of this process: LibTorch's pool and the BLAS library's own pool.
#pragma once

namespace mlacp {

// Sets LibTorch's intra-op threads and, when the BLAS behind it is OpenBLAS, OpenBLAS's pool too:
// at::set_num_threads does not reach it, and its idle workers spin on the cores other ranks of
// this host compute on (measured: ~40% of a 2-rank step on a 2-core host).
void set_intra_op_threads(int threads);

// The count last given to set_intra_op_threads (0: never set). Read by code that runs a BLAS
// outside LibTorch's pool (kernels/float32_gemm.cpp) from threads LibTorch's setting does not reach.
int intra_op_threads();

// Whether the BLAS library's thread count could be set (false: no OpenBLAS loaded).
bool blas_threads_settable();

// Puts this process's threads, and the ones it starts later, under SCHED_BATCH: a woken thread
// no longer preempts the running one. On a CPU host the communication backend's threads (Gloo's
// socket loops) then stop interrupting the computation at every arriving packet and read in
// larger pieces; measured in `mlacp bench` (2 ranks on 2 cores): ~6 points more of the overlapped
// transfers' time saved. Call before the process groups exist. Returns false where the
// scheduler refuses it or off Linux (nothing changed).
bool use_batch_scheduling();

}  // namespace mlacp
