//! A self-contained SVG timeline of a [`SimReport`]: per GPU program one lane per stream with
//! the tasks coloured by kind (hover for details), decode windows shaded with their SM split,
//! then SMs allocated with the bf16 rate over them, HBM traffic and HBM live bytes over time;
//! a time axis and a legend.

use std::fmt::Write as _;
use std::io::{self, Write};

use rollplex_plan::work::WorkKind;

use super::summary::secs;
use super::SimReport;

const WIDTH: f64 = 1400.0;
const LEFT: f64 = 200.0;
const RIGHT: f64 = 30.0;
const LANE: f64 = 24.0;
const CHART: f64 = 54.0;
const GIB: f64 = (1u64 << 30) as f64;

/// The colour of a kind (a categorical palette; stable across runs).
pub(crate) fn color(kind: WorkKind) -> &'static str {
    match kind {
        WorkKind::VisionEncode => "#9467bd",
        WorkKind::Prefill => "#1f77b4",
        WorkKind::Decode => "#ff7f0e",
        WorkKind::RefPrefix => "#2ca02c",
        WorkKind::RefSuffix => "#98df8a",
        WorkKind::ActorPrefixFwd => "#17becf",
        WorkKind::ActorSuffixFwd => "#9edae5",
        WorkKind::ActorBwd => "#d62728",
        WorkKind::Optimizer => "#8c564b",
        WorkKind::Reward => "#e377c2",
        WorkKind::Advantage => "#f7b6d2",
        WorkKind::WeightSync => "#7f7f7f",
        WorkKind::Transfer => "#bcbd22",
    }
}

/// Escapes text for XML content and attributes.
pub(crate) fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&apos;"),
            c => o.push(c),
        }
    }
    o
}

/// A round tick step (1, 2 or 5 times a power of ten) giving about `n` ticks over `span`.
pub(crate) fn tick_step(span: f64, n: f64) -> f64 {
    if span.is_nan() || span <= 0.0 {
        return 1.0;
    }
    let raw = span / n;
    let p = 10f64.powf(raw.log10().floor());
    let m = raw / p;
    let k = if m < 1.5 {
        1.0
    } else if m < 3.5 {
        2.0
    } else if m < 7.5 {
        5.0
    } else {
        10.0
    };
    k * p
}

/// A step function `(t, v in 0..=1)` as a closed area path over a chart at `y0` of height `h`.
fn area_path(steps: &[(f64, f64)], end: f64, x: &dyn Fn(f64) -> f64, y0: f64, h: f64) -> String {
    let mut d = format!("M{:.2},{:.2}", x(0.0), y0 + h);
    let mut last_y = y0 + h;
    for (k, &(t, v)) in steps.iter().enumerate() {
        if t > end {
            break;
        }
        let y = y0 + h - v.clamp(0.0, 1.0) * h;
        let _ = write!(d, " L{:.2},{:.2} L{:.2},{:.2}", x(t), last_y, x(t), y);
        last_y = y;
        if k + 1 == steps.len() {
            let _ = write!(d, " L{:.2},{:.2}", x(end), y);
        }
    }
    let _ = write!(d, " L{:.2},{:.2} Z", x(end), y0 + h);
    d
}

