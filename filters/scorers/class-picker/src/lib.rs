//! Class picker: a picker module. Of the candidates whose combined score is within `margin`
//! of the best, it chooses the best-scoring one of a preferred class (a pod label value), so
//! that a cheaper accelerator takes the requests it can serve about as well; when none of that
//! class is near the best, it leaves the pick alone. The picker honours the choice within the
//! scheduler's leading tier (a sticky session's endpoint and the prefix holders stay first).
//!
//! `params`: `{"label": "attache.io/accelerator", "prefer": "l4", "margin": 0.5}`. It scores
//! every candidate 0.5; roll it out with weight 0.

use attache_scorer_sdk::{scorer, Candidate, Params, Request, Scorer};

pub struct ClassPicker {
    label: String,
    prefer: String,
    margin: f64,
}

impl Scorer for ClassPicker {
    const CHOOSES: bool = true;

    fn configure(params: &Params) -> Result<Self, String> {
        let label = params.get("label").and_then(|v| v.as_str()).unwrap_or("attache.io/accelerator").to_owned();
        let prefer =
            params.get("prefer").and_then(|v| v.as_str()).ok_or("prefer: a label value is required")?.to_owned();
        let margin = params.get("margin").map_or(Ok(0.5), |v| v.as_f64().ok_or("margin: a number is required"))?;
        if !(margin.is_finite() && margin >= 0.0) {
            return Err(format!("margin {margin} must be a finite number >= 0"));
        }
        Ok(Self { label, prefer, margin })
    }

    fn score(&self, _request: &Request, _endpoint: &Candidate) -> f32 {
        0.5
    }

    fn choose(&self, request: &Request, totals: &[f64]) -> Option<usize> {
        let best = totals.iter().copied().filter(|t| t.is_finite()).fold(f64::NEG_INFINITY, f64::max);
        request
            .candidates
            .iter()
            .zip(totals)
            .enumerate()
            .filter(|(_, (c, t))| c.label(&self.label) == Some(self.prefer.as_str()) && **t >= best - self.margin)
            .max_by(|(_, (_, a)), (_, (_, b))| a.total_cmp(b))
            .map(|(i, _)| i)
    }
}

scorer!(ClassPicker);

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn request(classes: &[&str]) -> Request {
        Request {
            candidates: classes
                .iter()
                .enumerate()
                .map(|(i, c)| Candidate {
                    address: format!("10.0.0.{i}:8000"),
                    labels: vec![("attache.io/accelerator".into(), (*c).into())],
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn it_chooses_the_preferred_class_when_it_scores_near_the_best() {
        let p = ClassPicker::configure(&json!({"prefer": "l4", "margin": 0.5})).unwrap();
        let r = request(&["h100", "l4", "l4"]);
        assert_eq!(p.choose(&r, &[3.0, 2.7, 2.6]), Some(1), "the better l4 within the margin");
        assert_eq!(p.choose(&r, &[3.0, 2.0, 2.4]), None, "no l4 near the best: the pick stands");
        assert_eq!(p.choose(&request(&["h100"]), &[1.0]), None);
        assert!(ClassPicker::configure(&json!({})).is_err());
        assert!(ClassPicker::configure(&json!({"prefer": "l4", "margin": -1})).is_err());
    }
}
