//! Errors at the engine's boundary: a bad configuration, a request the engine refuses, and the
//! prompt-length check whose messages must match vLLM's text byte for byte because the HTTP layer
//! returns them to clients (and the router recognises them to resend to a larger pool).

use thiserror::Error;

/// A configuration field that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ConfigError {
    /// `field` is the vLLM flag / config field name.
    #[error("invalid engine config `{field}`: {reason}")]
    Invalid {
        /// The offending field.
        field: &'static str,
        /// Why it is rejected.
        reason: String,
    },
}

/// Why [`super::Engine::submit`] refused a request.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum EngineError {
    /// The id is already waiting or running.
    #[error("request id `{0}` is already in the engine")]
    DuplicateRequestId(String),
    /// The prompt does not fit the context window; the message is vLLM's.
    #[error(transparent)]
    PromptLength(#[from] PromptLengthError),
    /// vLLM requires `max_tokens >= 1`.
    #[error("max_tokens must be at least 1, got {0}.")]
    InvalidMaxTokens(usize),
}

/// A prompt rejected for its length, with vLLM's exact error text.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PromptLengthError {
    /// vLLM: "The decoder prompt cannot be empty".
    #[error("The decoder prompt cannot be empty")]
    Empty,
    /// Prompt longer than `max_model_len`: the OpenAI server's 400 with `param: "input_tokens"`.
    #[error(
        "This model's maximum context length is {max_model_len} tokens. However, your prompt \
         contains {prompt_len} input tokens, which exceeds this limit even without any output \
         tokens. Please reduce the length of the input prompt. (parameter=input_tokens, \
         value={prompt_len})"
    )]
    ExceedsContext {
        /// Tokens in the prompt.
        prompt_len: usize,
        /// The engine's `max_model_len`.
        max_model_len: usize,
    },
    /// Prompt of exactly `max_model_len`: no room for the one output token every request asks for.
    #[error(
        "The decoder prompt (length {prompt_len}) plus the number of requested output tokens \
         (at least 1) is longer than the maximum model length of {max_model_len}. Make sure that \
         `max_model_len` is no smaller than the number of text tokens (prompt + requested output \
         tokens)."
    )]
    NoRoomForOutput {
        /// Tokens in the prompt (equal to `max_model_len`).
        prompt_len: usize,
        /// The engine's `max_model_len`.
        max_model_len: usize,
    },
}

impl PromptLengthError {
    /// The OpenAI error `param` vLLM reports with this error, if any.
    pub fn param(&self) -> Option<&'static str> {
        match self {
            Self::ExceedsContext { .. } => Some("input_tokens"),
            Self::Empty | Self::NoRoomForOutput { .. } => None,
        }
    }
}

/// The check vLLM's front end applies before any work: call it before [`super::Engine::submit`]
/// to produce the HTTP 400 (submit applies it too).
pub fn check_prompt_len(prompt_len: usize, max_model_len: usize) -> Result<(), PromptLengthError> {
    if prompt_len == 0 {
        Err(PromptLengthError::Empty)
    } else if prompt_len > max_model_len {
        Err(PromptLengthError::ExceedsContext {
            prompt_len,
            max_model_len,
        })
    } else if prompt_len == max_model_len {
        Err(PromptLengthError::NoRoomForOutput {
            prompt_len,
            max_model_len,
        })
    } else {
        Ok(())
    }
}
