//! The bound on engine requests admitted and not finished (`--max-pending`).

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{ErrorKind, ServiceError};

/// A permit per engine request, taken before it is submitted and held as long as it runs, so
/// requests arriving together cannot all pass a check of the engine's queue made before any of
/// them is in it.
pub struct Admission {
    permits: Arc<Semaphore>,
    max: usize,
}

impl Admission {
    pub fn new(max_pending: usize) -> Self {
        let max = max_pending.min(u32::MAX as usize);
        Admission {
            permits: Arc::new(Semaphore::new(max)),
            max,
        }
    }

    /// Engine requests admitted and not finished.
    pub fn pending(&self) -> usize {
        self.max - self.permits.available_permits()
    }

    /// Permits for `adding` more engine requests, else `queue_full` (retry after a second). A
    /// request that needs more than the whole bound could never be admitted: `too_many_choices`,
    /// since retrying it is pointless (and job items wait out `queue_full`). The permits go back
    /// when the value is dropped.
    pub fn admit(&self, adding: usize) -> Result<OwnedSemaphorePermit, ServiceError> {
        let max = self.max;
        if adding > max {
            return Err(ServiceError::new(
                ErrorKind::TooManyChoices,
                format!(
                    "this request needs {adding} engine requests at once and the server admits at most {max} (--max-pending); ask for fewer choices (`n`)"
                ),
            ));
        }
        self.permits.clone().try_acquire_many_owned(adding as u32).map_err(|_| {
            let mut err = ServiceError::new(
                ErrorKind::QueueFull,
                format!("{} requests are pending already; retry later", self.pending()),
            );
            err.retry_after = Some(1);
            err
        })
    }
}
