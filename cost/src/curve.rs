//! One work kind's efficiency curve: how fast a kind of work runs on `s` of the GPU's `S` SMs.
//!
//! The model is a roofline whose two roofs bend with the SM share:
//!
//! ```text
//! compute rate(s) = peak_flops * eff_compute * (s / S)^compute_exponent
//! memory  rate(s) = B * g(u(s)) / g(u(S)),   B = peak_bw * eff_memory,
//!                   u(s) = s * sm_bw / B,    g(u) = u / (1 + u^p)^(1/p)
//! time(s)         = max(flops / compute rate, bytes / memory rate) + steps * step_overhead_s
//! ```
//!
//! `sm_bw` is what one SM alone can pull from HBM (bytes/s; it is bounded by the requests an
//! SM keeps in flight), so the memory roof grows about linearly with SMs until `s * sm_bw`
//! reaches what the work can use at all (`B`), and is flat after that; `p` says how sharp the
//! bend is. The SM count where the time stops improving therefore depends on the work: work
//! whose steps are short (a small batch, a short KV cache) spends a larger share of its time in
//! the fixed per-step latency, so it reaches its full speed on fewer SMs.
//!
//! Invariants (tested): every curve is non-decreasing in `s`, equals `B` and
//! `peak_flops * eff_compute` at `s = S`, and every parameter stays inside [`Bounds`].

use serde::{Deserialize, Serialize};

/// Efficiency curve of one work kind. All rates are fractions of the GPU's datasheet peaks
/// except `sm_bw` (absolute: it is a property of the SM, not of the memory system).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KindCurve {
    /// Fraction of the bf16 peak reached on the whole GPU.
    pub eff_compute: f64,
    /// Fraction of the HBM peak reached on the whole GPU.
    pub eff_memory: f64,
    /// Compute rate grows as (sms / all SMs)^compute_exponent (1 = proportional).
    pub compute_exponent: f64,
    /// HBM bandwidth one SM can draw on its own, bytes/s.
    pub sm_bw: f64,
    /// Sharpness `p` of the bend of the memory roof (large = a hard min).
    pub sharpness: f64,
    /// Fixed latency of one sequential step (a layer pass: its chain of kernels), seconds.
    pub step_overhead_s: f64,
}

/// Allowed range of each parameter (the fitter maps into these; `validate` checks them).
pub struct Bounds;

impl Bounds {
    pub const EFF: (f64, f64) = (0.01, 1.0);
    pub const EXPONENT: (f64, f64) = (0.3, 1.5);
    /// Per-SM bandwidth as a multiple of (peak_bw / SMs).
    pub const SM_BW_REL: (f64, f64) = (0.05, 20.0);
    pub const SHARPNESS: (f64, f64) = (0.5, 16.0);
    pub const OVERHEAD_S: (f64, f64) = (0.0, 1e-3);
}

fn g(u: f64, p: f64) -> f64 {
    // u / (1 + u^p)^(1/p), written to stay finite for large u.
    if u <= 0.0 {
        return 0.0;
    }
    if u > 1.0 {
        1.0 / (1.0 + u.powf(-p)).powf(1.0 / p)
    } else {
        u / (1.0 + u.powf(p)).powf(1.0 / p)
    }
}

impl KindCurve {
    /// Compute rate on `sms` of `total` SMs, FLOP/s.
    pub fn compute_rate(&self, peak_flops: f64, sms: u32, total: u32) -> f64 {
        let frac = sms as f64 / total.max(1) as f64;
        peak_flops * self.eff_compute * frac.powf(self.compute_exponent)
    }

    /// Memory rate on `sms` of `total` SMs, bytes/s.
    pub fn memory_rate(&self, peak_bw: f64, sms: u32, total: u32) -> f64 {
        let full = peak_bw * self.eff_memory;
        if full <= 0.0 || sms == 0 {
            return 0.0;
        }
        let u = |s: u32| s as f64 * self.sm_bw / full;
        let at_total = g(u(total), self.sharpness);
        if at_total <= 0.0 {
            return 0.0;
        }
        full * g(u(sms.min(total)), self.sharpness) / at_total
    }

    /// Checks every parameter against [`Bounds`]; `what` names the curve in the message.
    pub fn validate(&self, what: &str, peak_bw: f64, sms: u32) -> Result<(), String> {
        let check = |name: &str, v: f64, (lo, hi): (f64, f64)| {
            if !v.is_finite() || v < lo || v > hi {
                Err(format!("{what}: {name} = {v} is outside [{lo}, {hi}]"))
            } else {
                Ok(())
            }
        };
        check("eff_compute", self.eff_compute, Bounds::EFF)?;
        check("eff_memory", self.eff_memory, Bounds::EFF)?;
        check("compute_exponent", self.compute_exponent, Bounds::EXPONENT)?;
        let unit = peak_bw / sms.max(1) as f64;
        let (lo, hi) = Bounds::SM_BW_REL;
        check("sm_bw", self.sm_bw, (lo * unit, hi * unit))?;
        check("sharpness", self.sharpness, Bounds::SHARPNESS)?;
        check("step_overhead_s", self.step_overhead_s, Bounds::OVERHEAD_S)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn curve() -> KindCurve {
        KindCurve {
            eff_compute: 0.6,
            eff_memory: 0.8,
            compute_exponent: 0.8,
            sm_bw: 60e9,
            sharpness: 2.0,
            step_overhead_s: 0.0,
        }
    }

    #[test]
    fn full_gpu_reaches_the_efficiency_times_peak() {
        let c = curve();
        assert!((c.memory_rate(4.8e12, 132, 132) - 0.8 * 4.8e12).abs() < 1.0);
        assert!((c.compute_rate(989e12, 132, 132) - 0.6 * 989e12).abs() < 1.0);
    }

    #[test]
    fn rates_grow_with_sms_and_bend() {
        let c = curve();
        let mut last = (0.0, 0.0);
        for s in 1..=132 {
            let r = (
                c.memory_rate(4.8e12, s, 132),
                c.compute_rate(989e12, s, 132),
            );
            assert!(r.0 >= last.0 && r.1 >= last.1, "not monotone at {s}");
            last = r;
        }
        // below the bend the memory roof is close to s * sm_bw (scaled up a little by the
        // normalisation to the full-GPU rate), above it close to flat
        let few = c.memory_rate(4.8e12, 8, 132);
        assert!(few < 1.15 * 8.0 * 60e9 && few > 0.9 * 8.0 * 60e9, "{few}");
        let most = c.memory_rate(4.8e12, 120, 132);
        assert!(most > 0.95 * 0.8 * 4.8e12, "{most}");
    }

    #[test]
    fn g_is_finite_for_extreme_arguments() {
        for u in [0.0, 1e-12, 1.0, 1e12] {
            for p in [0.5, 2.0, 16.0] {
                let v = g(u, p);
                assert!(v.is_finite() && (0.0..=1.0 + 1e-12).contains(&v.min(1.0)));
            }
        }
    }

    #[test]
    fn validate_names_the_bad_parameter() {
        let mut c = curve();
        c.eff_memory = 1.7;
        let e = c.validate("decode", 4.8e12, 132).unwrap_err();
        assert!(e.contains("decode") && e.contains("eff_memory"), "{e}");
    }
}
