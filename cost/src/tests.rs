//! API-level tests of the cost model: defaults, invariants (property tests), profiles.

use proptest::prelude::*;
use rollplex_plan::work::{Work, WorkKind};

use crate::defaults::{datasheet, ALL_KINDS};
use crate::*;

fn h200() -> GpuSpec {
    datasheet("H200").expect("H200 is a known datasheet")
}

fn work(flops: f64, bytes: f64, steps: u32) -> Work {
    Work {
        flops,
        bytes,
        steps,
        ..Work::default()
    }
}

#[test]
fn default_model_is_a_roofline_on_the_whole_gpu() {
    let m = CostModel::new(&h200(), None);
    // compute-bound: 1 PFLOP at 0.6 * 989 TFLOP/s
    let t = m.time(WorkKind::Prefill, &work(1e15, 1e9, 0), 132);
    assert!((t - 1e15 / (0.6 * 989e12)).abs() < 1e-9, "{t}");
    // memory-bound: 10 GB at 0.7 * 4.8 TB/s, plus 100 steps of 20 us
    let t = m.time(WorkKind::Decode, &work(1e9, 10e9, 100), 132);
    assert!(
        (t - (10e9 / (0.7 * 4.8e12) + 100.0 * 20e-6)).abs() < 1e-9,
        "{t}"
    );
}

#[test]
fn host_and_network_terms_add() {
    let m = CostModel::new(&h200(), None).with_net_bw(400e9);
    let w = Work {
        host_bytes: 64e9,
        net_bytes: 400e9,
        ..Work::default()
    };
    let p = m.time_parts(WorkKind::Transfer, &w, 8);
    assert!(
        (p.host_s - 1.0).abs() < 1e-12 && (p.net_s - 1.0).abs() < 1e-12,
        "{p:?}"
    );
    assert!((p.total() - 2.0).abs() < 1e-12);
}

#[test]
fn a_part_is_priced_at_its_own_kind() {
    use rollplex_plan::work::WorkPart;
    let mut m = CostModel::new(&h200(), None);
    let mut slow = m.curve(WorkKind::VisionEncode).clone();
    slow.eff_compute = 0.2;
    m.set_curve(WorkKind::VisionEncode, slow);
    let own = work(3e14, 1e9, 36);
    let part = work(1e14, 1e8, 64);
    let mut w = own.clone();
    w.parts.push(WorkPart {
        kind: WorkKind::VisionEncode,
        work: part.clone(),
    });
    for sms in [48, 84, 132] {
        let t = m.time_parts(WorkKind::ActorBwd, &w, sms);
        let alone = m.time(WorkKind::ActorBwd, &own, sms);
        let vision = m.time(WorkKind::VisionEncode, &part, sms);
        assert!((t.parts_s - vision).abs() < 1e-12, "{t:?}");
        assert!((t.total() - alone - vision).abs() < 1e-9, "{t:?}");
        // the slow tower is not priced at the backward's rate
        assert!(vision > m.time(WorkKind::ActorBwd, &part, sms) * 2.5);
    }
}

#[test]
fn zero_sms_is_infinite_for_gpu_work_and_harmless_for_host_work() {
    let m = CostModel::new(&h200(), None);
    assert!(m
        .time(WorkKind::Decode, &work(1.0, 1.0, 1), 0)
        .is_infinite());
    let host = Work {
        host_bytes: 1e9,
        ..Work::default()
    };
    assert!(m.time(WorkKind::Reward, &host, 0).is_finite());
    assert_eq!(m.time(WorkKind::Decode, &Work::default(), 0), 0.0);
}

