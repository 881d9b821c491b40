// Intra-op threads of this process: LibTorch's pool and the BLAS library's own pool.
#pragma once

namespace mlacp {

// Sets LibTorch's intra-op threads and, when the BLAS behind it is OpenBLAS, OpenBLAS's pool too:
// at::set_num_threads does not reach it, and its idle workers spin on the cores other ranks of
// this host compute on (measured: ~40% of a 2-rank step on a 2-core host).
void set_intra_op_threads(int threads);

// Whether the BLAS library's thread count could be set (false: no OpenBLAS loaded).
bool blas_threads_settable();

}  // namespace mlacp
