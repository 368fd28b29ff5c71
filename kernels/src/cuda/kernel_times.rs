//! Where a run's GPU time goes, kernel by kernel: with kernel timing on ([`Gpu::set_kernel_times`],
//! or `ROLLPLEX_KERNEL_TIMES=1` when the [`Gpu`] opens), every launch made eagerly (every kernel
//! of this crate, every cuBLASLt GEMM, every graph replay the caller times) is bracketed by two
//! device events on its stream, and [`Gpu::take_kernel_times`] sums their elapsed times per
//! (scope, name). The scope is what the caller says it is running ([`Gpu::set_kernel_scope`]:
//! the runtime names the plan task's kind), so a table splits rollout, scoring and training.
//!
//! What it measures and what it changes: each launch's own device time, start to end, without
//! the idle time between launches (a host that falls behind shows as time no kernel holds).
//! Launches made while a stream captures a graph are not timed (the graph's replays are, as
//! one entry, where the caller asks). The events sit between consecutive kernels, so a kernel
//! that would have overlapped its predecessor's tail (programmatic dependent launch) starts
//! after it: a timed run is a little slower than an untimed one, and its table describes the
//! kernels, not the overlap between them. Results are the same bits either way.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream};

use super::Result;

/// Pending pairs past which completed ones are folded into the totals as launches go on.
const FOLD_AT: usize = 8192;

/// One (scope, kernel) entry of a [`Gpu::take_kernel_times`] table: launches, their summed
/// device milliseconds and, for GEMMs, their floating-point operations.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KernelTime {
    pub scope: String,
    pub name: String,
    pub calls: u64,
    pub ms: f64,
    pub flops: f64,
}

impl KernelTime {
    /// Adds `calls` launches of `ms` milliseconds and `flops` in all.
    fn add(&mut self, calls: u64, ms: f64, flops: f64) {
        self.calls += calls;
        self.ms += ms;
        self.flops += flops;
    }
}

struct Pending {
    scope: Arc<str>,
    name: &'static str,
    flops: f64,
    start: CudaEvent,
    end: CudaEvent,
}

/// The timing state of one [`Gpu`]: the scope, the launches whose events have not been read,
/// the totals, and events to reuse.
#[derive(Default)]
pub(crate) struct KernelTimer {
    scope: Option<Arc<str>>,
    pending: Vec<Pending>,
    totals: HashMap<(Arc<str>, &'static str), KernelTime>,
    free: Vec<CudaEvent>,
}

impl KernelTimer {
    fn event(&mut self, ctx: &Arc<CudaContext>) -> Result<CudaEvent> {
        match self
            .free
            .iter()
            .rposition(|e| Arc::ptr_eq(e.context(), ctx))
        {
            Some(i) => Ok(self.free.swap_remove(i)),
            None => Ok(ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?),
        }
    }

    /// A start event recorded on `stream`, or none while it captures a graph.
    pub(crate) fn start(&mut self, stream: &CudaStream) -> Result<Option<CudaEvent>> {
        if stream.capture_status()? != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            return Ok(None);
        }
        let e = self.event(stream.context())?;
        e.record(stream)?;
        Ok(Some(e))
    }

    /// Records the end of the launch that `start` opened and queues the pair.
    pub(crate) fn end(
        &mut self,
        stream: &CudaStream,
        start: CudaEvent,
        name: &'static str,
        flops: f64,
    ) -> Result<()> {
        let end = self.event(stream.context())?;
        end.record(stream)?;
        let scope = self.scope.clone().unwrap_or_else(|| Arc::from(""));
        self.pending.push(Pending {
            scope,
            name,
            flops,
            start,
            end,
        });
        if self.pending.len() >= FOLD_AT {
            self.fold(false)?;
        }
        Ok(())
    }

    /// Sets the scope, returning the one before.
    pub(crate) fn set_scope(&mut self, scope: Option<&str>) -> Option<String> {
        std::mem::replace(&mut self.scope, scope.map(Arc::from)).map(|s| s.to_string())
    }

