//! `rollplex-run plot`: a run's learning curves and phase times, drawn from its `metrics.jsonl`
//! as one self-contained SVG (no plotting library: lines, bands and stacked columns are a few
//! paths each).
//!
//! Panels: reward mean with its ±std band, mean response length, loss (total and policy), KL,
//! and the measured time of each phase stacked per iteration under the whole iteration's time.
//! Over 60 iterations each curve is drawn faint with a moving average over it.
//!
//! Invariants:
//! - Every series is one `<path>` whose `data-series` attribute names the `metrics.jsonl` field
//!   it draws (the moving average: `<field>:smoothed`), and whose points are the iterations
//!   where that field is a number: a missing or `null` value breaks the line, never draws 0.
//! - Errors a user can act on: a missing or unreadable file, a line that is not a metrics record
//!   (`file:line`), a file with no iteration yet, an output that is not `.svg`.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use rollplex_plan::roofline::phase_name;
use rollplex_plan::Phase;

use crate::metrics::{read_log, LogLine, MetricsError};
use crate::sim::svg::{esc, tick_step};

const WIDTH: f64 = 1200.0;
/// A panel's chart area, and the room around it for its title and ticks.
const PANEL_W: f64 = 500.0;
const PANEL_H: f64 = 190.0;
const LEFT: f64 = 70.0;
const TOP: f64 = 34.0;
const BELOW: f64 = 40.0;
/// Iterations above which curves get a moving average, and how many windows span the run.
const SMOOTH_ABOVE: usize = 60;
const SMOOTH_WINDOWS: usize = 30;

/// The phase colours, in [`Phase::ALL`] order.
const PHASE_COLORS: [&str; 4] = ["#ff7f0e", "#2ca02c", "#d62728", "#7f7f7f"];

/// One curve: the `metrics.jsonl` field it draws, its legend label and colour.
struct Curve {
    key: &'static str,
    label: &'static str,
    color: &'static str,
}

/// The line panels: title and curves (the first curve of the reward panel gets the ±std band).
const PANELS: [(&str, &[Curve]); 4] = [
    (
        "reward (mean ± std over the iteration's samples)",
        &[Curve {
            key: "reward_mean",
            label: "reward_mean",
            color: "#1f77b4",
        }],
    ),
    (
        "response length (tokens, mean)",
        &[Curve {
            key: "response_len_mean",
            label: "response_len_mean",
            color: "#9467bd",
        }],
    ),
    (
        "loss",
        &[
            Curve {
                key: "loss",
                label: "loss",
                color: "#d62728",
            },
            Curve {
                key: "pg_loss",
                label: "pg_loss",
                color: "#ff9896",
            },
        ],
    ),
    (
        "KL to the reference",
        &[Curve {
            key: "kl",
            label: "kl",
            color: "#2ca02c",
        }],
    ),
];

/// The metrics file of `run` (a run's output directory, or the file itself).
pub fn metrics_path(run: &Path) -> PathBuf {
    if run.is_dir() {
        run.join("metrics.jsonl")
    } else {
        run.to_path_buf()
    }
}

/// Reads `run`'s metrics, renders them and writes the SVG to `out` (default: `metrics.svg`
/// beside the metrics file). Returns the path written and the iterations drawn.
pub fn plot_run(run: &Path, out: Option<&Path>) -> Result<(PathBuf, usize), MetricsError> {
    let metrics = metrics_path(run);
    let out = match out {
        Some(o) => o.to_path_buf(),
        None => metrics.with_file_name("metrics.svg"),
    };
    if !out
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("svg"))
    {
        return Err(MetricsError::Io {
            path: out,
            msg: "plots are written as SVG: give an output ending in .svg (an SVG converts to \
                  PNG with e.g. rsvg-convert or a browser)"
                .into(),
        });
    }
    if !metrics.exists() {
        return Err(MetricsError::Io {
            path: metrics,
            msg: "no such file: give the --out directory of a rollplex-run training run (it \
                  holds metrics.jsonl), or the metrics file itself"
                .into(),
        });
    }
    let lines = latest_per_iteration(read_log(&metrics)?);
    if lines.is_empty() {
        return Err(MetricsError::Io {
            path: metrics,
            msg: "no iteration recorded yet: plot once the run has finished an iteration".into(),
        });
    }
    let title = format!(
        "{}: {} iterations ({} to {})",
        metrics.display(),
        lines.len(),
        lines[0].iteration,
        lines[lines.len() - 1].iteration
    );
    let svg = render(&lines, &title);
    rollplex_plan::files::write_atomic(&out, svg.as_bytes()).map_err(|e| MetricsError::Io {
        path: out.clone(),
        msg: e.to_string(),
    })?;
    Ok((out, lines.len()))
}

