//! Simulator tests on small hand-built plans.

use rollplex_cost::defaults::datasheet;
use rollplex_cost::{corun_pair_time, CostModel};
use rollplex_plan::spec::*;
use rollplex_plan::work::{Work, WorkKind};
use rollplex_plan::*;

use super::*;

fn spec() -> JobSpec {
    JobSpec {
        name: "sim-test".into(),
        seed: 1,
        cluster: ClusterSpec {
            gpu: datasheet("H200").unwrap(),
            count: 1,
            gpus_per_node: 1,
            intra_node_bw: 450e9,
            inter_node_bw: 50e9,
        },
        actor: ModelSpec {
            name: "tiny".into(),
            vision: VisionDims {
                depth: 2,
                hidden_size: 32,
                num_heads: 2,
                intermediate_size: 64,
                patch_size: 14,
                temporal_patch_size: 2,
                spatial_merge_size: 2,
                window_size: 112,
                fullatt_block_indexes: vec![1],
                in_channels: 3,
                out_hidden_size: 64,
            },
            text: TextDims {
                num_layers: 2,
                hidden_size: 64,
                num_heads: 4,
                num_kv_heads: 2,
                intermediate_size: 128,
                vocab_size: 1024,
                rope_theta: 1e6,
                mrope_section: [2, 3, 3],
                tie_word_embeddings: true,
                rms_norm_eps: 1e-6,
                max_position_embeddings: 4096,
            },
            tokens: SpecialTokens {
                image_token_id: 1000,
                video_token_id: 1001,
                vision_start_token_id: 1002,
                vision_end_token_id: 1003,
                eos_token_ids: vec![1004],
            },
            dtype: DType::Bf16,
            weights: WeightsSource::Random { seed: 1 },
        },
        reference: ReferenceSpec { enabled: true },
        rollout: RolloutSpec {
            tp: 1,
            prompts_per_iter: 2,
            group_size: 2,
            media: MediaSpec::None,
            prompt_text_tokens: 16,
            max_new_tokens: 8,
            response_len: LengthDist::Fixed { tokens: 8 },
            sampling: SamplingSpec {
                temperature: 1.0,
                top_p: 1.0,
                top_k: 0,
                stop_token_ids: vec![],
                forced_lengths: true,
            },
            dataset: DatasetSpec::Synthetic,
        },
        reward: RewardSpec::Builtin {
            name: "exact_match".into(),
            tolerance: 0.0,
        },
        train: TrainSpec {
            tp: 1,
            algorithm: Algorithm::Grpo(PolicyLoss {
                clip_low: 0.2,
                clip_high: 0.2,
                kl_coef: 0.01,
                kl_estimator: KlEstimator::K3,
                loss_agg: LossAgg::TokenMean,
                norm_adv_by_std: true,
                advantage: AdvantageEstimator::Group,
                ratio: RatioLevel::Token,
                tis_cap: None,
                overlong: None,
            }),
            optimizer: AdamWSpec {
                lr: 1e-6,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.0,
                grad_clip: 1.0,
                lr_schedule: LrSchedule::Constant,
            },
            micro_batch: 4,
            mini_batch: 4,
            epochs: 1,
            freeze_vision: true,
            freeze_merger: false,
            recompute: Recompute::None,
            optimizer_state: rollplex_plan::spec::OptimizerState::Auto,
            groups: None,
            old_logprobs: OldLogProbPass::Auto,
            prompt_forward: PromptForwardPass::Auto,
        },
        schedule: ScheduleSpec {
            mode: Mode::Overlap,
            prefix_dedup: true,
            decode_window: 8,
            memory_budget: 141_000_000_000,
            host_memory: 1 << 40,
        },
    }
}

fn work(flops: f64, bytes: f64, steps: u32) -> Work {
    Work {
        flops,
        bytes,
        steps,
        ..Work::default()
    }
}

const PREFILL: (f64, f64, u32) = (100e12, 20e9, 28);
const DECODE: (f64, f64, u32) = (80e12, 1600e9, 2800);
const PREFIX: (f64, f64, u32) = (200e12, 40e9, 56);

