//! Static-file discovery: follow an endpoints file ([`crate::endpoints`]) and apply each version
//! of it to a [`Sink`].

use std::path::PathBuf;

use tracing::{info, warn};

use super::Sink;
use crate::endpoints::StaticEndpoints;

/// Follow `path`: re-read it when its modification time changes and apply it to `sink`. A
/// stat(2) every 200 ms, so an edited file takes effect within a fifth of a second; a file that
/// does not load keeps the previous endpoints.
pub fn spawn_watch(path: PathBuf, mut sink: Sink) {
    tokio::spawn(async move {
        let mut last = std::fs::metadata(&path).and_then(|m| m.modified()).ok();
        loop {
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            let now = std::fs::metadata(&path).and_then(|m| m.modified()).ok();
            if now == last {
                continue;
            }
            last = now;
            match StaticEndpoints::load(&path) {
                Ok(eps) => {
                    info!(endpoints = eps.endpoints.len(), "discovery: static file reloaded");
                    sink.apply(eps).await;
                }
                Err(e) => warn!(error = %e, "discovery: keeping the previous endpoints"),
            }
        }
    });
}
