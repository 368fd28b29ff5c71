//! Kernels: the CPU reference of every op (module [`cpu`]) and, later, their CUDA twins.
//!
//! Every op has one name shared by the CPU function, the CUDA kernel and its Rust launcher
//! (`rmsnorm_fwd` here is `rmsnorm_fwd` there), and the same argument order: outputs first, then
//! inputs, then sizes. CPU ops work on plain `f32` slices in row-major layout; shapes are given
//! in each op's doc comment as `[rows, cols]`.
//!
//! Invariant: nothing here knows about plans, RL or model files; ops take slices and sizes and
//! return `Result<(), KernelError>` on shape mismatches instead of panicking.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

/// A kernel was called with buffers that do not match the sizes it was given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    #[error("{op}: {what}")]
    Shape { op: &'static str, what: String },
}

pub type Result<T> = std::result::Result<T, KernelError>;

/// Checks that buffer `name` of op `op` holds exactly `want` elements.
pub(crate) fn check_len(op: &'static str, name: &str, got: usize, want: usize) -> Result<()> {
    if got != want {
        return Err(KernelError::Shape {
            op,
            what: format!("{name} has {got} elements, expected {want}"),
        });
    }
    Ok(())
}

/// Checks that buffer `name` holds at least `want` elements (arena views may be larger).
pub(crate) fn check_min_len(op: &'static str, name: &str, got: usize, want: usize) -> Result<()> {
    if got < want {
        return Err(KernelError::Shape {
            op,
            what: format!("{name} has {got} elements, needs at least {want}"),
        });
    }
    Ok(())
}

pub(crate) fn shape_err(op: &'static str, what: String) -> KernelError {
    KernelError::Shape { op, what }
}