/// A one-GPU plan: prefill; a decode window (48/84) with the reference prefix beside it;
/// reference suffix, reward, a micro-batch and the optimizer step after it. `split == None`
/// puts everything on the main stream with the whole GPU (a serial plan).
fn plan(split: Option<(u32, u32)>) -> Plan {
    let g = GpuId(0);
    let (side, win) = match split {
        Some(_) => (StreamId(1), Some(WindowId(0))),
        None => (StreamId(0), None),
    };
    let mut tasks = Vec::new();
    let mut add = |name: &str,
                   kind: WorkKind,
                   op: Op,
                   stream: StreamId,
                   window: Option<WindowId>,
                   deps: Vec<u32>,
                   w: Work| {
        let id = TaskId::from_index(tasks.len());
        tasks.push(Task {
            id,
            name: name.into(),
            kind,
            op,
            gpu: g,
            stream,
            window,
            deps: deps.into_iter().map(TaskId).collect(),
            reads: vec![],
            writes: vec![],
            work: w,
            sms: 132,
            start_s: 0.0,
            end_s: 0.0,
        });
    };
    let s0 = StreamId(0);
    add(
        "prefill",
        WorkKind::Prefill,
        Op::Prefill {
            groups: Span::new(0, 2),
            copies: 1,
        },
        s0,
        None,
        vec![],
        work(PREFILL.0, PREFILL.1, PREFILL.2),
    );
    add(
        "decode.w0",
        WorkKind::Decode,
        Op::DecodeWindow {
            first_step: 0,
            steps: 100,
            until_done: true,
        },
        s0,
        win,
        vec![0],
        work(DECODE.0, DECODE.1, DECODE.2),
    );
    add(
        "ref_prefix",
        WorkKind::RefPrefix,
        Op::RefPrefix {
            groups: Span::new(0, 2),
            copies: 1,
        },
        side,
        win,
        vec![0],
        work(PREFIX.0, PREFIX.1, PREFIX.2),
    );
    add(
        "ref_suffix.s0",
        WorkKind::RefSuffix,
        Op::RefSuffix { slot: 0 },
        s0,
        None,
        vec![1, 2],
        work(20e12, 5e9, 28),
    );
    add(
        "reward.s0",
        WorkKind::Reward,
        Op::Reward { slot: 0 },
        s0,
        None,
        vec![1],
        Work {
            steps: 1,
            ..Work::default()
        },
    );
    add(
        "train.mb0",
        WorkKind::ActorBwd,
        Op::TrainMicroBatch {
            step: 0,
            micro_batch: 0,
            samples: Span::new(0, 4),
            prefix_bwd_slots: Span::new(0, 2),
        },
        s0,
        None,
        vec![3, 4],
        work(60e12, 30e9, 56),
    );
    add(
        "optimizer.0",
        WorkKind::Optimizer,
        Op::OptimizerStep { step: 0 },
        s0,
        None,
        vec![5],
        work(1e11, 120e9, 1),
    );
    let mut streams = vec![Stream {
        id: s0,
        gpu: g,
        name: "main".into(),
        priority: Priority::High,
        sms: 132,
    }];
    let mut windows = vec![];
    if let Some((d, s)) = split {
        streams.push(Stream {
            id: StreamId(1),
            gpu: g,
            name: "side".into(),
            priority: Priority::Normal,
            sms: 132,
        });
        windows.push(Window {
            id: WindowId(0),
            gpu: g,
            first_step: 0,
            steps: 100,
            decode_stream: s0,
            side_stream: StreamId(1),
            decode_sms: d,
            side_sms: s,
            expected_active: 4.0,
            expected_groups_done: 0,
            start_s: 0.0,
            end_s: 0.0,
        });
    }
    let buffer = |id: u32, name: &str, role: BufferRole, bytes: u64, lifetime: Lifetime| Buffer {
        id: BufferId(id),
        name: name.into(),
        role,
        class: role.class().unwrap_or(BufferClass::Activations),
        gpu: g,
        bytes,
        shape: String::new(),
        lifetime,
        residency: vec![],
        arena: ArenaId(0),
        offset: 0,
    };
    let buffers = vec![
        buffer(
            0,
            "weights",
            BufferRole::ActorWeights,
            16 << 30,
            Lifetime::Persistent,
        ),
        buffer(
            1,
            "kv.prefix",
            BufferRole::KvPrompt,
            8 << 30,
            Lifetime::Tasks {
                first: TaskId(2),
                last: TaskId(3),
            },
        ),
        buffer(
            2,
            "acts",
            BufferRole::TrainPrefix { step: 0 },
            4 << 30,
            Lifetime::Tasks {
                first: TaskId(5),
                last: TaskId(5),
            },
        ),
    ];
    Plan {
        target: Target {
            gpu: "H200".into(),
            count: 1,
            hbm_bytes: 141_000_000_000,
            sms: 132,
            sm_granularity: 8,
        },
        mode: if split.is_some() {
            Mode::Overlap
        } else {
            Mode::Serial
        },
        parallel: Parallelism {
            rollout_tp: 1,
            train_tp: 1,
            rollout_replicas: 1,
            train_replicas: 1,
            prompts_per_rollout_replica: 2,
            prompts_per_train_replica: 2,
            trained_groups_per_train_replica: 2,
            group_size: 2,
        },
        old_logprobs: OldLogProbSource::TrainForward,
        train_prefix: TrainPrefixSource::Pass,
        kept_act_layers: spec().actor.text.num_layers,
        kept_prompt_layers: spec().actor.text.num_layers,
        predicted: Predicted {
            iteration_s: 0.0,
            phases: vec![],
            hidden_s: 0.0,
        },
        solver: SolverStats {
            solver: "none".into(),
            status: SolveStatus::NotRun,
            variables: 0,
            integer_variables: 0,
            constraints: 0,
            objective: 0.0,
        },
        gpus: vec![Gpu {
            id: g,
            role: GpuRole::Colocated,
            first_rank: 0,
            ranks: 1,
        }],
        streams,
        windows,
        tasks,
        buffers,
        reshards: vec![],
        weight_sharing: None,
        optimizer_stream: None,
        memory: Memory {
            arenas: vec![Arena {
                id: ArenaId(0),
                gpu: g,
                kind: ArenaKind::Device,
                bytes: 28 << 30,
            }],
            gpus: vec![GpuMemory {
                gpu: g,
                budget: 141_000_000_000,
                peak: 28 << 30,
                live_peak: 28 << 30,
                live_peak_at: TaskId(3),
                host: 0,
            }],
        },
        spec: spec(),
    }
}

