//! Filters: a pod either may take the request or may not. Hard filters first (ready, serves the
//! model, fits the window), saturation last, because when every pod is saturated the request
//! still goes somewhere: to the shortest queue.

mod model;
mod ready;
mod saturation;
mod window;

pub use model::ServesModel;
pub use ready::Ready;
pub use saturation::NotSaturated;
pub use window::FitsWindow;