    /// Adds the pending pairs' times to the totals: all of them (waiting for each), or with
    /// `wait` false the leading ones whose end has completed.
    fn fold(&mut self, wait: bool) -> Result<()> {
        let done = if wait {
            self.pending.len()
        } else {
            self.pending
                .iter()
                .position(|p| !p.end.is_complete())
                .unwrap_or(self.pending.len())
        };
        for p in self.pending.drain(..done) {
            let ms = p.start.elapsed_ms(&p.end)? as f64;
            let t = self
                .totals
                .entry((p.scope.clone(), p.name))
                .or_insert_with(|| KernelTime {
                    scope: p.scope.to_string(),
                    name: p.name.to_string(),
                    ..KernelTime::default()
                });
            t.add(1, ms, p.flops);
            self.free.push(p.start);
            self.free.push(p.end);
        }
        Ok(())
    }

    /// Every timed launch since the last take, summed per (scope, name), longest first; the
    /// totals start again from zero.
    pub(crate) fn take(&mut self) -> Result<Vec<KernelTime>> {
        self.fold(true)?;
        let mut v: Vec<KernelTime> = self.totals.drain().map(|(_, t)| t).collect();
        sort_longest_first(&mut v);
        Ok(v)
    }
}

/// Adds the entries of `more` into `into` (same scope and name: calls, times and FLOPs summed),
/// keeping `into` longest first: several takes made one table.
pub fn merge_kernel_times(into: &mut Vec<KernelTime>, more: Vec<KernelTime>) {
    for t in more {
        match into
            .iter_mut()
            .find(|x| x.scope == t.scope && x.name == t.name)
        {
            Some(x) => x.add(t.calls, t.ms, t.flops),
            None => into.push(t),
        }
    }
    sort_longest_first(into);
}

fn sort_longest_first(v: &mut [KernelTime]) {
    v.sort_by(|a, b| {
        b.ms.total_cmp(&a.ms)
            .then_with(|| a.scope.cmp(&b.scope))
            .then_with(|| a.name.cmp(&b.name))
    });
}

/// The timer behind a [`Gpu`]'s switch: `None` while timing is off.
pub(crate) type TimerSlot = Mutex<Option<KernelTimer>>;

