//! Differential check (`bench/decisions-ab/run.sh <older commit>`): the scheduler at an older
//! commit and at this checkout, fed the same seeded request stream and the same state, must
//! make the same decisions.
use hashbrown::HashMap;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn f(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn pool(r: &mut Rng, n: usize, pd: bool) -> serde_json::Value {
    let eps: Vec<serde_json::Value> = (0..n)
        .map(|i| {
            let role = if pd && i < 2 { "prefill" } else if pd && i < 4 { "decode" } else { "both" };
            let mut models = vec!["m".to_string()];
            if i % 3 == 0 { models.push("sql".into()); }
            let lora = if i % 3 == 0 { serde_json::json!({"running": if r.below(2)==0 {vec!["sql"]} else {vec![]}, "waiting": [], "max_lora": 2}) } else { serde_json::Value::Null };
            serde_json::json!({
                "id": i, "address": format!("10.0.0.{i}:8000"), "models": models, "role": role,
                "ready": r.below(20) != 0, "block_size": 16, "labels": [],
                "metrics": if r.below(10) == 0 { serde_json::Value::Null } else { serde_json::json!({
                    "waiting": r.below(8) as f64, "running": r.below(16) as f64, "kv_usage": r.f(),
                    "age_ms": if r.below(10)==0 { 5000 } else { r.below(500) }, "ttft_ms": 0.0}) },
                "lora": lora,
            })
        })
        .collect();
    serde_json::json!({"version": 1, "endpoints": eps})
}

fn main() {
    let mut r = Rng(7);
    let (mut same, mut total, mut errs) = (0, 0, 0);
    for world in 0..40u64 {
        let pd = world % 4 == 3;
        let mut ocfg = old::SchedulerConfig::default();
        let mut ncfg = new::SchedulerConfig::default();
        if world % 5 == 1 {
            ocfg.prefix.affinity_filter.enabled = false;
            ncfg.prefix.affinity_filter.enabled = false;
        }
        if world % 7 == 2 {
            ocfg.prefix.affinity_threshold = 0.0;
            ncfg.prefix.affinity_threshold = 0.0;
        }
        let os = old::Scheduler::new(ocfg);
        let ns = new::Scheduler::new(ncfg).unwrap();
        let mut ost = os.new_state();
        let mut nst = ns.new_state();
        let mut pj = pool(&mut r, 8, pd);
        for req in 0..500u64 {
            if req % 50 == 0 {
                pj = pool(&mut r, 8, pd);
            }
            let opool: old::PoolState = serde_json::from_value(pj.clone()).unwrap();
            let npool: new::PoolState = serde_json::from_value(pj.clone()).unwrap();
            let group = r.below(12);
            let words = 200 + r.below(2000) as usize;
            let text = format!("{} {}", format!("system prompt {group} ").repeat(words / 4), r.below(1000));
            let model = if r.below(8) == 0 { "sql" } else { "m" };
            let ohashes = old::prefix::block_hashes(&os.config.prefix, model, None, &old::Prompt::Text(text.clone()));
            let nhashes = new::prefix::block_hashes(&ns.config.prefix, model, None, &new::Prompt::Text(text.clone()));
            assert_eq!(ohashes, nhashes);
            let mut inflight: HashMap<String, u32> = HashMap::new();
            for i in 0..8 {
                if r.below(3) == 0 {
                    inflight.insert(format!("10.0.0.{i}:8000"), r.below(5) as u32);
                }
            }
            let mut tokens: HashMap<String, u64> = HashMap::new();
            for k in inflight.keys() {
                tokens.insert(k.clone(), r.below(400_000));
            }
            let extra: Option<HashMap<String, usize>> = (r.below(3) == 0).then(|| {
                [(format!("10.0.0.{}:8000", r.below(8)), r.below(nhashes.len() as u64 + 1) as usize)]
                    .into_iter()
                    .collect()
            });
            let precise: Option<HashMap<u32, (f64, usize)>> =
                (r.below(3) == 0).then(|| [(r.below(8) as u32, (r.f(), r.below(300) as usize))].into_iter().collect());
            let sticky = (r.below(4) == 0).then(|| format!("10.0.0.{}:8000", r.below(9)));
            let load_only = r.below(15) == 0;
            let prompt_tokens = text.len() / 4;
            let seed = nhashes.first().copied().unwrap_or(req);
            let oi = old::SchedulingInput {
                model,
                block_hashes: &ohashes,
                anchors: &[],
                inflight: &inflight,
                inflight_tokens: Some(&tokens),
                seed,
                extra_matches: extra.as_ref(),
                precise: precise.as_ref(),
                prompt_tokens,
                sticky: sticky.as_deref(),
                load_only,
            };
            let ni = new::SchedulingInput {
                model,
                block_hashes: &nhashes,
                anchors: &[],
                inflight: &inflight,
                inflight_tokens: Some(&tokens),
                seed,
                extra_matches: extra.as_ref(),
                precise: precise.as_ref(),
                prompt_tokens,
                sticky: sticky.as_deref(),
                load_only,
                subset: None,
                session_key: None,
            };
            let od = os.schedule(&oi, &opool, &mut ost);
            let nd = ns.schedule(&ni, &npool, &nst);
            total += 1;
            match (od, nd) {
                (Ok(o), Ok(n)) => {
                    let ok = o.endpoints == n.endpoints
                        && o.prefiller() == n.prefiller()
                        && o.cold == n.cold
                        && o.sticky == n.sticky
                        && o.tiers == n.tiers
                        && o.scores
                            .iter()
                            .zip(&n.scores)
                            .all(|(a, b)| a.total.to_bits() == b.total.to_bits() && a.cached_tokens == b.cached_tokens);
                    if ok {
                        same += 1
                    } else if total - same < 5 {
                        eprintln!("world {world} req {req}: old {:?} new {:?}", o.endpoints, n.endpoints);
                    }
                    os.commit(&o, &ohashes, &[], &mut ost);
                    nst.commit(&n, &nhashes, &[]);
                }
                (Err(a), Err(b)) => {
                    errs += 1;
                    if a.to_string() == b.to_string() {
                        same += 1
                    }
                }
                (a, b) => eprintln!(
                    "world {world} req {req}: old {:?} new {:?}",
                    a.map(|d| d.endpoints),
                    b.map(|d| d.endpoints)
                ),
            }
        }
    }
    println!(
        "{same} of {total} decisions identical ({errs} refusals), endpoints, prefiller, tiers, totals bit for bit"
    );
    std::process::exit(if same == total { 0 } else { 1 });
}