#[test]
fn sm_options_follow_the_granularity_and_its_remainders() {
    let m = CostModel::new(&h200(), None);
    let v = m.sm_options();
    assert_eq!(v.first(), Some(&4));
    assert_eq!(v.last(), Some(&132));
    assert!(v.contains(&48) && v.contains(&84) && v.contains(&128) && !v.contains(&50));
    assert!(v.windows(2).all(|w| w[0] < w[1]));
    let splits = m.split_options();
    assert_eq!(splits.len(), 16);
    assert!(splits.iter().all(|&(a, b)| a % 8 == 0 && a + b == 132));
    let mut odd = h200();
    odd.sm_granularity = 0;
    odd.sms = 3;
    assert_eq!(CostModel::new(&odd, None).sm_options(), vec![1, 2, 3]);
}

#[test]
fn host_work_corun_is_free_and_gpu_work_is_not() {
    let m = CostModel::new(&h200(), None);
    assert_eq!(m.corun_slowdown(WorkKind::Reward, WorkKind::Decode), 1.0);
    assert_eq!(m.corun_slowdown(WorkKind::Decode, WorkKind::Reward), 1.0);
    assert!(m.corun_slowdown(WorkKind::Decode, WorkKind::Prefill) > 1.0);
}

#[test]
fn corun_pair_time_cases() {
    // no slowdown: the longer one
    assert_eq!(corun_pair_time(2.0, 1.0, 1.0, 1.0), 2.0);
    // b (1 s) runs at half speed for 2 s, a finishes its remaining 2 - 2/2 = 1 s alone
    assert!((corun_pair_time(2.0, 1.0, 2.0, 2.0) - 3.0).abs() < 1e-12);
    assert!((corun_pair_time(1.0, 2.0, 2.0, 2.0) - 3.0).abs() < 1e-12);
    assert_eq!(corun_pair_time(0.0, 1.5, 1.2, 1.2), 1.5);
    // never better than the longer alone, never worse than serial * slowdown
    let t = corun_pair_time(0.7, 0.9, 1.2, 1.3);
    assert!((0.9..=1.6 * 1.3).contains(&t));
}

#[test]
fn beside_time_cases() {
    // nothing beside: alone
    assert_eq!(beside_time(2.0, &[]), 2.0);
    // one side piece that ends first: the pair's makespan
    let pair = corun_pair_time(2.0, 0.5, 1.5, 1.2);
    assert!((beside_time(2.0, &[(0.5 * 1.2, 1.5)]) - pair).abs() < 1e-12);
    // 1 s slowed 2x costs 0.5 s of progress: 1 + (2 - 0.5) = 2.5
    assert!((beside_time(2.0, &[(1.0, 2.0)]) - 2.5).abs() < 1e-12);
    // two pieces: 1 s at 2x (0.5 s done), 1 s at 1.25x (0.8 s done), 0.7 s alone
    assert!((beside_time(2.0, &[(1.0, 2.0), (1.0, 1.25)]) - 2.7).abs() < 1e-12);
    // side work longer than the slowed task: alone times the slowdown
    assert!((beside_time(2.0, &[(5.0, 1.5)]) - 3.0).abs() < 1e-12);
    // host work (slowdown 1) costs nothing; bad inputs count as none
    assert_eq!(
        beside_time(2.0, &[(1.0, 1.0), (f64::NAN, 2.0), (-1.0, 2.0)]),
        2.0
    );
    assert_eq!(beside_time(0.0, &[(1.0, 2.0)]), 0.0);
    // never below alone, never above alone times the worst slowdown
    let t = beside_time(1.0, &[(0.3, 1.4), (0.4, 1.1), (2.0, 1.3)]);
    assert!((1.0..=1.4).contains(&t), "{t}");
}

