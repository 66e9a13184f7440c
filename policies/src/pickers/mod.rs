//! Pickers choose the primary endpoint and the fallbacks from a profile's scored candidates.

pub mod max_score;

/// The tier a candidate leads in, highest first: the verdict the score order alone must not
/// overturn (a session's sticky endpoint, then the affinity filter's holders).
pub mod tier {
    pub const NONE: u8 = 0;
    pub const AFFINE: u8 = 1;
    pub const STICKY: u8 = 2;
}

/// One picking plugin.
pub trait Picker: Sync {
    /// The plugin type, in llm-d's vocabulary.
    fn name(&self) -> &'static str;
    /// One line for the generated configuration reference.
    fn doc(&self) -> &'static str;
    /// Candidate positions, best first: every candidate, higher tiers leading. `seed` breaks
    /// ties, so the same request gets the same order.
    fn pick(&self, totals: &[f64], tiers: &[u8], seed: u64) -> Vec<usize>;
}

/// Every built-in picker.
pub static REGISTRY: &[&dyn Picker] = &[&max_score::MaxScore];

/// The picker registered under `name`.
pub fn find(name: &str) -> Option<&'static dyn Picker> {
    REGISTRY.iter().copied().find(|p| p.name() == name)
}
