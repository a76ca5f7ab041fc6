//! What every door into Quarry shares, below HTTP: the kinds of failure it reports (one table
//! of names and statuses, which the server, job results, batch lines and the OpenAPI spec read).

pub mod error;

pub use error::ErrorKind;