/// One record per iteration, in iteration order, the last one written winning (a line written
/// again after a resume replaces the first).
fn latest_per_iteration(lines: Vec<LogLine>) -> Vec<LogLine> {
    let mut by_it = std::collections::BTreeMap::new();
    for l in lines {
        by_it.insert(l.iteration, l);
    }
    by_it.into_values().collect()
}

/// The panels' shared x axis: iterations, each a column one unit wide.
#[derive(Clone, Copy)]
struct XAxis {
    lo: f64,
    hi: f64,
}

impl XAxis {
    fn px(&self, x0: f64, w: f64, it: f64) -> f64 {
        x0 + (it - self.lo) / (self.hi - self.lo) * w
    }
}

/// A panel's frame: where its chart area lies and its y range.
struct Frame {
    x0: f64,
    y0: f64,
    w: f64,
    h: f64,
    xs: XAxis,
    lo: f64,
    hi: f64,
}

impl Frame {
    fn x(&self, it: f64) -> f64 {
        self.xs.px(self.x0, self.w, it)
    }

    /// Where `v` lies, clipped to the chart.
    fn y(&self, v: f64) -> f64 {
        self.y0 + self.h - ((v - self.lo) / (self.hi - self.lo)).clamp(0.0, 1.0) * self.h
    }

    /// Frame, grid, ticks and title.
    fn draw(&self, out: &mut String, title: &str) {
        let _ = write!(
            out,
            r#"<text x="{:.1}" y="{:.1}" class="panel">{}</text><rect x="{:.1}" y="{:.1}" width="{:.1}" height="{:.1}" class="frame"/>"#,
            self.x0,
            self.y0 - 10.0,
            esc(title),
            self.x0,
            self.y0,
            self.w,
            self.h
        );
        let step = tick_step(self.hi - self.lo, 5.0);
        let decimals = decimals(step);
        let mut v = (self.lo / step).ceil() * step;
        while v <= self.hi + step * 1e-9 {
            let y = self.y(v);
            let _ = write!(
                out,
                r#"<line x1="{:.1}" x2="{:.1}" y1="{y:.1}" y2="{y:.1}" class="grid"/><text x="{:.1}" y="{:.1}" class="ytick">{:.*}</text>"#,
                self.x0,
                self.x0 + self.w,
                self.x0 - 4.0,
                y + 3.5,
                decimals,
                if v.abs() < step * 1e-9 { 0.0 } else { v }
            );
            v += step;
        }
        let step = tick_step(self.xs.hi - self.xs.lo, 8.0).max(1.0).round();
        let mut it = (self.xs.lo / step).ceil() * step;
        while it <= self.xs.hi {
            let x = self.x(it);
            let _ = write!(
                out,
                r#"<line x1="{x:.1}" x2="{x:.1}" y1="{:.1}" y2="{:.1}" class="axis"/><text x="{x:.1}" y="{:.1}" class="xtick">{:.0}</text>"#,
                self.y0 + self.h,
                self.y0 + self.h + 4.0,
                self.y0 + self.h + 15.0,
                it + 0.0 // -0 prints as 0
            );
            it += step;
        }
        let _ = write!(
            out,
            r#"<text x="{:.1}" y="{:.1}" class="xlabel">iteration</text>"#,
            self.x0 + self.w / 2.0,
            self.y0 + self.h + 30.0
        );
    }

