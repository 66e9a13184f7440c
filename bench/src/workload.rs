//! Workload generators. A workload is a fixed, seeded request sequence, so every system sees
//! exactly the same requests in the same order.

use attache_policies::rng::SplitMix64;

/// One request of a workload.
#[derive(Debug, Clone)]
pub struct Item {
    /// Which shared prefix the request uses.
    #[allow(dead_code)]
    pub group: usize,
    pub system: String,
    pub user: String,
    pub max_tokens: u64,
}

/// Shared-prefix chat: `groups` long system prompts, each followed by `per_group` distinct
/// questions, interleaved in a seeded random order (llm-d's shared-prefix shape, scaled down).
pub fn shared_prefix(
    groups: usize,
    per_group: usize,
    prefix_tokens: usize,
    question_tokens: usize,
    max_tokens: u64,
    seed: u64,
) -> Vec<Item> {
    let mut rng = SplitMix64::new(seed);
    const WORDS: [&str; 16] = [
        "policy", "tenant", "cache", "block", "engine", "route", "prefill", "decode", "token", "queue", "latency",
        "envoy", "filter", "snapshot", "index", "model",
    ];
    let text = |rng: &mut SplitMix64, tokens: usize| -> String {
        // ~4 bytes per simulated token.
        let mut s = String::with_capacity(tokens * 4 + 8);
        while s.len() < tokens * 4 {
            s.push_str(WORDS[(rng.next_u64() % WORDS.len() as u64) as usize]);
            s.push(' ');
        }
        s
    };
    let systems: Vec<String> = (0..groups)
        .map(|g| format!("You are assistant #{g}. Read this manual. {}", text(&mut rng, prefix_tokens)))
        .collect();
    let mut items = Vec::with_capacity(groups * per_group);
    for (g, system) in systems.iter().enumerate() {
        for q in 0..per_group {
            items.push(Item {
                group: g,
                system: system.clone(),
                user: format!("Question {q}: {}", text(&mut rng, question_tokens)),
                max_tokens,
            });
        }
    }
    // Fisher-Yates with the seeded generator.
    for i in (1..items.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        items.swap(i, j);
    }
    items
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_shaped() {
        let a = shared_prefix(3, 4, 100, 10, 8, 1);
        let b = shared_prefix(3, 4, 100, 10, 8, 1);
        assert_eq!(a.len(), 12);
        assert_eq!(a.iter().map(|i| &i.user).collect::<Vec<_>>(), b.iter().map(|i| &i.user).collect::<Vec<_>>());
        assert!(a.iter().all(|i| i.system.len() >= 400));
        let g0: Vec<_> = a.iter().filter(|i| i.group == 0).collect();
        assert_eq!(g0.len(), 4);
        assert!(g0.iter().all(|i| i.system == g0[0].system));
    }
}