fn model() -> CostModel {
    CostModel::new(&datasheet("H200").unwrap(), None)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1e-9)
}

#[test]
fn serial_plan_takes_the_sum_of_times_alone() {
    let m = model();
    let r = simulate(&plan(None), &m).unwrap();
    let sum: f64 = plan(None)
        .tasks
        .iter()
        .map(|t| m.time(t.kind, &t.work, 132))
        .sum();
    assert!(close(r.iteration_s, sum), "{} vs {sum}", r.iteration_s);
    for w in r.tasks.windows(2) {
        assert!(
            close(w[1].start_s, w[0].end_s),
            "{} starts before {} ends",
            w[1].name,
            w[0].name
        );
    }
}

#[test]
fn window_split_and_corun_follow_the_cost_model() {
    let m = model();
    let p = plan(Some((48, 84)));
    let r = simulate(&p, &m).unwrap();
    let t = |name: &str| r.tasks.iter().find(|t| t.name == name).unwrap();
    let prefill = m.time(WorkKind::Prefill, &p.tasks[0].work, 132);
    assert!(close(t("prefill").end_s, prefill));
    // decode and the reference prefix start together after prefill, on 48 and 84 SMs
    assert!(close(t("decode.w0").start_s, prefill) && close(t("ref_prefix").start_s, prefill));
    let (d, s) = (
        m.time(WorkKind::Decode, &p.tasks[1].work, 48),
        m.time(WorkKind::RefPrefix, &p.tasks[2].work, 84),
    );
    let both = corun_pair_time(
        d,
        s,
        m.corun_slowdown(WorkKind::Decode, WorkKind::RefPrefix),
        m.corun_slowdown(WorkKind::RefPrefix, WorkKind::Decode),
    );
    let window_end = t("decode.w0").end_s.max(t("ref_prefix").end_s);
    assert!(
        close(window_end - prefill, both),
        "{} vs {both}",
        window_end - prefill
    );
    assert!(
        (t("decode.w0").avg_sms - 48.0).abs() < 1e-9
            && (t("ref_prefix").avg_sms - 84.0).abs() < 1e-9
    );
    assert!(t("decode.w0").avg_slowdown > 1.0);
    // the suffix waits for both; reward (host) runs beside nothing and costs its steps only
    assert!(close(t("ref_suffix.s0").start_s, window_end));
    assert_eq!(r.windows.len(), 1);
    assert!(r.windows[0].side_busy_s > 0.0);
    // phases: rollout covers the window, training ends the iteration
    let phase = |ph: Phase| r.phases.iter().find(|p| p.phase == ph).unwrap().clone();
    assert!(close(phase(Phase::Rollout).end_s, window_end));
    assert!(close(phase(Phase::Training).end_s, r.iteration_s));
    assert_eq!(t("ref_prefix").phase, Phase::Rollout);
}

/// The H200 profile (the default curves bend at half the SMs, too early for 48 decode SMs).
fn h200() -> CostModel {
    let p = rollplex_cost::Profile::from_yaml(include_str!("../../../cost/profiles/h200.yaml"))
        .unwrap();
    CostModel::new(&p.gpu, Some(&p))
}