/// A table of `times` (from [`Gpu::take_kernel_times`], over `iterations` iterations: each
/// entry's time and calls are divided by it), one line per (scope, kernel), longest first:
/// milliseconds an iteration, share of the timed total, calls, microseconds a call and, where
/// FLOPs were counted, TFLOP/s. Entries below `min_share` of the total are summed into one
/// line per scope. Then each scope's total.
pub fn kernel_times_table(times: &[KernelTime], iterations: u32, min_share: f64) -> String {
    use std::fmt::Write;
    let n = iterations.max(1) as f64;
    let total: f64 = times.iter().map(|t| t.ms).sum();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<14} {:<40} {:>10} {:>7} {:>9} {:>10} {:>9}",
        "scope", "kernel", "ms/iter", "share", "calls", "us/call", "TFLOP/s"
    );
    let mut rest: Vec<(String, f64, u64)> = Vec::new();
    let mut scopes: Vec<(String, f64)> = Vec::new();
    for t in times {
        match scopes.iter_mut().find(|(s, _)| *s == t.scope) {
            Some(s) => s.1 += t.ms,
            None => scopes.push((t.scope.clone(), t.ms)),
        }
        if total > 0.0 && t.ms / total < min_share {
            match rest.iter_mut().find(|(s, _, _)| *s == t.scope) {
                Some(r) => {
                    r.1 += t.ms;
                    r.2 += t.calls;
                }
                None => rest.push((t.scope.clone(), t.ms, t.calls)),
            }
            continue;
        }
        let rate = if t.flops > 0.0 && t.ms > 0.0 {
            format!("{:.1}", t.flops / (t.ms * 1e-3) / 1e12)
        } else {
            "-".into()
        };
        let _ = writeln!(
            out,
            "{:<14} {:<40} {:>10.3} {:>6.1}% {:>9.1} {:>10.2} {:>9}",
            t.scope,
            t.name,
            t.ms / n,
            100.0 * t.ms / total,
            t.calls as f64 / n,
            1e3 * t.ms / t.calls.max(1) as f64,
            rate
        );
    }
    for (scope, ms, calls) in rest {
        let _ = writeln!(
            out,
            "{:<14} {:<40} {:>10.3} {:>6.1}% {:>9.1} {:>10} {:>9}",
            scope,
            format!("(others under {:.1}% each)", 100.0 * min_share),
            ms / n,
            100.0 * ms / total,
            calls as f64 / n,
            "-",
            "-"
        );
    }
    scopes.sort_by(|a, b| b.1.total_cmp(&a.1));
    for (scope, ms) in scopes {
        let _ = writeln!(
            out,
            "{:<14} {:<40} {:>10.3} {:>6.1}%",
            scope,
            "(all its timed launches)",
            ms / n,
            100.0 * ms / total
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(scope: &str, name: &str, calls: u64, ms: f64, flops: f64) -> KernelTime {
        KernelTime {
            scope: scope.into(),
            name: name.into(),
            calls,
            ms,
            flops,
        }
    }

    #[test]
    fn the_table_divides_by_iterations_and_folds_the_small_entries() {
        let mut v = vec![
            t("train", "small_a", 10, 0.5, 0.0),
            t("train", "cublasLt matmul", 4, 60.0, 30e12),
            t("rollout", "decode step graph", 2, 38.0, 0.0),
            t("train", "small_b", 6, 1.5, 0.0),
        ];
        sort_longest_first(&mut v);
        assert_eq!(v[0].name, "cublasLt matmul");
        assert_eq!(v[3].name, "small_a");
        let table = kernel_times_table(&v, 2, 0.05);
        let lines: Vec<&str> = table.lines().collect();
        // header, two entries over 5%, one folded line for train, two scope totals
        assert_eq!(lines.len(), 6, "{table}");
        assert!(lines[1].contains("cublasLt matmul") && lines[1].contains("30.000"));
        // 30 TFLOP over 60 ms: 500 TFLOP/s; 15 us a call
        assert!(
            lines[1].contains("500.0") && lines[1].contains("15000.00"),
            "{table}"
        );
        assert!(lines[2].contains("decode step graph") && lines[2].contains("19.000"));
        // the folded line: 2 ms over 2 iterations, 8 calls an iteration
        assert!(lines[3].contains("others under 5.0%") && lines[3].contains("1.000"));
        assert!(lines[3].contains("8.0"), "{table}");
        assert!(lines[4].starts_with("train") && lines[4].contains("31.000"));
        assert!(lines[5].starts_with("rollout") && lines[5].contains("19.000"));
    }

    #[test]
    fn merging_sums_the_same_entries_and_keeps_the_order() {
        let mut a = vec![
            t("decode", "gemv", 2, 3.0, 0.0),
            t("train", "gemm", 1, 1.0, 5.0),
        ];
        merge_kernel_times(
            &mut a,
            vec![
                t("train", "gemm", 3, 4.0, 6.0),
                t("decode", "norm", 1, 0.5, 0.0),
            ],
        );
        assert_eq!(
            a,
            vec![
                t("train", "gemm", 4, 5.0, 11.0),
                t("decode", "gemv", 2, 3.0, 0.0),
                t("decode", "norm", 1, 0.5, 0.0),
            ]
        );
    }

    #[test]
    fn an_empty_table_is_its_header() {
        let table = kernel_times_table(&[], 3, 0.01);
        assert_eq!(table.lines().count(), 1);
    }
}
