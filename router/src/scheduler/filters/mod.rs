//! Filters: a pod either may take the request or may not (ready, serves the model, fits the
//! window). Saturation is not a filter: a busy or full pod may still be the best place for a
//! request, which only a comparison with its siblings can tell (see `scheduler::saturation`).

mod model;
mod ready;
mod window;

pub use model::ServesModel;
pub use ready::Ready;
pub use window::FitsWindow;
