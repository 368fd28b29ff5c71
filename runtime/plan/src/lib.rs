//! The Rollplex plan format: the job spec every plan carries ([`spec`]), machine-independent
//! work descriptors ([`work`]), typed ids ([`ids`]), the plan types ([`plan`]), the binary and
//! YAML codecs ([`codec`]) and the verifier ([`validate`]); and what the DSL and the runtime
//! both know of a model's dimensions: the built-in presets ([`models`]) and the reader of a
//! Hugging Face `config.json` ([`hf_config`]); and the one bounded reader and atomic writer of
//! the files users name ([`files`]).
//!
//! Invariant: this crate knows nothing of the DSL, the solver or the GPU. It is the only thing
//! that crosses from the compiler to the runtime.
pub mod codec;
pub mod files;
pub mod hf_config;
pub mod ids;
pub mod models;
pub mod plan;
pub mod roofline;
pub mod spec;
pub mod validate;
pub mod work;

pub use codec::{decode, encode, from_yaml, to_yaml, DecodeError, Header, FORMAT_VERSION};
pub use ids::{ArenaId, BufferId, GpuId, Groups, Span, StreamId, TaskId, WindowId};
pub use plan::*;
pub use validate::{validate, Violation, Violations};