#[test]
fn a_good_split_beats_serial_and_a_bad_one_loses() {
    let m = h200();
    let serial = simulate(&plan(None), &m).unwrap().iteration_s;
    let good = simulate(&plan(Some((48, 84))), &m).unwrap().iteration_s;
    let bad = simulate(&plan(Some((8, 124))), &m).unwrap().iteration_s;
    assert!(
        good < serial && bad > good,
        "serial {serial} good {good} bad {bad}"
    );
}

#[test]
fn unpartitioned_streams_share_the_gpu() {
    let m = model();
    let mut p = plan(Some((48, 84)));
    // drop the window: decode and the prefix both ask for the whole GPU
    p.windows.clear();
    for t in p.tasks.iter_mut() {
        t.window = None;
    }
    let r = simulate(&p, &m).unwrap();
    let t = |name: &str| r.tasks.iter().find(|t| t.name == name).unwrap().clone();
    assert!(
        (t("ref_prefix").avg_sms - 66.0).abs() < 1.0,
        "{}",
        t("ref_prefix").avg_sms
    );
    assert!(r.devices[0].samples.iter().all(|s| s.sms <= 132.0 + 1e-9));
}

#[test]
fn hbm_live_follows_buffer_lifetimes() {
    let r = simulate(&plan(Some((48, 84))), &model()).unwrap();
    let d = &r.devices[0];
    assert_eq!(d.hbm_peak, (16u64 + 8) << 30);
    assert_eq!(d.hbm_live.first().map(|x| x.1), Some(16 << 30));
    assert_eq!(d.planned_peak, 28 << 30);
}

#[test]
fn a_cycle_is_reported_with_task_names() {
    let mut p = plan(None);
    p.tasks[0].deps.push(TaskId(3));
    let e = simulate(&p, &model()).unwrap_err();
    assert!(
        matches!(e, SimError::Stuck(_)) && e.to_string().contains("task0 (prefill)"),
        "{e}"
    );
    let mut p = plan(None);
    p.tasks[2].deps.push(TaskId(99));
    assert!(matches!(
        simulate(&p, &model()),
        Err(SimError::Malformed(_))
    ));
    let mut p = plan(Some((48, 84)));
    p.tasks[1].window = Some(WindowId(7));
    assert!(simulate(&p, &model())
        .unwrap_err()
        .to_string()
        .contains("win7"));
}

#[test]
fn trace_has_a_track_per_stream_and_an_event_per_task() {
    let r = simulate(&plan(Some((48, 84))), &model()).unwrap();
    let mut buf = Vec::new();
    r.write_chrome_trace(&mut buf).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&buf).unwrap();
    let ev = v["traceEvents"].as_array().unwrap();
    let xs: Vec<_> = ev.iter().filter(|e| e["ph"] == "X").collect();
    assert_eq!(xs.len(), r.tasks.len());
    let threads = ev.iter().filter(|e| e["name"] == "thread_name").count();
    assert_eq!(threads, r.streams.len());
    let dec = xs.iter().find(|e| e["name"] == "decode.w0").unwrap();
    assert_eq!(dec["tid"], 0);
    assert_eq!(dec["pid"], 0);
    assert!((dec["dur"].as_f64().unwrap() - r.tasks[1].duration_s() * 1e6).abs() < 1e-2);
    assert!(ev
        .iter()
        .any(|e| e["ph"] == "C" && e["name"] == "SMs allocated"));
}

