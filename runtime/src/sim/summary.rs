//! The console summary of a [`SimReport`]: iteration time, phases, kinds, windows, and SM /
//! HBM use over time as one-line charts.

use std::io::{self, Write};

use rollplex_plan::work::WorkKind;

use super::SimReport;

const GIB: f64 = (1u64 << 30) as f64;
const BARS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];
/// Columns of the over-time charts.
const WIDTH: usize = 64;

/// `values` (each in 0..=1) as a line of block characters.
fn sparkline(values: &[f64]) -> String {
    values
        .iter()
        .map(|v| {
            if v.is_nan() || *v <= 0.0 {
                ' '
            } else {
                BARS[((v * 8.0).ceil() as usize).clamp(1, 8) - 1]
            }
        })
        .collect()
}

/// Time-average of a step function `(t, value)` over each of `n` equal bins of `[0, end]`.
pub(crate) fn binned(steps: &[(f64, f64)], end: f64, n: usize) -> Vec<f64> {
    let mut out = vec![0.0; n];
    if end <= 0.0 || steps.is_empty() {
        return out;
    }
    let w = end / n as f64;
    for (k, pair) in steps.iter().enumerate() {
        let (t0, v) = *pair;
        let t1 = steps.get(k + 1).map(|p| p.0).unwrap_or(end).min(end);
        if t1 <= t0 {
            continue;
        }
        let (first, last) = ((t0 / w) as usize, ((t1 / w).ceil() as usize).min(n));
        for (b, slot) in out.iter_mut().enumerate().take(last).skip(first) {
            let (lo, hi) = (b as f64 * w, (b + 1) as f64 * w);
            let overlap = (t1.min(hi) - t0.max(lo)).max(0.0);
            *slot += v * overlap / w;
        }
    }
    out
}

/// Seconds in a readable unit.
pub(crate) fn secs(s: f64) -> String {
    if !s.is_finite() {
        "inf".into()
    } else if s >= 1.0 {
        format!("{s:.3} s")
    } else if s >= 1e-3 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{:.1} us", s * 1e6)
    }
}

