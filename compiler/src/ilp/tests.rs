//! The model against hand-solved problems.

use super::options::whole_items;
use super::*;

const GIB: f64 = (1u64 << 30) as f64;

fn item(name: &str, gib: f64, off_s: f64) -> ResItem {
    ResItem {
        name: name.into(),
        bytes: gib * GIB,
        host_bytes: gib * GIB,
        off_s,
        decode_kept: false,
        decode_off: false,
        decode_if_class: vec![],
        train_kept: true,
        train_off: false,
        stream: None,
        fixed: None,
    }
}

/// Residency alone, hand-solved: A (10 GiB, 1.0 s off HBM), B (4 GiB, 0.2 s); the
/// training row has `80 - 70 - 14 = -4` GiB of room with both in HBM.
fn problem(train_budget_gib: f64, beside: bool) -> Problem {
    let mut reshard = vec![ReshardOption {
        name: "iteration_start",
        exposed_s: 0.5,
        excludes: vec![],
    }];
    if beside {
        reshard.push(ReshardOption {
            name: "beside_encode",
            exposed_s: 0.1,
            excludes: vec![1],
        });
    }
    Problem {
        options: vec![],
        decode_time: vec![],
        classes: vec![],
        precs: vec![],
        headroom: 0.0,
        residency: Some(Residency {
            items: vec![item("A", 10.0, 1.0), item("B", 4.0, 0.2)],
            kept: vec![],
            decode_base: 0.0,
            train_base: 70.0 * GIB,
            decode_budget: 80.0 * GIB,
            train_budget: train_budget_gib * GIB,
            host_budget: 100.0 * GIB,
            reshard,
            act_layers: None,
            prompt_layers: None,
        }),
        time_limit_s: 5.0,
    }
}

#[test]
fn moves_the_cheapest_item_that_makes_room() {
    // 4 GiB short: B alone (0.2 s) beats A (1.0 s).
    let a = solve(&problem(80.0, false)).unwrap();
    assert_eq!(a.off, vec![false, true]);
    // 9 GiB short: B is too small, A alone is cheaper than both.
    let a = solve(&problem(75.0, false)).unwrap();
    assert_eq!(a.off, vec![true, false]);
    assert!((a.objective - 1.5).abs() < 1e-9, "{}", a.objective);
    // Room for both: nothing moves.
    let a = solve(&problem(90.0, false)).unwrap();
    assert_eq!(a.off, vec![false, false]);
}

#[test]
fn reshard_point_trades_against_residency() {
    // Beside-encode (0.1 s) needs B in HBM, so it needs A off (1.0 s): 1.1 s against
    // B off at iteration start, 0.2 + 0.5 = 0.7 s.
    let a = solve(&problem(80.0, true)).unwrap();
    assert_eq!((a.off.clone(), a.reshard), (vec![false, true], 0));
    // With room for both, beside-encode wins alone.
    let a = solve(&problem(90.0, true)).unwrap();
    assert_eq!((a.off.clone(), a.reshard), (vec![false, false], 1));
}

/// Kept activation layers against the residency items, hand-solved: 28 layers, 1 GiB and
/// 0.05 s a layer. With A and B in HBM the training row has -4 GiB of room; B off (0.2 s)
/// frees 4 GiB for nothing, A off (1.0 s) 10 GiB: 0 layers kept recompute 1.4 s, so moving B
/// costs 0.2 s and keeps none; moving A too (1.2 s) makes room for 10 layers (saving 0.5 s):
/// 1.2 + 0.9 = 2.1 s against 0.2 + 1.4 = 1.6 s, B alone wins. At 0.2 s a layer A is worth
/// moving: 1.2 + 18 x 0.2 = 4.8 s against 0.2 + 5.6 = 5.8 s.
#[test]
fn kept_activation_layers_trade_against_residency() {
    let with = |recompute_s: f64, budget: f64| {
        let mut p = problem(budget, false);
        if let Some(r) = p.residency.as_mut() {
            r.act_layers = Some(ActLayers {
                layers: 28,
                bytes_per_layer: GIB,
                recompute_s,
                decode: ActDecode::Never,
                in_state: None,
            });
        }
        solve(&p).unwrap()
    };
    let a = with(0.05, 80.0);
    assert_eq!((a.off.clone(), a.act_layers), (vec![false, true], Some(0)));
    assert!((a.objective - 0.7 - 1.4).abs() < 1e-6, "{}", a.objective);
    let a = with(0.2, 80.0);
    assert_eq!((a.off.clone(), a.act_layers), (vec![true, true], Some(10)));
    // Room for everything: every layer kept, nothing moves.
    let a = with(0.2, 200.0);
    assert_eq!(
        (a.off.clone(), a.act_layers),
        (vec![false, false], Some(28))
    );
    assert!((a.objective - 0.5).abs() < 1e-6, "{}", a.objective);
    // Room for part at 0.06 s a layer: 95 GiB keeps 11 layers with both items in HBM (1.02 s
    // of recompute); B off keeps 15 (0.2 + 0.78 s), A off 21 (1.0 + 0.42 s), both 25 (1.2 +
    // 0.18 s): B off wins.
    let a = with(0.06, 95.0);
    assert_eq!((a.off.clone(), a.act_layers), (vec![false, true], Some(15)));
}

