//! Measurement probes inside [`crate::plan::plan`]: named points a host can time.
//!
//! The crate has no clock: a host that wants the split registers a function ([`set`]) that
//! reads its own and attributes the time since its previous reading to the probe's name. The
//! filter registers one when its `stage_timings` option is on; until something registers, a
//! probe is one check of an empty cell.

use std::sync::OnceLock;

/// What a host calls at each probe.
pub type Hook = fn(&'static str);

static HOOK: OnceLock<Hook> = OnceLock::new();

/// Register the host's hook (the first registration wins).
pub fn set(hook: Hook) {
    let _ = HOOK.set(hook);
}

/// The work named `name` just ended.
#[inline]
pub fn mark(name: &'static str) {
    if let Some(h) = HOOK.get() {
        h(name);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    static SEEN: AtomicUsize = AtomicUsize::new(0);

    #[test]
    fn a_registered_hook_sees_each_mark() {
        super::mark("before");
        assert_eq!(SEEN.load(Ordering::Relaxed), 0, "no hook, no call");
        super::set(|name| {
            assert!(!name.is_empty());
            SEEN.fetch_add(1, Ordering::Relaxed);
        });
        super::mark("a");
        super::mark("b");
        assert_eq!(SEEN.load(Ordering::Relaxed), 2);
    }
}
