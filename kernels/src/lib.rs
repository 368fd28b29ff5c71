//! Kernels: CPU reference ops and CUDA kernels.
