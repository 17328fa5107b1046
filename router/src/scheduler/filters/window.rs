use super::Rejection;
use crate::scheduler::{Candidate, Ctx, Filter};

/// Pods whose context holds the prompt. vLLM refuses a prompt of `max_model_len` tokens or more
/// (at exactly the limit no output token fits), and the pool may set a smaller window.
pub struct FitsWindow;

impl Filter for FitsWindow {
    fn check(&self, ctx: &Ctx<'_>, c: &Candidate<'_>) -> Result<(), Rejection> {
        let pool_window = ctx
            .req
            .pool
            .and_then(|p| p.context_window)
            .unwrap_or(u32::MAX);
        let window = c.pod.hello.engine.max_model_len.min(pool_window);
        if ctx.req.prompt_tokens < window {
            Ok(())
        } else {
            Err(Rejection::TooLong)
        }
    }
}