impl SimReport {
    /// Writes the summary (see the module doc).
    pub fn print_summary(&self, w: &mut impl Write) -> io::Result<()> {
        let end = self.iteration_s;
        writeln!(
            w,
            "simulated {} ({} mode, {} x {}), cost model: {}",
            self.name, self.mode, self.gpu_count, self.gpu, self.cost_source
        )?;
        for warning in &self.warnings {
            writeln!(w, "warning: {warning}")?;
        }
        let vs_plan = if self.planned_iteration_s > 0.0 {
            format!(
                " (plan predicted {}, {:+.1}%)",
                secs(self.planned_iteration_s),
                (end / self.planned_iteration_s - 1.0) * 100.0
            )
        } else {
            String::new()
        };
        writeln!(w, "predicted iteration time: {}{vs_plan}", secs(end))?;

        writeln!(
            w,
            "\n{:<10} {:>11} {:>11} {:>11} {:>7} {:>14}",
            "phase", "start", "end", "span", "tasks", "task time"
        )?;
        for p in self.phases.iter().filter(|p| p.tasks > 0) {
            writeln!(
                w,
                "{:<10} {:>11} {:>11} {:>11} {:>7} {:>14}",
                format!("{:?}", p.phase).to_lowercase(),
                secs(p.start_s),
                secs(p.end_s),
                secs(p.end_s - p.start_s),
                p.tasks,
                secs(p.task_s)
            )?;
        }

        writeln!(
            w,
            "\n{:<18} {:>6} {:>12} {:>12} {:>9} {:>9}",
            "kind", "tasks", "alone", "simulated", "avg SMs", "slowdown"
        )?;
        let mut kinds: Vec<WorkKind> = self.tasks.iter().map(|t| t.kind).collect();
        kinds.sort();
        kinds.dedup();
        for k in kinds {
            let ts: Vec<_> = self.tasks.iter().filter(|t| t.kind == k).collect();
            let alone: f64 = ts.iter().map(|t| t.alone_s).sum();
            let sim: f64 = ts.iter().map(|t| t.duration_s()).sum();
            let wsum = |f: &dyn Fn(&super::SimTask) -> f64| {
                if sim > 0.0 {
                    ts.iter().map(|t| f(t) * t.duration_s()).sum::<f64>() / sim
                } else {
                    0.0
                }
            };
            writeln!(
                w,
                "{:<18} {:>6} {:>12} {:>12} {:>9.0} {:>8.2}x",
                format!("{k:?}"),
                ts.len(),
                secs(alone),
                secs(sim),
                wsum(&|t| t.avg_sms),
                wsum(&|t| t.avg_slowdown).max(1.0)
            )?;
        }

        if !self.windows.is_empty() {
            let span: f64 = self.windows.iter().map(|x| x.end_s - x.start_s).sum();
            let side: f64 = self.windows.iter().map(|x| x.side_busy_s).sum();
            let split: Vec<String> = {
                let mut v: Vec<(u32, u32)> = self
                    .windows
                    .iter()
                    .map(|x| (x.decode_sms, x.side_sms))
                    .collect();
                v.dedup();
                v.iter().take(8).map(|(d, s)| format!("{d}/{s}")).collect()
            };
            writeln!(
                w,
                "\ndecode windows: {}, {} of decode; side work busy {:.0}% of it; splits (decode/side SMs): {}",
                self.windows.len(),
                secs(span),
                if span > 0.0 { side / span * 100.0 } else { 0.0 },
                split.join(" ")
            )?;
        }

        let mut worst = (0.0f64, "");
        for t in &self.tasks {
            let d = (t.end_s - t.planned_end_s).abs();
            if d > worst.0 {
                worst = (d, &t.name);
            }
        }
        if self.planned_iteration_s > 0.0 {
            writeln!(
                w,
                "largest gap to the plan's prediction: {} ({})",
                secs(worst.0),
                worst.1
            )?;
        }

        for d in &self.devices {
            let sm_steps: Vec<(f64, f64)> = d
                .samples
                .iter()
                .map(|s| (s.t_s, s.sms / d.sms.max(1) as f64))
                .collect();
            let bw_steps: Vec<(f64, f64)> = d.samples.iter().map(|s| (s.t_s, s.hbm_bw)).collect();
            let mem_steps: Vec<(f64, f64)> =
                d.hbm_live.iter().map(|&(t, b)| (t, b as f64)).collect();
            let sm = binned(&sm_steps, end, WIDTH);
            let bw = binned(&bw_steps, end, WIDTH);
            let mem = binned(&mem_steps, end, WIDTH);
            let peak_flops = if d.bf16_flops > 0.0 {
                d.bf16_flops
            } else {
                f64::INFINITY
            };
            let fl_steps: Vec<(f64, f64)> = d
                .samples
                .iter()
                .map(|s| (s.t_s, s.flops / peak_flops))
                .collect();
            let fl = binned(&fl_steps, end, WIDTH);
            let avg = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
            let bw_max = bw.iter().cloned().fold(0.0, f64::max);
            let cap = d.hbm_bytes.max(1) as f64;
            writeln!(
                w,
                "\n{} ({}, {} rank{}): SMs allocated {:.0}% and bf16 rate {:.0}% of peak on average; \
                 HBM traffic {:.2} TB/s on average; HBM live peak {:.1} GiB of {:.1} GiB (plan \
                 allocates {:.1} GiB)",
                d.name,
                d.role,
                d.ranks,
                if d.ranks == 1 { "" } else { "s" },
                avg(&sm) * 100.0,
                avg(&fl) * 100.0,
                avg(&bw) / 1e12,
                d.hbm_peak as f64 / GIB,
                cap / GIB,
                d.planned_peak as f64 / GIB
            )?;
            writeln!(w, "  SMs alloc  |{}| 0 .. {}", sparkline(&sm), secs(end))?;
            writeln!(w, "  bf16 rate  |{}| of peak", sparkline(&fl))?;
            let bw_norm: Vec<f64> = bw
                .iter()
                .map(|v| if bw_max > 0.0 { v / bw_max } else { 0.0 })
                .collect();
            writeln!(
                w,
                "  HBM B/s    |{}| max {:.2} TB/s",
                sparkline(&bw_norm),
                bw_max / 1e12
            )?;
            let mem_norm: Vec<f64> = mem.iter().map(|v| v / cap).collect();
            writeln!(
                w,
                "  HBM live   |{}| of {:.0} GiB",
                sparkline(&mem_norm),
                cap / GIB
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binned_averages_a_step_function() {
        // 1 on [0, 1), 0 on [1, 2), 0.5 on [2, 4]
        let v = binned(&[(0.0, 1.0), (1.0, 0.0), (2.0, 0.5)], 4.0, 4);
        assert_eq!(v, vec![1.0, 0.0, 0.5, 0.5]);
        let v = binned(&[(0.0, 1.0), (0.5, 0.0)], 2.0, 2);
        assert_eq!(v, vec![0.5, 0.0]);
        assert_eq!(binned(&[], 1.0, 3), vec![0.0; 3]);
    }

    #[test]
    fn sparkline_marks_levels() {
        assert_eq!(sparkline(&[0.0, 0.01, 0.5, 1.0, 2.0]), " ▁▄██");
    }

    #[test]
    fn secs_picks_a_unit() {
        assert_eq!(secs(2.5), "2.500 s");
        assert_eq!(secs(0.0123), "12.30 ms");
        assert_eq!(secs(2e-6), "2.0 us");
    }
}