impl SimReport {
    /// The SVG document (see the module doc).
    pub fn svg(&self) -> String {
        let end = if self.iteration_s > 0.0 {
            self.iteration_s
        } else {
            1.0
        };
        let pw = WIDTH - LEFT - RIGHT;
        let x = |t: f64| LEFT + (t / end).clamp(0.0, 1.0) * pw;
        let mut body = String::new();
        let mut y = 70.0;
        let top = y;

        for (d, dev) in self.devices.iter().enumerate() {
            let _ = write!(
                body,
                r#"<text x="8" y="{:.1}" class="dev">{} ({}, {} rank{})</text>"#,
                y + 14.0,
                esc(&dev.name),
                esc(&dev.role),
                dev.ranks,
                if dev.ranks == 1 { "" } else { "s" }
            );
            // decode windows: a band over the device's lanes, labelled with the split
            let lanes: Vec<usize> = (0..self.streams.len())
                .filter(|&s| self.streams[s].device == d)
                .collect();
            let lanes_top = y + 20.0;
            let lanes_h = lanes.len() as f64 * LANE;
            for w in self
                .windows
                .iter()
                .filter(|w| w.device == d && w.end_s > w.start_s)
            {
                let (x0, x1) = (x(w.start_s), x(w.end_s));
                let _ = write!(
                    body,
                    r##"<rect x="{x0:.2}" y="{lanes_top:.1}" width="{:.2}" height="{lanes_h:.1}" fill="#fff3e0" stroke="#ffcc80" stroke-width="0.5"><title>decode window: {} decode / {} side SMs, {} - {}</title></rect>"##,
                    (x1 - x0).max(0.5),
                    w.decode_sms,
                    w.side_sms,
                    secs(w.start_s),
                    secs(w.end_s)
                );
                let label = format!("{}/{}", w.decode_sms, w.side_sms);
                if x1 - x0 > 7.0 * label.len() as f64 {
                    let _ = write!(
                        body,
                        r#"<text x="{:.2}" y="{:.1}" class="win">{label}</text>"#,
                        x0 + 2.0,
                        y + 16.0
                    );
                }
            }
            y += 20.0;
            for &s in &lanes {
                let _ = write!(
                    body,
                    r#"<text x="18" y="{:.1}" class="lane">stream{s} {}</text><line x1="{LEFT}" x2="{:.1}" y1="{:.1}" y2="{:.1}" class="sep"/>"#,
                    y + 16.0,
                    esc(&self.streams[s].name),
                    WIDTH - RIGHT,
                    y + LANE,
                    y + LANE
                );
                for t in self.tasks.iter().filter(|t| t.stream == s) {
                    let (x0, x1) = (x(t.start_s), x(t.end_s));
                    let wdt = (x1 - x0).max(0.6);
                    let _ = write!(
                        body,
                        r#"<rect x="{x0:.2}" y="{:.1}" width="{wdt:.2}" height="{:.1}" fill="{}"><title>{} ({:?}, {:?} phase): {} - {} ({}), {:.0} SMs, slowdown {:.2}x, alone {}</title></rect>"#,
                        y + 3.0,
                        LANE - 6.0,
                        color(t.kind),
                        esc(&t.name),
                        t.kind,
                        t.phase,
                        secs(t.start_s),
                        secs(t.end_s),
                        secs(t.duration_s()),
                        t.avg_sms,
                        t.avg_slowdown,
                        secs(t.alone_s)
                    );
                    if wdt > 6.2 * t.name.len() as f64 + 4.0 {
                        let _ = write!(
                            body,
                            r#"<text x="{:.2}" y="{:.1}" class="task">{}</text>"#,
                            x0 + 2.0,
                            y + 16.0,
                            esc(&t.name)
                        );
                    }
                }
                y += LANE;
            }

            // SMs allocated, and the arithmetic rate over them
            y += 8.0;
            let sm: Vec<(f64, f64)> = dev
                .samples
                .iter()
                .map(|s| (s.t_s, s.sms / dev.sms.max(1) as f64))
                .collect();
            let peak = if dev.bf16_flops > 0.0 {
                dev.bf16_flops
            } else {
                f64::INFINITY
            };
            let fl: Vec<(f64, f64)> = dev
                .samples
                .iter()
                .map(|s| (s.t_s, s.flops / peak))
                .collect();
            let _ = write!(
                body,
                r##"<text x="18" y="{:.1}" class="lane">SMs allocated (of {})</text><text x="18" y="{:.1}" class="lane" fill="#8c2d04">bf16 rate (of peak)</text><rect x="{LEFT}" y="{y:.1}" width="{pw:.1}" height="{CHART}" class="frame"/><path d="{}" fill="#ff7f0e" fill-opacity="0.3" stroke="#e6550d" stroke-width="0.8"/><path d="{}" fill="#8c2d04" fill-opacity="0.55" stroke="#8c2d04" stroke-width="0.8"/>"##,
                y + 22.0,
                dev.sms,
                y + 38.0,
                area_path(&sm, end, &x, y, CHART),
                area_path(&fl, end, &x, y, CHART)
            );
            y += CHART + 6.0;

            // HBM traffic
            let bw_max = dev.samples.iter().map(|s| s.hbm_bw).fold(0.0, f64::max);
            let bw: Vec<(f64, f64)> = dev
                .samples
                .iter()
                .map(|s| (s.t_s, if bw_max > 0.0 { s.hbm_bw / bw_max } else { 0.0 }))
                .collect();
            let _ = write!(
                body,
                r##"<text x="18" y="{:.1}" class="lane">HBM traffic (max {:.2} TB/s)</text><rect x="{LEFT}" y="{y:.1}" width="{pw:.1}" height="{CHART}" class="frame"/><path d="{}" fill="#1f77b4" fill-opacity="0.35" stroke="#1f77b4" stroke-width="0.8"/>"##,
                y + 30.0,
                bw_max / 1e12,
                area_path(&bw, end, &x, y, CHART)
            );
            y += CHART + 6.0;

            // HBM live
            let cap = dev.hbm_bytes.max(1) as f64;
            let live: Vec<(f64, f64)> = dev
                .hbm_live
                .iter()
                .map(|&(t, b)| (t, b as f64 / cap))
                .collect();
            let _ = write!(
                body,
                r##"<text x="18" y="{:.1}" class="lane">HBM live (peak {:.1} of {:.0} GiB)</text><rect x="{LEFT}" y="{y:.1}" width="{pw:.1}" height="{CHART}" class="frame"/><path d="{}" fill="#2ca02c" fill-opacity="0.35" stroke="#2ca02c" stroke-width="0.8"/>"##,
                y + 30.0,
                dev.hbm_peak as f64 / GIB,
                cap / GIB,
                area_path(&live, end, &x, y, CHART)
            );
            y += CHART + 22.0;
        }
        let bottom = y;

        // time axis and grid
        let mut axis = String::new();
        let step = tick_step(end, 10.0);
        // one unit for the whole axis, with as many decimals as the step needs
        let (unit, scale) = if end >= 2.0 { ("s", 1.0) } else { ("ms", 1e3) };
        let decimals = (-(step * scale).log10().floor()).max(0.0) as usize;
        let label = |t: f64| format!("{:.*} {unit}", decimals, t * scale);
        let mut t = 0.0;
        while t <= end * (1.0 + 1e-9) {
            let _ = write!(
                axis,
                r#"<line x1="{0:.2}" x2="{0:.2}" y1="{1:.1}" y2="{2:.1}" class="grid"/><text x="{0:.2}" y="{3:.1}" class="tick">{4}</text>"#,
                x(t),
                top - 6.0,
                bottom - 16.0,
                top - 10.0,
                label(t)
            );
            t += step;
        }

        // legend
        let mut kinds: Vec<WorkKind> = self.tasks.iter().map(|t| t.kind).collect();
        kinds.sort();
        kinds.dedup();
        let mut legend = String::new();
        let (mut lx, mut ly) = (LEFT, bottom);
        for k in kinds {
            let label = format!("{k:?}");
            let wdt = 24.0 + 7.0 * label.len() as f64;
            if lx + wdt > WIDTH - RIGHT {
                lx = LEFT;
                ly += 18.0;
            }
            let _ = write!(
                legend,
                r#"<rect x="{lx:.1}" y="{:.1}" width="12" height="12" fill="{}"/><text x="{:.1}" y="{:.1}" class="lane">{label}</text>"#,
                ly - 10.0,
                color(k),
                lx + 16.0,
                ly
            );
            lx += wdt;
        }
        let height = ly + 16.0;

        let title = format!(
            "{} - {} mode, {} x {}: predicted iteration {}",
            self.name,
            self.mode,
            self.gpu_count,
            self.gpu,
            secs(self.iteration_s)
        );
        format!(
            r##"<?xml version="1.0" encoding="UTF-8"?>
<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height:.0}" viewBox="0 0 {WIDTH} {height:.0}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif">
<style>
.title {{ font-size: 16px; font-weight: bold; }}
.sub {{ font-size: 11px; fill: #555; }}
.dev {{ font-size: 13px; font-weight: bold; }}
.lane {{ font-size: 11px; fill: #333; }}
.task {{ font-size: 10px; fill: #fff; pointer-events: none; }}
.win {{ font-size: 10px; fill: #b35900; }}
.tick {{ font-size: 10px; fill: #555; text-anchor: middle; }}
.grid {{ stroke: #e4e4e4; stroke-width: 1; }}
.sep {{ stroke: #f0f0f0; stroke-width: 1; }}
.frame {{ fill: none; stroke: #ccc; stroke-width: 0.5; }}
</style>
<rect width="100%" height="100%" fill="#ffffff"/>
<text x="8" y="22" class="title">{}</text>
<text x="8" y="40" class="sub">cost model: {}</text>
{axis}
{body}
{legend}
</svg>
"##,
            esc(&title),
            esc(&self.cost_source)
        )
    }

    /// Writes [`SimReport::svg`].
    pub fn write_svg(&self, w: &mut impl Write) -> io::Result<()> {
        w.write_all(self.svg().as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round() {
        assert_eq!(tick_step(10.0, 10.0), 1.0);
        assert_eq!(tick_step(2.3, 10.0), 0.2);
        assert_eq!(tick_step(0.05, 10.0), 0.005);
        assert_eq!(tick_step(0.0, 10.0), 1.0);
    }

    #[test]
    fn escapes_markup() {
        assert_eq!(esc(r#"a<b & "c">"#), "a&lt;b &amp; &quot;c&quot;&gt;");
    }

    #[test]
    fn area_path_is_closed_and_in_the_chart() {
        let x = |t: f64| t * 100.0;
        let d = area_path(&[(0.0, 0.5), (1.0, 1.0)], 2.0, &x, 10.0, 20.0);
        assert!(d.starts_with("M0.00,30.00") && d.ends_with("Z"), "{d}");
        assert!(d.contains("L100.00,10.00"), "{d}");
    }
}