/// The two kept-layers decisions share the memory rows: the response rows (1 GiB and 0.2 s a
/// layer, training row only) and the prompt rows (2 GiB and 0.1 s a layer, in the decode row
/// too: the prefill keeps them). Training has 200 - 84 = 116 GiB of room, decode 30: the
/// decode row caps the prompt rows at 15 layers, the response rows take all 28. With 40 GiB
/// of training room, 28 + 2 x 6 = 40: the response rows (0.2 s a GiB) come first, then 6
/// prompt layers (0.05 s a GiB).
#[test]
fn prompt_rows_take_the_room_the_response_rows_leave() {
    let with = |train_budget: f64| {
        let mut p = problem(train_budget, false);
        if let Some(r) = p.residency.as_mut() {
            r.decode_budget = 30.0 * GIB;
            r.act_layers = Some(ActLayers {
                layers: 28,
                bytes_per_layer: GIB,
                recompute_s: 0.2,
                decode: ActDecode::Never,
                in_state: None,
            });
            r.prompt_layers = Some(ActLayers {
                layers: 28,
                bytes_per_layer: 2.0 * GIB,
                recompute_s: 0.1,
                decode: ActDecode::Always,
                in_state: None,
            });
        }
        solve(&p).unwrap()
    };
    let a = with(200.0);
    assert_eq!(
        (a.off.clone(), a.act_layers, a.prompt_layers),
        (vec![false, false], Some(28), Some(15))
    );
    assert!(
        (a.objective - 0.5 - 13.0 * 0.1).abs() < 1e-6,
        "{}",
        a.objective
    );
    let a = with(124.0);
    assert_eq!(
        (a.off.clone(), a.act_layers, a.prompt_layers),
        (vec![false, false], Some(28), Some(6))
    );
}

#[test]
fn over_budget_still_answers_with_everything_off() {
    let a = solve(&problem(50.0, false)).unwrap();
    assert_eq!(a.off, vec![true, true]);
}

#[test]
fn host_budget_is_respected() {
    let mut p = problem(80.0, false);
    if let Some(r) = p.residency.as_mut() {
        r.host_budget = 5.0 * GIB;
    }
    // B fits on the host (4 GiB), A does not.
    assert_eq!(solve(&p).unwrap().off, vec![false, true]);
    if let Some(r) = p.residency.as_mut() {
        r.host_budget = 3.0 * GIB;
    }
    assert_eq!(solve(&p).unwrap().off, vec![false, false]);
}

/// One window, a class of 4 items (1 s each on the side partition or after decode) whose
/// kept state is 8 GiB (4 GiB next to decode when on host, 0.5 s of transfers), decode
/// base 70 GiB. Splitting costs decode 0.5 s, so running the class in the window saves
/// 3.5 s: HBM when it fits (78 GiB), host when only 74 GiB do, after decode when even that
/// does not or when host memory or transfers cost too much.
fn kept(decode_budget_gib: f64, host_s: f64, host_budget_gib: f64) -> Problem {
    Problem {
        options: vec![
            SplitOption {
                decode_sms: 64,
                side_sms: 68,
            },
            SplitOption {
                decode_sms: 132,
                side_sms: 0,
            },
        ],
        decode_time: vec![vec![10.5, 10.0]],
        classes: vec![ClassInput {
            name: "train_prefix",
            count: 4,
            ready: vec![4],
            item_time: vec![1.0, f64::INFINITY],
            decode_slowdown: 1.0,
            post_time: 1.0,
            bytes: 8.0 * GIB,
        }],
        precs: vec![],
        headroom: 0.0,
        residency: Some(Residency {
            items: vec![],
            kept: vec![KeptState {
                name: "train_prefix.s0".into(),
                class: 0,
                consumers: vec![],
                host_resident: 4.0 * GIB,
                host_bytes: 8.0 * GIB,
                host_s,
            }],
            decode_base: 70.0 * GIB,
            train_base: 0.0,
            decode_budget: decode_budget_gib * GIB,
            train_budget: 80.0 * GIB,
            host_budget: host_budget_gib * GIB,
            reshard: vec![ReshardOption {
                name: "iteration_start",
                exposed_s: 0.0,
                excludes: vec![],
            }],
            act_layers: None,
            prompt_layers: None,
        }),
        time_limit_s: 5.0,
    }
}

