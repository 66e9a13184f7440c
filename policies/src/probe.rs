//! Measurement probes inside [`crate::plan::plan`]: named points a host can time.
//!
//! Only with the `probes` feature, which the filter's `stage-timings` measurement build turns
//! on. The crate has no clock: the host registers a function ([`set`]) that reads its own and
//! attributes the time since its previous reading to the probe's name. Without the feature,
//! [`mark`] is empty and compiles away.

/// What a host calls at each probe.
pub type Hook = fn(&'static str);

#[cfg(feature = "probes")]
static HOOK: std::sync::OnceLock<Hook> = std::sync::OnceLock::new();

/// Register the host's hook (the first registration wins).
#[cfg(feature = "probes")]
pub fn set(hook: Hook) {
    let _ = HOOK.set(hook);
}

/// The work named `name` just ended.
#[cfg(feature = "probes")]
#[inline]
pub fn mark(name: &'static str) {
    if let Some(h) = HOOK.get() {
        h(name);
    }
}

/// Register the host's hook (no probes in this build).
#[cfg(not(feature = "probes"))]
pub fn set(_hook: Hook) {}

/// The work named `name` just ended (no probes in this build).
#[cfg(not(feature = "probes"))]
#[inline(always)]
pub fn mark(_name: &'static str) {}

#[cfg(all(test, feature = "probes"))]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    static SEEN: AtomicUsize = AtomicUsize::new(0);

    #[test]
    fn a_registered_hook_sees_each_mark() {
        super::set(|name| {
            assert!(!name.is_empty());
            SEEN.fetch_add(1, Ordering::Relaxed);
        });
        super::mark("a");
        super::mark("b");
        assert_eq!(SEEN.load(Ordering::Relaxed), 2);
    }
}