#[test]
fn profile_from_the_same_gpu_keeps_absolute_rates() {
    let gpu = h200();
    let mut prof = Profile::fit(
        &gpu,
        vec![Point {
            kind: WorkKind::Prefill,
            sms: 132,
            work: work(1e15, 1e9, 0),
            seconds: 2.0,
            note: String::new(),
        }],
        vec![],
    )
    .unwrap();
    prof.source = "test".into();
    let a = CostModel::new(&gpu, Some(&prof)).time(WorkKind::Prefill, &work(1e15, 1e9, 0), 132);
    let mut declared = gpu.clone();
    declared.bf16_flops *= 2.0; // the job declares other peaks: measured speed still holds
    let b =
        CostModel::new(&declared, Some(&prof)).time(WorkKind::Prefill, &work(1e15, 1e9, 0), 132);
    assert!((a - 2.0).abs() < 0.02 && (b - a).abs() < 1e-9, "{a} {b}");
    let mut other = datasheet("H800").unwrap();
    other.bf16_flops *= 2.0; // another GPU: the fraction carries over to its peak
    let c = CostModel::new(&other, Some(&prof)).time(WorkKind::Prefill, &work(1e15, 1e9, 0), 132);
    assert!((c - a / 2.0).abs() < 1e-6, "{c}");
    assert!(CostModel::new(&gpu, Some(&prof)).source().contains("test"));
}

#[test]
fn profile_yaml_round_trips_and_rejects_bad_input() {
    let gpu = h200();
    let prof = Profile::fit(
        &gpu,
        vec![Point {
            kind: WorkKind::Decode,
            sms: 64,
            work: work(1e12, 1e10, 280),
            seconds: 0.01,
            note: "x".into(),
        }],
        vec![],
    )
    .unwrap();
    let text = prof.to_yaml();
    assert_eq!(Profile::from_yaml(&text).unwrap(), prof);
    assert!(text.contains("decode:"), "{text}");

    let e = Profile::from_yaml("gpu: 3").unwrap_err();
    assert!(matches!(e, ProfileError::Yaml(_)), "{e}");
    let mut bad = prof.clone();
    bad.default_corun = 0.5;
    let e = Profile::from_yaml(&bad.to_yaml()).unwrap_err();
    assert!(e.to_string().contains("default_corun"), "{e}");
    let mut bad = prof.clone();
    bad.points[0].sms = 500;
    assert!(Profile::from_yaml(&bad.to_yaml())
        .unwrap_err()
        .to_string()
        .contains("sms = 500"));
    let mut bad = prof;
    bad.kinds.get_mut(&WorkKind::Decode).unwrap().eff_memory = 2.0;
    assert!(Profile::from_yaml(&bad.to_yaml())
        .unwrap_err()
        .to_string()
        .contains("eff_memory"));
}

fn any_kind() -> impl Strategy<Value = WorkKind> {
    (0..ALL_KINDS.len()).prop_map(|i| ALL_KINDS[i])
}

fn any_work() -> impl Strategy<Value = Work> {
    (
        0.0..1e16f64,
        0.0..1e12f64,
        0u32..100_000,
        0.0..1e11f64,
        0.0..1e11f64,
    )
        .prop_map(|(flops, bytes, steps, host_bytes, net_bytes)| Work {
            flops,
            bytes,
            steps,
            host_bytes,
            net_bytes,
            parts: Vec::new(),
        })
}

fn models() -> Vec<CostModel> {
    let gpu = h200();
    let mut v = vec![
        CostModel::new(&gpu, None),
        CostModel::new(&datasheet("H800").unwrap(), None),
    ];
    let shipped =
        Profile::from_yaml(include_str!("../profiles/h200.yaml")).expect("shipped profile parses");
    v.push(CostModel::new(&gpu, Some(&shipped)));
    v
}

