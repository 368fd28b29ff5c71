//! CPU reference of every op, in plain Rust f32 (rayon for parallelism).
//!
//! | op | what | file |
//! |---|---|---|
//! | `matmul`, `linear_fwd` | GEMM, `y = x W^T + b` | `matmul.rs` |
//! | `rmsnorm_fwd` | RMSNorm | `norm.rs` |
//! | `rope_fwd` | rotate-half RoPE with per-token cos/sin tables | `rope.rs` |
//! | `swiglu_fwd`, `gelu_fwd`, `add_fwd`, `embedding_fwd` | elementwise, gather | `act.rs` |
//! | `attention_fwd`, `attention_decode` | varlen / windowed / shared-prefix attention, decode | `attention.rs` |
//! | `softmax`, `logprobs_fwd`, `argmax` | row reductions over the vocabulary | `softmax.rs` |
//! | `*_bwd` | backward of every op above | `backward/` (one file per op family) |
//! | `sumsq_partial`, `scale`, `gather_sum_rows`, `add_into` | the training step's gradient sums, clip, row sums | `grad.rs` |
//! | `philox4x32_10`, `uniform_open01` | the counter-based RNG of sampling and initialisation | `philox.rs` |
//! | `seq_log_ratio` | a sequence's mean log-ratio (the policy loss's sequence ratio, GSPO) | `policy_loss.rs` |
//!
//! Invariant: every op is deterministic and batch-composition independent: an output row's
//! bits depend only on the inputs it reads, never on the other rows of the batch or on the
//! number of threads (no rayon reductions; all sums in a fixed order).

pub mod act;
pub mod attention;
pub mod backward;
pub mod grad;
pub mod matmul;
pub mod norm;
pub mod philox;
pub mod policy_loss;
pub mod rope;
pub mod softmax;
#[cfg(test)]
pub(crate) mod testutil;

pub use act::{add_fwd, embedding_fwd, gelu_fwd, silu, swiglu_fwd};
pub use attention::{attention_decode, attention_fwd, AttnDims, AttnMask, AttnSeq, DecodeSeq};
pub use backward::{
    attention_bwd, embedding_bwd, gelu_bwd, gelu_tanh_bwd, linear_bwd, logprobs_bwd, rmsnorm_bwd,
    rope_bwd, swiglu_bwd,
};
pub use matmul::{linear_fwd, matmul, Gemm};
pub use norm::rmsnorm_fwd;
pub use philox::{philox4x32_10, uniform_open01};
pub use policy_loss::seq_log_ratio;
pub use rope::rope_fwd;
pub use softmax::{argmax, logprobs_fwd, softmax};
