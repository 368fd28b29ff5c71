//! The SM-split search: which splits each window is offered, and how many whole items of a
//! class fit beside a decode.

use super::Problem;

/// Fraction by which side work may exceed a window's decode time when filling.
pub const FILL_SLACK: f64 = 0.03;

/// Decode slowdowns of a partition (decode alone on the split's decode SMs relative to decode
/// on the whole GPU; what side work beside it adds is priced per item) at which a split is
/// offered: for each, the split with the fewest decode SMs within it.
pub const KNEES: [f64; 4] = [0.02, 0.08, 0.2, 0.4];

/// Options offered for one window: decode alone, and per knee the split that gives decode the
/// fewest SMs while keeping its time within the knee. Splits in between are dominated in
/// practice (the measured decode curves are flat past their knee and steep below it), and
/// fewer options keep the model small: its binaries are windows x offered options.
pub(super) fn useful_options(p: &Problem, w: usize) -> Vec<usize> {
    let nos = (0..p.options.len()).find(|&j| p.options[j].side_sms == 0);
    let base = nos.map(|j| p.decode_time[w][j]).unwrap_or(f64::INFINITY);
    let mut splits: Vec<usize> = (0..p.options.len())
        .filter(|&j| p.options[j].side_sms > 0 && p.decode_time[w][j].is_finite())
        .collect();
    splits.sort_by_key(|&j| p.options[j].decode_sms);
    let mut keep: Vec<usize> = Vec::new();
    for k in KNEES {
        if let Some(&j) = splits
            .iter()
            .find(|&&j| p.decode_time[w][j] <= base * (1.0 + k))
        {
            if !keep.contains(&j) {
                keep.push(j);
            }
        }
    }
    keep.extend(nos);
    keep.sort_unstable();
    keep
}

/// How many items that each use up `per_item` of a decode's time alone fit beside a decode of
/// `decode` seconds (with the fill's slack, [`FILL_SLACK`]), at most
/// `count`.
pub(super) fn whole_items(per_item: f64, decode: f64, count: u32) -> u32 {
    // zero (or NaN) time per item: nothing bounds the count but the class
    if per_item.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
        return count;
    }
    let fit = (decode * (1.0 + FILL_SLACK) / per_item).floor();
    if fit.is_finite() {
        (fit.max(0.0) as u64).min(count as u64) as u32
    } else {
        0
    }
}

/// A slowdown as the model uses it: finite and at least 1.
pub(super) fn slowdown(s: f64) -> f64 {
    if s.is_finite() {
        s.max(1.0)
    } else {
        1.0
    }
}

/// The option without side SMs (decode on the whole GPU): the all-after-decode answer's
/// choice and the fallback of a window the solution leaves undecided.
pub(super) fn decode_alone(p: &Problem) -> usize {
    p.options.iter().position(|o| o.side_sms == 0).unwrap_or(0)
}