/// One window: decode takes 10 s alone on the split's 64 SMs, 9 s on the whole GPU; 4
/// items of 1 s each (on the side partition, or after decode). An item slows decode `s`
/// times while it runs, costing it `1 - 1/s` s: with s = 2 the window takes 10 + 4 x 0.5 =
/// 12 s against 9 + 4 = 13 s without the split (a whole-window slowdown would have priced
/// the split at 20 s); with s = 5, 10 + 4 x 0.8 = 13.2 s, and the items run after decode.
#[test]
fn side_items_cost_decode_only_while_they_run() {
    let p = |s: f64| {
        let mut p = kept(100.0, 0.0, 100.0);
        p.decode_time = vec![vec![10.0, 9.0]];
        p.classes[0].decode_slowdown = s;
        p.residency.as_mut().unwrap().kept.clear();
        p
    };
    let placed = |a: &Answer| a.counts[0].iter().sum::<u32>();
    let a = solve(&p(2.0)).unwrap();
    assert_eq!((placed(&a), a.option.clone()), (4, vec![0]));
    assert!((a.objective - 12.0).abs() < 1e-6, "{}", a.objective);
    let a = solve(&p(5.0)).unwrap();
    assert_eq!((placed(&a), a.option.clone()), (0, vec![1]));
    assert!((a.objective - 13.0).abs() < 1e-6, "{}", a.objective);
    // the side work must end before decode: at s = 2, 4 items use up 2 s of decode's 10 s;
    // with decode at 1.2 s alone on the split only 2 items fit (2 x 0.5 <= 1.2 < 3 x 0.5)
    let mut q = p(2.0);
    q.decode_time = vec![vec![1.2, 1.0]];
    let a = solve(&q).unwrap();
    assert_eq!(placed(&a), 2);
    assert!((a.objective - 4.2).abs() < 1e-6, "{}", a.objective);
}

/// Three windows of 1 s decode on the split (0.9 s on the whole GPU), one item of 1.5 s on
/// the side partition (0.2 s after decode on the whole GPU): it fits no window by itself.
/// A continuous count could put half of it in each of two windows (its cumulative count
/// floors to 1, which no window can hold); the count is bounded by the whole items that fit,
/// so the item runs after decode and no window splits.
#[test]
fn an_item_too_large_for_every_window_is_not_spread_over_several() {
    let mut p = kept(100.0, 0.0, 100.0);
    p.residency.as_mut().unwrap().kept.clear();
    p.decode_time = vec![vec![1.0, 0.9]; 3];
    p.classes[0].count = 1;
    p.classes[0].ready = vec![1; 3];
    p.classes[0].item_time = vec![1.5, f64::INFINITY];
    p.classes[0].post_time = 0.2;
    let a = solve(&p).unwrap();
    assert_eq!(a.counts[0], vec![0, 0, 0]);
    assert_eq!(a.option, vec![1, 1, 1]);
    assert!((a.objective - 2.9).abs() < 1e-6, "{}", a.objective);
    assert_eq!(whole_items(0.5, 1.2, 4), 2);
    assert_eq!(whole_items(1.5, 1.0, 4), 0);
    assert_eq!(whole_items(0.1, 10.0, 4), 4);
    assert_eq!(whole_items(0.0, 1.0, 4), 4);
    assert_eq!(whole_items(1.0, f64::NAN, 4), 0);
}

#[test]
fn kept_state_in_hbm_on_host_or_after_decode() {
    let placed = |a: &Answer| a.counts[0].iter().sum::<u32>();
    let a = solve(&kept(80.0, 0.5, 100.0)).unwrap();
    assert_eq!((placed(&a), a.kept_host.clone()), (4, vec![false]));
    assert!((a.objective - 10.5).abs() < 1e-9, "{}", a.objective);
    let a = solve(&kept(75.0, 0.5, 100.0)).unwrap();
    assert_eq!((placed(&a), a.kept_host.clone()), (4, vec![true]));
    assert!((a.objective - 11.0).abs() < 1e-9, "{}", a.objective);
    // 72 GiB: not even the chunks fit next to decode.
    let a = solve(&kept(72.0, 0.5, 100.0)).unwrap();
    assert_eq!((placed(&a), a.kept_host.clone()), (0, vec![false]));
    assert!((a.objective - 14.0).abs() < 1e-9, "{}", a.objective);
    // Transfers dearer than the overlap saves, or no host memory: after decode.
    let a = solve(&kept(75.0, 5.0, 100.0)).unwrap();
    assert_eq!((placed(&a), a.kept_host.clone()), (0, vec![false]));
    let a = solve(&kept(75.0, 0.5, 4.0)).unwrap();
    assert_eq!((placed(&a), a.kept_host.clone()), (0, vec![false]));
}