proptest! {
    #[test]
    fn more_sms_never_slower(kind in any_kind(), w in any_work(), s in 1u32..132, extra in 1u32..132) {
        for m in models() {
            let a = m.time(kind, &w, s);
            let b = m.time(kind, &w, s + extra);
            prop_assert!(b <= a * (1.0 + 1e-12), "{kind:?} {s}->{}: {a} -> {b}", s + extra);
        }
    }

    #[test]
    fn more_work_never_faster(kind in any_kind(), w in any_work(), s in 1u32..=132,
                              which in 0usize..5, factor in 1.0..10.0f64) {
        let mut more = w.clone();
        match which {
            0 => more.flops *= factor,
            1 => more.bytes *= factor,
            2 => more.steps = more.steps.saturating_mul(factor as u32),
            3 => more.host_bytes *= factor,
            _ => more.net_bytes *= factor,
        }
        for m in models() {
            let (a, b) = (m.time(kind, &w, s), m.time(kind, &more, s));
            prop_assert!(b >= a, "{kind:?}: {a} -> {b}");
            prop_assert!(a.is_finite() && a >= 0.0);
        }
    }

    #[test]
    fn slowdowns_are_at_least_one(a in any_kind(), b in any_kind()) {
        for m in models() {
            prop_assert!(m.corun_slowdown(a, b) >= 1.0);
        }
    }

    #[test]
    fn corun_is_between_max_and_slowed_sum(a in 0.0..10.0f64, b in 0.0..10.0f64,
                                           sa in 1.0..2.0f64, sb in 1.0..2.0f64) {
        let t = corun_pair_time(a, b, sa, sb);
        prop_assert!(t >= a.max(b) - 1e-12);
        prop_assert!(t <= (a + b) * sa.max(sb) + 1e-12);
    }
}

#[test]
fn report_lines_cut_long_profile_sources_on_a_char_boundary() {
    assert_eq!(super::abridged("one run"), "one run");
    let long = "é".repeat(super::SOURCE_CHARS + 5);
    let cut = super::abridged(&long);
    assert!(cut.starts_with(&"é".repeat(super::SOURCE_CHARS)));
    assert!(cut.ends_with("(the profile's `source` lists the rest)"));
    assert!(!cut.contains(&"é".repeat(super::SOURCE_CHARS + 1)));
}

#[test]
fn the_free_bound_hides_movable_work_up_to_the_decode_time() {
    let pt = |kind, seconds| Point {
        kind,
        sms: 132,
        work: work(1e12, 1e9, 1),
        seconds,
        note: String::new(),
    };
    let serial = |points| {
        let mut p = Profile::fit(&h200(), vec![pt(WorkKind::Decode, 1.0)], vec![]).unwrap();
        p.points = points;
        p
    };
    // 1 s of movable work (0.6 ref prefix, 0.4 reward) beside 2 s of decode: all of it hides
    let p = serial(vec![
        pt(WorkKind::Prefill, 1.0),
        pt(WorkKind::Decode, 2.0),
        pt(WorkKind::RefPrefix, 0.6),
        pt(WorkKind::Reward, 0.4),
        pt(WorkKind::ActorBwd, 2.0),
    ]);
    let b = bound::free_bound(&p).unwrap();
    assert_eq!((b.total, b.movable, b.decode), (6.0, 1.0, 2.0));
    assert!((b.speedup() - 6.0 / 5.0).abs() < 1e-12);
    assert_eq!(b.by_kind["actor_bwd"], 2.0);
    // overlap at 6 s -> 5.5 s saved half of the bound's second; at serial's time, none
    assert!((b.captured(6.0 / 5.5).unwrap() - 0.5).abs() < 1e-12);
    assert!((b.captured(6.0 / 5.0).unwrap() - 1.0).abs() < 1e-12);
    assert_eq!(b.captured(1.0), Some(0.0));
    assert!(b.captured(6.0 / 6.6).unwrap() < 0.0, "slower than serial");
    // more movable work than decode: only the decode's worth hides
    let p = serial(vec![
        pt(WorkKind::Decode, 1.0),
        pt(WorkKind::ActorPrefixFwd, 3.0),
    ]);
    assert!((bound::free_bound(&p).unwrap().speedup() - 4.0 / 3.0).abs() < 1e-12);
    // nothing movable: no headroom to capture
    let none = bound::free_bound(&serial(vec![pt(WorkKind::Decode, 1.0)])).unwrap();
    assert_eq!(none.captured(1.1), None);
    // an overlap run's profile (co-run measurements) is refused
    let mut p = serial(vec![pt(WorkKind::Decode, 1.0)]);
    p.beside_points.push(BesidePoint {
        kind: WorkKind::Decode,
        sms: 48,
        work: work(1e12, 1e9, 1),
        seconds: 1.5,
        beside: WorkKind::RefPrefix,
        note: String::new(),
    });
    let e = bound::free_bound(&p).unwrap_err().to_string();
    assert!(e.contains("serial plan"), "{e}");
}

