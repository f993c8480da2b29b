//! How a command fails, and the exit code each failure gets.

use std::process::ExitCode;

use tower_distributed_limit::Error;

/// Why a command did not do what it was asked, by exit code (see `EXIT_CODES` in `main.rs`).
#[derive(Debug)]
pub enum Failure {
    /// Exit 1: not found, or it needs `--create` / `--yes`, or the library refused the input.
    Refused(String),
    /// Exit 3: Redis cannot be reached, or refused the call.
    Unreachable(String),
}

impl From<Error> for Failure {
    fn from(error: Error) -> Failure {
        match error {
            Error::Backend(_) => Failure::Unreachable(error.to_string()),
            other => Failure::Refused(other.to_string()),
        }
    }
}

impl Failure {
    pub fn exit_code(&self) -> ExitCode {
        match self {
            Failure::Refused(_) => ExitCode::from(1),
            Failure::Unreachable(_) => ExitCode::from(3),
        }
    }

    pub fn message(&self) -> &str {
        match self {
            Failure::Refused(message) | Failure::Unreachable(message) => message,
        }
    }
}