/// The SVG timeline and the summary name every task. `ROLLPLEX_SIM_OUT=dir`, a switch of this
/// test only, keeps its outputs for a look (`rsvg-convert dir/sim.svg -o sim.png`).
#[test]
fn svg_and_summary_show_every_task() {
    let r = simulate(&plan(Some((48, 84))), &h200()).unwrap();
    let svg = r.svg();
    if let Some(dir) = std::env::var_os("ROLLPLEX_SIM_OUT") {
        let dir = std::path::PathBuf::from(dir);
        std::fs::write(dir.join("sim.svg"), &svg).unwrap();
        let mut f = std::fs::File::create(dir.join("sim.trace.json")).unwrap();
        r.write_chrome_trace(&mut f).unwrap();
    }
    assert!(svg.starts_with("<?xml") && svg.trim_end().ends_with("</svg>"));
    for t in &r.tasks {
        assert!(
            svg.contains(&format!("<title>{} (", t.name)),
            "{} missing",
            t.name
        );
    }
    assert!(svg.contains("48/84"));
    assert_eq!(svg.matches("<svg").count(), 1);
    let mut out = Vec::new();
    r.print_summary(&mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(text.contains("predicted iteration time"), "{text}");
    assert!(
        text.contains("RefPrefix")
            && text.contains("SMs alloc")
            && text.contains("decode windows: 1"),
        "{text}"
    );
}

#[test]
fn network_bytes_use_the_plans_link_unless_the_model_has_one() {
    let mut p = plan(None);
    p.tasks[6].work.net_bytes = 450e9; // one second on the spec's 450 GB/s intra-node link
    let m = model();
    let base = simulate(&plan(None), &m).unwrap().iteration_s;
    let r = simulate(&p, &m).unwrap();
    assert!(close(r.iteration_s - base, 1.0), "{}", r.iteration_s - base);
    let slow = model().with_net_bw(45e9);
    let r = simulate(&p, &slow).unwrap();
    assert!(
        close(r.iteration_s - base, 10.0),
        "{}",
        r.iteration_s - base
    );
}

#[test]
fn a_cost_model_for_another_gpu_is_flagged() {
    let m = CostModel::new(&datasheet("H800").unwrap(), None);
    let r = simulate(&plan(None), &m).unwrap();
    assert!(
        r.warnings.iter().any(|w| w.contains("H800")),
        "{:?}",
        r.warnings
    );
}

mod engine_props {
    use super::super::engine::{run, DeviceIn, Input, TaskIn};
    use super::*;
    use proptest::prelude::*;

    const KINDS: [WorkKind; 5] = [
        WorkKind::Decode,
        WorkKind::Prefill,
        WorkKind::RefPrefix,
        WorkKind::Reward,
        WorkKind::Transfer,
    ];

    fn input() -> impl Strategy<Value = Input> {
        (1usize..3, 1usize..5, 1usize..25).prop_flat_map(|(devices, streams, n)| {
            let stream_dev = proptest::collection::vec(0..devices, streams);
            let tasks = proptest::collection::vec(
                (
                    0..streams,
                    proptest::collection::vec(any::<prop::sample::Index>(), 0..3),
                    0..KINDS.len(),
                    (0.0..1e14f64, 0.0..1e11f64, 0u32..1000),
                    1u32..=132,
                ),
                n,
            );
            (Just(devices), stream_dev, tasks).prop_map(|(devices, stream_dev, tasks)| {
                let tasks = tasks
                    .into_iter()
                    .enumerate()
                    .map(
                        |(i, (stream, deps, k, (flops, bytes, steps), sms))| TaskIn {
                            stream,
                            device: stream_dev[stream],
                            // only earlier tasks: acyclic, and never behind on the same stream
                            deps: if i == 0 {
                                vec![]
                            } else {
                                deps.iter().map(|d| d.index(i)).collect()
                            },
                            kind: KINDS[k],
                            work: work(flops, bytes, steps),
                            host_dir: Default::default(),
                            sms,
                            uses_sms: !matches!(KINDS[k], WorkKind::Reward | WorkKind::Transfer),
                        },
                    )
                    .collect();
                Input {
                    devices: vec![DeviceIn { sms: 132 }; devices],
                    streams: stream_dev,
                    tasks,
                }
            })
        })
    }

    proptest! {
        #[test]
        fn order_dependencies_and_durations_hold(inp in input()) {
            let m = model();
            let out = run(&inp, &m).unwrap();
            let eps = 1e-9;
            let mut last_end = vec![0.0f64; inp.streams.len()];
            for (i, t) in inp.tasks.iter().enumerate() {
                let o = out.tasks[i];
                prop_assert!(o.start_s <= o.end_s);
                prop_assert!(o.start_s + eps >= last_end[t.stream], "task {i} overtakes its stream");
                last_end[t.stream] = o.end_s;
                for &d in &t.deps {
                    prop_assert!(o.start_s + eps >= out.tasks[d].end_s, "task {i} starts before dep {d}");
                }
                // contention and shared SMs only ever slow a task down
                prop_assert!(o.end_s - o.start_s + eps * o.alone_s.max(1.0) >= o.alone_s, "task {i} ran faster than alone");
                prop_assert!(o.avg_slowdown >= 1.0 - eps);
            }
            let makespan = out.tasks.iter().map(|o| o.end_s).fold(0.0, f64::max);
            prop_assert!((out.makespan_s - makespan).abs() <= eps);
            for (d, series) in out.samples.iter().enumerate() {
                prop_assert!(series.iter().all(|s| s.sms <= inp.devices[d].sms as f64 + eps));
                prop_assert!(series.windows(2).all(|w| w[0].t_s <= w[1].t_s));
            }
        }
    }
}