/// Copies of one direction: `n` copies of `gb` GB each at `gbps` GB/s.
fn copies(n: u32, gb: f64, gbps: f64) -> CopySum {
    let mut s = CopySum::default();
    for _ in 0..n {
        s.add(gb * 1e9, gb / gbps);
    }
    s
}

/// A profile of one decode point on the H200 with `host` copies measured.
fn with_copies(host: HostCopies) -> Profile {
    let decode = Point {
        kind: WorkKind::Decode,
        sms: 132,
        work: work(1e12, 1e9, 10),
        seconds: 1e-3,
        note: String::new(),
    };
    let mut p = Profile::unfitted(&h200(), vec![decode], vec![], vec![], LatencyFit::PerKind);
    p.set_host_copies(host);
    p.refit().unwrap()
}

/// Offloads are priced at the device -> host rate, every other task's host bytes at the
/// host -> device one; without a figure for a direction the GPU spec's (or host_bw's) holds.
#[test]
fn each_direction_has_its_own_host_rate() {
    let p = with_copies(HostCopies {
        to_device: copies(3, 2.0, 40.0),
        to_host: copies(2, 1.0, 20.0),
    });
    assert!((p.host_bw.unwrap() / 40e9 - 1.0).abs() < 1e-12);
    assert!((p.host_bw_to_host.unwrap() / 20e9 - 1.0).abs() < 1e-12);
    let m = CostModel::new(&h200(), Some(&p));
    let w = Work {
        host_bytes: 8e9,
        ..Work::default()
    };
    let host_s = |dir| m.time_parts_dir(WorkKind::Transfer, &w, 132, dir).host_s;
    assert!((host_s(HostDir::ToDevice) - 0.2).abs() < 1e-12);
    assert!((host_s(HostDir::ToHost) - 0.4).abs() < 1e-12);
    let to_device = m.time_dir(WorkKind::Transfer, &w, 132, HostDir::ToDevice);
    assert_eq!(m.time(WorkKind::Transfer, &w, 132), to_device);
    // the plan's rule: only an offload goes to the host
    let b = rollplex_plan::BufferId::from_index;
    let offload = rollplex_plan::Op::Offload {
        from: b(0),
        to: b(1),
    };
    let reload = rollplex_plan::Op::Reload {
        from: b(1),
        to: b(0),
    };
    assert_eq!(
        (offload.host_dir(), reload.host_dir()),
        (HostDir::ToHost, HostDir::ToDevice)
    );

    // only host -> device measured: offloads at that rate too
    let p = with_copies(HostCopies {
        to_device: copies(1, 2.0, 40.0),
        ..HostCopies::default()
    });
    let m = CostModel::new(&h200(), Some(&p));
    assert_eq!((m.host_bw(), m.host_bw_to_host()), (40e9, 40e9));
    // on another GPU the same fraction of its host link (H200 spec 64 GB/s, measured 40)
    let mut h800 = crate::defaults::datasheet("H800").unwrap();
    h800.host_bw = 32e9;
    let m = CostModel::new(&h800, Some(&p));
    assert_eq!((m.host_bw(), m.host_bw_to_host()), (20e9, 20e9));
    // none measured: the GPU spec's, both ways
    let p = with_copies(HostCopies::default());
    assert_eq!((p.host_bw, p.host_bw_to_host), (None, None));
    let m = CostModel::new(&h200(), Some(&p));
    assert_eq!((m.host_bw(), m.host_bw_to_host()), (64e9, 64e9));
    assert_eq!(m.host_bw_of(HostDir::ToHost), h200().host_bw);
}