    /// A legend entry at the panel's top right, the `k`-th from the right.
    fn legend(&self, out: &mut String, k: usize, label: &str, color: &str) {
        let x = self.x0 + self.w - 130.0 * (k + 1) as f64 + 10.0;
        let _ = write!(
            out,
            r#"<rect x="{x:.1}" y="{:.1}" width="10" height="10" fill="{color}"/><text x="{:.1}" y="{:.1}" class="legend">{}</text>"#,
            self.y0 - 19.0,
            x + 14.0,
            self.y0 - 10.0,
            esc(label)
        );
    }
}

/// Decimals that show a tick step of `step`.
fn decimals(step: f64) -> usize {
    (-step.log10().floor()).clamp(0.0, 8.0) as usize
}

/// The y range of `values` with a margin, never empty.
fn y_range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    if hi - lo < 1e-12 {
        let pad = if lo.abs() > 0.0 { lo.abs() * 0.1 } else { 1.0 };
        return (lo - pad, hi + pad);
    }
    let pad = (hi - lo) * 0.05;
    (lo - pad, hi + pad)
}

/// The top of the time panel and how many iterations it cuts off: the longest iteration, unless
/// a few (a busy machine's hiccups) take over 4x the 95th percentile; then 1.5x that percentile,
/// so the usual iteration stays readable.
fn time_top(tops: &[f64]) -> (f64, usize) {
    let mut v: Vec<f64> = tops.iter().copied().filter(|t| t.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    let Some(&max) = v.last() else {
        return (1.0, 0);
    };
    let p95 = v[(v.len() - 1) * 95 / 100];
    if p95 > 0.0 && max > 4.0 * p95 {
        let top = 1.5 * p95;
        (top, v.iter().filter(|&&t| t > top).count())
    } else {
        (y_range(v.into_iter().chain([0.0])).1, 0)
    }
}

/// `(iteration, value)` of `key` where it is a number.
fn points(lines: &[LogLine], key: &str) -> Vec<(f64, Option<f64>)> {
    lines
        .iter()
        .map(|l| (l.iteration as f64, l.get(key).filter(|v| v.is_finite())))
        .collect()
}

/// A centred moving average over `half` points each side (missing points stay missing and do
/// not count).
fn smooth(pts: &[(f64, Option<f64>)], half: usize) -> Vec<(f64, Option<f64>)> {
    (0..pts.len())
        .map(|i| {
            let win = &pts[i.saturating_sub(half)..(i + half + 1).min(pts.len())];
            let (s, n) = win
                .iter()
                .filter_map(|p| p.1)
                .fold((0.0, 0), |(s, n), v| (s + v, n + 1));
            (
                pts[i].0,
                pts[i].1.and(if n > 0 { Some(s / n as f64) } else { None }),
            )
        })
        .collect()
}

/// A polyline through the points, broken where a value is missing.
fn line_path(f: &Frame, pts: &[(f64, Option<f64>)]) -> String {
    let mut d = String::new();
    let mut pen_down = false;
    for &(it, v) in pts {
        match v {
            Some(v) => {
                let _ = write!(
                    d,
                    "{}{:.1},{:.1}",
                    if pen_down { " L" } else { " M" },
                    f.x(it),
                    f.y(v)
                );
                pen_down = true;
            }
            None => pen_down = false,
        }
    }
    d.trim_start().to_string()
}

/// The closed area between `lo` and `hi` per iteration, as columns one iteration wide (a
/// stacked bar each); iterations without a value leave a gap.
fn column_path(f: &Frame, cols: &[(f64, Option<(f64, f64)>)]) -> String {
    let mut d = String::new();
    let mut run: Vec<(f64, f64, f64)> = Vec::new();
    let flush = |d: &mut String, run: &mut Vec<(f64, f64, f64)>| {
        if run.is_empty() {
            return;
        }
        let mut first = true;
        for &(it, _, hi) in run.iter() {
            let _ = write!(
                d,
                " {}{:.1},{:.1} L{:.1},{:.1}",
                if first { "M" } else { "L" },
                f.x(it - 0.5),
                f.y(hi),
                f.x(it + 0.5),
                f.y(hi)
            );
            first = false;
        }
        for &(it, lo, _) in run.iter().rev() {
            let _ = write!(
                d,
                " L{:.1},{:.1} L{:.1},{:.1}",
                f.x(it + 0.5),
                f.y(lo),
                f.x(it - 0.5),
                f.y(lo)
            );
        }
        d.push_str(" Z");
        run.clear();
    };
    for &(it, c) in cols {
        match c {
            Some((lo, hi)) => run.push((it, lo, hi)),
            None => flush(&mut d, &mut run),
        }
    }
    flush(&mut d, &mut run);
    d.trim_start().to_string()
}

/// Draws `key` (and, over [`SMOOTH_ABOVE`] iterations, its moving average).
fn draw_curve(out: &mut String, f: &Frame, key: &str, color: &str, pts: &[(f64, Option<f64>)]) {
    let smoothed = pts.len() > SMOOTH_ABOVE;
    let _ = write!(
        out,
        r#"<path data-series="{}" d="{}" fill="none" stroke="{color}" stroke-width="{}" stroke-opacity="{}"/>"#,
        esc(key),
        line_path(f, pts),
        if smoothed { 0.8 } else { 1.5 },
        if smoothed { 0.35 } else { 1.0 }
    );
    if smoothed {
        let half = pts.len() / SMOOTH_WINDOWS / 2;
        let _ = write!(
            out,
            r#"<path data-series="{}:smoothed" d="{}" fill="none" stroke="{color}" stroke-width="1.8"/>"#,
            esc(key),
            line_path(f, &smooth(pts, half.max(1)))
        );
    }
}

/// The SVG of `lines` (one record per iteration, in order; at least one), titled `title`.
pub fn render(lines: &[LogLine], title: &str) -> String {
    let first = lines.first().map_or(0.0, |l| l.iteration as f64);
    let last = lines.last().map_or(0.0, |l| l.iteration as f64);
    let xs = XAxis {
        lo: first - 0.5,
        hi: last + 0.5,
    };
    let mut body = String::new();
    let col_w = WIDTH / 2.0;
    let mut y0 = 50.0 + TOP;

    for (row, panels) in PANELS.chunks(2).enumerate() {
        for (col, (panel_title, curves)) in panels.iter().enumerate() {
            let band: Vec<(f64, Option<(f64, f64)>)> = if row == 0 && col == 0 {
                let (m, s) = (points(lines, "reward_mean"), points(lines, "reward_std"));
                m.iter()
                    .zip(&s)
                    .map(|(&(it, m), &(_, s))| (it, m.zip(s).map(|(m, s)| (m - s, m + s))))
                    .collect()
            } else {
                Vec::new()
            };
            let series: Vec<Vec<(f64, Option<f64>)>> =
                curves.iter().map(|c| points(lines, c.key)).collect();
            let (lo, hi) = y_range(
                series
                    .iter()
                    .flatten()
                    .filter_map(|p| p.1)
                    .chain(band.iter().filter_map(|b| b.1).flat_map(|(a, b)| [a, b])),
            );
            let f = Frame {
                x0: col as f64 * col_w + LEFT,
                y0,
                w: PANEL_W,
                h: PANEL_H,
                xs,
                lo,
                hi,
            };
            f.draw(&mut body, panel_title);
            if !band.is_empty() {
                let _ = write!(
                    body,
                    r##"<path data-series="reward_std" d="{}" fill="#1f77b4" fill-opacity="0.15"/>"##,
                    column_path(&f, &band)
                );
            }
            for (k, (c, pts)) in curves.iter().zip(&series).enumerate().rev() {
                draw_curve(&mut body, &f, c.key, c.color, pts);
                f.legend(&mut body, curves.len() - 1 - k, c.label, c.color);
            }
        }
        y0 += TOP + PANEL_H + BELOW;
    }

    // Phase times stacked per iteration, under the whole iteration's time.
    let phases: Vec<(String, &str)> = Phase::ALL
        .iter()
        .zip(PHASE_COLORS)
        .map(|(p, c)| (format!("{}_s", phase_name(*p)), c))
        .filter(|(k, _)| lines.iter().any(|l| l.get(k).is_some_and(|v| v > 0.0)))
        .collect();
    let total = points(lines, "time_s");
    let mut stacked = vec![0.0; lines.len()];
    let mut cols = Vec::new();
    for (k, _) in &phases {
        let layer: Vec<(f64, Option<(f64, f64)>)> = lines
            .iter()
            .zip(stacked.iter_mut())
            .map(|(l, top)| {
                let v = l
                    .get(k)
                    .filter(|v| v.is_finite() && *v >= 0.0)
                    .unwrap_or(0.0);
                let lo = *top;
                *top += v;
                (l.iteration as f64, Some((lo, *top)))
            })
            .collect();
        cols.push(layer);
    }
    let tops: Vec<f64> = stacked
        .iter()
        .zip(&total)
        .map(|(s, t)| t.1.unwrap_or(0.0).max(*s))
        .collect();
    let (hi, clipped) = time_top(&tops);
    let f = Frame {
        x0: LEFT,
        y0,
        w: WIDTH - LEFT - 30.0,
        h: PANEL_H,
        xs,
        lo: 0.0,
        hi,
    };
    f.draw(
        &mut body,
        "time per iteration (s): phases stacked, the whole iteration as a line",
    );
    if clipped > 0 {
        let max = tops.iter().copied().fold(0.0, f64::max);
        let _ = write!(
            body,
            r#"<text x="{:.1}" y="{:.1}" class="note">{clipped} iteration{} over the top (up to {max:.3} s) cut off</text>"#,
            f.x0 + f.w,
            f.y0 + f.h + 30.0,
            if clipped == 1 { "" } else { "s" }
        );
    }
    for ((k, color), layer) in phases.iter().zip(&cols) {
        let _ = write!(
            body,
            r#"<path data-series="{}" d="{}" fill="{color}" fill-opacity="0.8"/>"#,
            esc(k),
            column_path(&f, layer)
        );
    }
    let _ = write!(
        body,
        r#"<path data-series="time_s" d="{}" fill="none" stroke="black" stroke-width="0.8"/>"#,
        line_path(&f, &total)
    );
    f.legend(&mut body, 0, "time_s (iteration)", "black");
    for (k, (key, color)) in phases.iter().enumerate().rev() {
        f.legend(&mut body, phases.len() - k, key, color);
    }
    let height = y0 + PANEL_H + BELOW;

    format!(
        r##"<?xml version="1.0" encoding="UTF-8"?>
<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height:.0}" viewBox="0 0 {WIDTH} {height:.0}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif">
<style>
.title {{ font-size: 15px; font-weight: bold; }}
.panel {{ font-size: 12px; fill: #222; }}
.legend {{ font-size: 10px; fill: #333; }}
.ytick {{ font-size: 10px; fill: #555; text-anchor: end; }}
.xtick {{ font-size: 10px; fill: #555; text-anchor: middle; }}
.xlabel {{ font-size: 10px; fill: #555; text-anchor: middle; }}
.note {{ font-size: 10px; fill: #a33; text-anchor: end; }}
.grid {{ stroke: #ececec; stroke-width: 1; }}
.axis {{ stroke: #999; stroke-width: 1; }}
.frame {{ fill: none; stroke: #bbb; stroke-width: 0.8; }}
</style>
<rect width="100%" height="100%" fill="#ffffff"/>
<text x="10" y="24" class="title">{}</text>
{body}
</svg>
"##,
        esc(title)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(it: u64, json: &str) -> LogLine {
        let text = format!("{{\"iteration\":{it},{json}}}");
        let fields = match serde_json::from_str(&text).unwrap() {
            serde_json::Value::Object(m) => m,
            _ => unreachable!(),
        };
        LogLine {
            iteration: it,
            text,
            fields,
        }
    }

    fn frame() -> Frame {
        Frame {
            x0: 0.0,
            y0: 0.0,
            w: 100.0,
            h: 100.0,
            xs: XAxis { lo: -0.5, hi: 3.5 },
            lo: 0.0,
            hi: 10.0,
        }
    }

    #[test]
    fn a_missing_value_breaks_the_line() {
        let d = line_path(
            &frame(),
            &[
                (0.0, Some(0.0)),
                (1.0, None),
                (2.0, Some(10.0)),
                (3.0, Some(5.0)),
            ],
        );
        assert_eq!(d, "M12.5,100.0 M62.5,0.0 L87.5,50.0");
    }

    #[test]
    fn columns_are_one_iteration_wide_and_closed() {
        let d = column_path(
            &frame(),
            &[(0.0, Some((0.0, 5.0))), (1.0, Some((0.0, 10.0)))],
        );
        assert_eq!(
            d,
            "M0.0,50.0 L25.0,50.0 L25.0,0.0 L50.0,0.0 L50.0,100.0 L25.0,100.0 L25.0,100.0 L0.0,100.0 Z"
        );
    }

    #[test]
    fn smoothing_averages_only_present_values() {
        let s = smooth(&[(0.0, Some(1.0)), (1.0, None), (2.0, Some(3.0))], 1);
        assert_eq!(s, vec![(0.0, Some(1.0)), (1.0, None), (2.0, Some(3.0))]);
        let s = smooth(&[(0.0, Some(1.0)), (1.0, Some(2.0)), (2.0, Some(6.0))], 1);
        assert_eq!(s[1], (1.0, Some(3.0)));
    }

    #[test]
    fn a_hiccup_does_not_flatten_the_time_panel() {
        let mut t = vec![0.1; 100];
        t[7] = 5.0;
        let (top, cut) = time_top(&t);
        assert!((top - 0.15).abs() < 1e-12 && cut == 1, "{top} {cut}");
        let (top, cut) = time_top(&[0.1, 0.2, 0.3]);
        assert!(top > 0.3 && cut == 0, "{top}");
        assert_eq!(time_top(&[]), (1.0, 0));
    }

    #[test]
    fn y_range_is_never_empty() {
        assert_eq!(y_range([].into_iter()), (0.0, 1.0));
        assert_eq!(y_range([0.0, 0.0].into_iter()), (-1.0, 1.0));
        let (lo, hi) = y_range([1.0, 3.0, f64::NAN].into_iter());
        assert!(lo < 1.0 && hi > 3.0);
    }

    #[test]
    fn render_names_each_series() {
        let lines = [
            line(
                0,
                r#""reward_mean":0.1,"reward_std":0.05,"loss":1.0,"kl":null,"rollout_s":0.2,"training_s":0.1,"time_s":0.4"#,
            ),
            line(
                1,
                r#""reward_mean":0.5,"reward_std":0.1,"loss":0.5,"kl":0.01,"rollout_s":0.3,"training_s":0.1,"time_s":0.5"#,
            ),
        ];
        let svg = render(&lines, "a <run>");
        for s in [
            "reward_mean",
            "reward_std",
            "loss",
            "kl",
            "rollout_s",
            "training_s",
            "time_s",
        ] {
            assert!(svg.contains(&format!("data-series=\"{s}\"")), "{s}");
        }
        assert!(
            !svg.contains("data-series=\"scoring_s\""),
            "a phase that never ran"
        );
        assert!(svg.contains("a &lt;run&gt;"));
    }
}
