//! The host's integration tests, in one binary: each linked test binary costs about 20 s of CI
//! (the host library and its dependencies linked again), and these share everything.

mod fleet_stream;
mod index_stream;
mod kv_wire;
mod policy_cli;
mod snapshot_stream;
