//! Prefill/decode disaggregation: llm-d's `prefix-based-pd-decider` (`reference/llmd.md` §1.4).
//!
//! The decode profile runs first and picks the primary endpoint. If the prompt's tokens that
//! endpoint does *not* hold reach `threshold_tokens`, the prefill profile picks a separate
//! prefill endpoint, passed to the decode side as `x-prefiller-host-port`; the decode pod's
//! sidecar runs the prefill there (`max_tokens: 1`, `kv_transfer_params.do_remote_decode`) and
//! decodes with the transferred KV.

use serde::{Deserialize, Serialize};

/// llm-d's P/D header: `ip:port` of the prefill endpoint.
pub const PREFILLER_HEADER: &str = "x-prefiller-host-port";

/// P/D settings (the scheduler's `pd` section).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct PdConfig {
    /// Disaggregate when the prompt's uncached tokens on the chosen decode endpoint reach this
    /// (llm-d's `nonCachedTokens`); 0 disables P/D.
    pub threshold_tokens: usize,
}

impl Default for PdConfig {
    fn default() -> Self {
        Self { threshold_tokens: 16 }
    }
}

/// Whether a prompt of `prompt_tokens`, of which the decode endpoint holds `cached_tokens`,
/// should be prefilled elsewhere.
pub fn should_disaggregate(cfg: &PdConfig, prompt_tokens: usize, cached_tokens: usize) -> bool {
    cfg.threshold_tokens > 0 && prompt_tokens.saturating_sub(cached_tokens) >= cfg.threshold_tokens
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_only_long_uncached_prompts() {
        let cfg = PdConfig::default();
        assert!(should_disaggregate(&cfg, 2000, 0));
        assert!(should_disaggregate(&cfg, 2000, 1984), "exactly 16 uncached");
        assert!(!should_disaggregate(&cfg, 2000, 1990), "10 uncached: decode prefills it");
        assert!(!should_disaggregate(&cfg, 10, 0), "a short prompt");
        assert!(!should_disaggregate(&cfg, 5000, 6000), "more cached than asked");
        let off = PdConfig { threshold_tokens: 0 };
        assert!(!should_disaggregate(&off, 100_000, 0), "0 disables P/D");
    }
}
