//! The rules on the cost model's predictions: `work` (work amounts finite and >= 0, parts
//! without parts) and `timing` (finite, ordered times that respect dependencies and stream
//! order).

use super::Checker;
use crate::ids::TaskId;

const TIME_EPS: f64 = 1e-6;

impl Checker<'_> {
    pub(super) fn work(&mut self) {
        for t in &self.plan.tasks {
            if t.work.amounts().any(|a| !(a >= 0.0 && a.is_finite())) {
                self.err(
                    "work",
                    format!(
                        "{} `{}` has a work amount that is negative or not finite",
                        t.id, t.name
                    ),
                );
            }
            if t.work.parts.iter().any(|p| !p.work.parts.is_empty()) {
                self.err(
                    "work",
                    format!(
                        "{} `{}` has a work part with parts of its own",
                        t.id, t.name
                    ),
                );
            }
        }
    }

    pub(super) fn timing(&mut self) {
        let p = self.plan;
        let mut last_end: Vec<Option<(f64, TaskId)>> = vec![None; p.streams.len()];
        for t in &p.tasks {
            if !(t.start_s.is_finite() && t.end_s.is_finite())
                || t.start_s > t.end_s
                || t.start_s < 0.0
            {
                self.err(
                    "timing",
                    format!(
                        "{} `{}` has predicted times {}..{}",
                        t.id, t.name, t.start_s, t.end_s
                    ),
                );
                continue;
            }
            for d in &t.deps {
                let dt = &p.tasks[d.index()];
                if dt.end_s > t.start_s + TIME_EPS {
                    self.err(
                        "timing",
                        format!(
                            "{} `{}` starts at {} before its dependency {d} ends at {}",
                            t.id, t.name, t.start_s, dt.end_s
                        ),
                    );
                }
            }
            if let Some((end, prev)) = last_end[t.stream.index()] {
                if end > t.start_s + TIME_EPS {
                    self.err(
                        "timing",
                        format!(
                            "{} `{}` starts at {} before {prev} on the same stream ends at {end}",
                            t.id, t.name, t.start_s
                        ),
                    );
                }
            }
            last_end[t.stream.index()] = Some((t.end_s, t.id));
        }
    }
}
