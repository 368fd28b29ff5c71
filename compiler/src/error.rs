//! Compile errors. A [`CompileError::User`] is a job that cannot be compiled as written: it
//! names the spec field at fault (the binary maps it to a source span) and says what would
//! work, with numbers. A [`CompileError::Internal`] is a compiler bug.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum CompileError {
    #[error("{message}")]
    User {
        message: String,
        /// Dotted path of the spec field at fault (`rollout.prompts_per_iter`), if one is.
        field: Option<String>,
        help: Option<String>,
    },
    #[error("internal compiler error: {0}")]
    Internal(String),
}

impl CompileError {
    pub fn user(field: &str, message: impl Into<String>, help: impl Into<String>) -> CompileError {
        let help = help.into();
        CompileError::User {
            message: message.into(),
            field: if field.is_empty() {
                None
            } else {
                Some(field.to_string())
            },
            help: if help.is_empty() { None } else { Some(help) },
        }
    }

    pub fn internal(message: impl Into<String>) -> CompileError {
        CompileError::Internal(message.into())
    }

    pub fn is_user(&self) -> bool {
        matches!(self, CompileError::User { .. })
    }
}

pub type Result<T> = std::result::Result<T, CompileError>;

/// `bytes` as GiB with two decimals, for messages.
pub fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}
