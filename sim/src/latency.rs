//! Step-time model. Prefill cost grows with the uncached tokens computed in a step, decode cost
//! with KV occupancy; both are Dynamo mocker's default polynomials (ms), as recorded in
//! `reference/engines.md` §5.2.

/// Prefill time (ms) for `tokens` uncached tokens computed in one step.
pub fn prefill_ms(tokens: usize) -> f64 {
    if tokens == 0 {
        return 0.0;
    }
    let t = tokens as f64;
    4.209989e-07 * t * t + 1.518344e-02 * t + 16.50142
}

/// Decode time (ms) of one step at KV occupancy `u` (0..1).
pub fn decode_ms(u: f64) -> f64 {
    let u = u.clamp(0.0, 1.0);
    (-25.74 * u * u + 54.01 * u + 5.74).max(1.0)
}

/// Time (ms) of a step that prefills `prefill_tokens` and decodes `decode_seqs` sequences.
pub fn step_ms(prefill_tokens: usize, decode_seqs: usize, kv_usage: f64) -> f64 {
    scaled_step_ms(prefill_tokens, decode_seqs, kv_usage, 1.0, 1.0)
}

/// [`step_ms`] with the prefill and decode parts multiplied (hardware calibration).
pub fn scaled_step_ms(
    prefill_tokens: usize,
    decode_seqs: usize,
    kv_usage: f64,
    prefill_scale: f64,
    decode_scale: f64,
) -> f64 {
    let d = if decode_seqs > 0 { decode_ms(kv_usage) } else { 0.0 };
    prefill_ms(prefill_tokens) * prefill_scale + d * decode_scale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uncached_tokens_cost_more_and_occupancy_slows_decode() {
        assert_eq!(prefill_ms(0), 0.0);
        assert!(prefill_ms(3000) > 3.0 * prefill_ms(100));
        assert!(decode_ms(0.8) > decode_ms(0.1));
        assert!(step_ms(0, 0, 0.5) == 0.0 && step_ms(0, 4, 0.5) > 0.0);
    }
}