/// A profile written before the fields existed reads as before: no device -> host figure, no
/// copies, and `host_bw: null` leaves the GPU spec's rate.
#[test]
fn a_profile_without_host_copies_still_reads() {
    let old = "gpu:
  name: H200
  sms: 132
  sm_granularity: 8
  hbm_bytes: 141000000000
  hbm_bw: 4800000000000.0
  bf16_flops: 989000000000000.0
  host_bw: 55000000000.0
source: an older runtime profile
host_bw: null
net_bw: null
default_corun: 1.15
kinds: {}
points: []
corun_points: []
";
    let p = Profile::from_yaml(old).unwrap();
    assert_eq!((p.host_bw, p.host_bw_to_host), (None, None));
    assert!(p.host_copies.is_empty());
    // the job's GPU spec's (here the profile's own)
    let m = CostModel::new(&p.gpu, Some(&p));
    assert_eq!((m.host_bw(), m.host_bw_to_host()), (55e9, 55e9));
    // written back, it says nothing of host copies
    let text = p.to_yaml();
    assert!(!text.contains("host_copies") && !text.contains("host_bw_to_host"));
    // the shipped profiles: two from before host copies were recorded; the runtime profile
    // with the reloads its 7B runs measured and the 3B `host` plan's reloads and offloads
    let shipped = |f: &str| {
        let path = format!("{}/profiles/{f}", env!("CARGO_MANIFEST_DIR"));
        Profile::from_yaml(&std::fs::read_to_string(&path).unwrap()).unwrap()
    };
    for f in ["h200.yaml", "h200-3b-runtime.yaml"] {
        let p = shipped(f);
        assert!(
            p.host_copies.is_empty() && p.host_bw_to_host.is_none(),
            "{f}"
        );
    }
    let p = shipped("h200-runtime.yaml");
    assert!(p.host_copies.to_device.transfers > 0 && p.host_copies.to_host.transfers > 0);
    let m = CostModel::new(&p.gpu, Some(&p));
    assert!((m.host_bw() - 55.18e9).abs() < 0.01e9, "{}", m.host_bw());
    // the device -> host rate measured by its own copies (the 3B job's optimizer state
    // written back), not borrowed from the other direction
    let to_host = p.host_copies.to_host.bytes / p.host_copies.to_host.seconds;
    assert!((m.host_bw_to_host() - to_host).abs() < 1e-3 * to_host);
    assert!(
        (m.host_bw_to_host() - 55.19e9).abs() < 0.01e9,
        "{}",
        m.host_bw_to_host()
    );
}

/// The measured rates and their sums round-trip; a rate that disagrees with its copies, or
/// copies that cannot give a rate, are refused.
#[test]
fn measured_host_rates_round_trip_and_must_match_their_copies() {
    let p = with_copies(HostCopies {
        to_device: copies(3, 2.0, 40.0),
        to_host: copies(2, 1.0, 20.0),
    });
    let text = p.to_yaml();
    assert!(
        text.contains("host_bw_to_host:") && text.contains("transfers: 3"),
        "{text}"
    );
    assert_eq!(Profile::from_yaml(&text).unwrap(), p);
    assert_eq!(
        p.host_copies.describe(),
        "host -> device 40.00 GB/s from 3 reloads (6.000 GB in 150.000 ms); \
         device -> host 20.00 GB/s from 2 offloads (2.000 GB in 100.000 ms)"
    );
    let mut edited = p.clone();
    edited.host_bw = Some(50e9);
    let e = edited.validate().unwrap_err().to_string();
    assert!(
        e.contains("host_bw") && e.contains("host_copies.to_device"),
        "{e}"
    );
    let mut bad = p.clone();
    bad.host_copies.to_host.seconds = 0.0;
    let e = bad.validate().unwrap_err().to_string();
    assert!(e.contains("host_copies.to_host"), "{e}");
    // set by hand without copies: fine
    let mut hand = p;
    hand.host_copies = HostCopies::default();
    hand.host_bw = Some(50e9);
    hand.validate().unwrap();
}

/// Merged profiles combine their copies by bytes: per direction, all bytes over all seconds;
/// a direction no input measured keeps a figure set by hand, and one an input measured
/// overrides any.
#[test]
fn merge_weighs_measured_host_rates_by_bytes() {
    // 10 GB at 50 GB/s and 30 GB at 30 GB/s: 40 GB in 1.2 s
    let a = with_copies(HostCopies {
        to_device: copies(1, 10.0, 50.0),
        to_host: copies(2, 1.0, 20.0),
    });
    let b = with_copies(HostCopies {
        to_device: copies(3, 10.0, 30.0),
        ..HostCopies::default()
    });
    let mut hand = with_copies(HostCopies::default());
    hand.host_bw = Some(99e9);
    hand.host_bw_to_host = Some(77e9);
    let m = Profile::merge(&[
        ("hand.yaml".into(), hand.clone()),
        ("a.yaml".into(), a.clone()),
        ("b.yaml".into(), b.clone()),
    ])
    .unwrap();
    let c = &m.host_copies;
    assert_eq!((c.to_device.transfers, c.to_host.transfers), (4, 2));
    assert!((m.host_bw.unwrap() / (40e9 / 1.2) - 1.0).abs() < 1e-12);
    assert!((m.host_bw_to_host.unwrap() / 20e9 - 1.0).abs() < 1e-12);
    // a merge of merges adds the same copies
    let mm = Profile::merge(&[("m.yaml".into(), m.clone())]).unwrap();
    assert_eq!(mm.host_copies, m.host_copies);
    assert_eq!(mm.host_bw, m.host_bw);
    // only b measured, and only to the device: the hand-set device -> host figure stays
    let m = Profile::merge(&[("hand.yaml".into(), hand.clone()), ("b.yaml".into(), b)]).unwrap();
    assert!((m.host_bw.unwrap() / 30e9 - 1.0).abs() < 1e-12);
    assert_eq!(m.host_bw_to_host, Some(77e9));
    // nothing measured: the first figure set by hand, as before
    let none = with_copies(HostCopies::default());
    let m = Profile::merge(&[("none.yaml".into(), none), ("hand.yaml".into(), hand)]).unwrap();
    assert_eq!((m.host_bw, m.host_bw_to_host), (Some(99e9), Some(77e9)));
    assert!(m.host_copies.is_empty());
}

/// The fit prices points at the profile's host rate: a copy measured at 40 GB/s (an older
/// runtime profile's point of a reload) is the host link's time under the measured rate, and
/// only under the GPU spec's 64 GB/s does the transfer curve have to make up for it.
#[test]
fn the_fit_prices_host_bytes_at_the_profile_rate() {
    let copy = Point {
        kind: WorkKind::Transfer,
        sms: 132,
        work: Work {
            bytes: 16e9,
            steps: 1,
            host_bytes: 16e9,
            ..Work::default()
        },
        seconds: 0.4,
        note: "reload.ref_weights".into(),
    };
    let spec = Profile::fit(&h200(), vec![copy.clone()], vec![]).unwrap();
    let mut measured = Profile::unfitted(&h200(), vec![copy], vec![], vec![], LatencyFit::Shared);
    measured.host_bw = Some(40e9);
    let measured = measured.refit().unwrap();
    let eff = |p: &Profile| p.kinds[&WorkKind::Transfer].eff_memory;
    assert!(eff(&spec) < 0.2, "{}", eff(&spec));
    assert!(eff(&measured) > 0.5, "{}", eff(&measured));
    for p in [&spec, &measured] {
        for r in p.residuals() {
            assert!(r.rel_err().abs() < 0.02, "{r:?}");
        }
    }
}
