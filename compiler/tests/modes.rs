//! Every mode compiles the fixture jobs into plans that pass validation.
use rollplex_compiler::fixtures::{job, paper_job, QwenSize};
use rollplex_compiler::{compile, Options};
use rollplex_plan::spec::Mode;

fn summary(name: &str, spec: &rollplex_plan::spec::JobSpec, mode: Mode) -> rollplex_plan::Plan {
    let c = compile(
        spec,
        &Options {
            mode: Some(mode),
            ..Options::default()
        },
    )
    .unwrap_or_else(|e| panic!("{name} {mode:?}: {e}"));
    let p = &c.plan;
    eprintln!(
        "{name} {mode:?}: {} tasks, {} buffers, iter {:.3} s, hidden {:.3} s, peak {:.2} GiB, ilp {:?}",
        p.tasks.len(),
        p.buffers.len(),
        p.predicted.iteration_s,
        p.predicted.hidden_s,
        p.memory.gpus.iter().map(|g| g.peak).max().unwrap_or(0) as f64 / (1u64 << 30) as f64,
        c.stats.ilp.iter().map(|r| (r.variables, r.constraints, r.solve_s)).collect::<Vec<_>>()
    );
    c.plan
}

#[test]
fn h200_3b_overlap_is_no_slower_than_serial() {
    let spec = job(|_| {});
    let s = summary("3b", &spec, Mode::Serial);
    let o = summary("3b", &spec, Mode::Overlap);
    assert!(o.predicted.iteration_s <= s.predicted.iteration_s + 1e-9);
    assert!(
        o.predicted.hidden_s > 0.0,
        "some side work moves into decode windows"
    );
}

/// The paper's qualitative result, from our cost model: overlap beats serial colocation, and
/// both beat disaggregated rollout/training (whose GPUs idle half the iteration).
#[test]
fn paper_settings_rank_the_modes() {
    for size in [QwenSize::B7, QwenSize::B32] {
        let spec = paper_job(size);
        let s = summary(&format!("{size:?}"), &spec, Mode::Serial);
        let o = summary(&format!("{size:?}"), &spec, Mode::Overlap);
        let d = summary(&format!("{size:?}"), &spec, Mode::Disaggregated);
        assert!(
            o.predicted.iteration_s < s.predicted.iteration_s,
            "{size:?}: overlap {} vs serial {}",
            o.predicted.iteration_s,
            s.predicted.iteration_s
        );
        assert!(
            s.predicted.iteration_s < d.predicted.iteration_s,
            "{size:?}: serial {} vs disaggregated {}",
            s.predicted.iteration_s,
            d.predicted.iteration_s
        );
        assert_eq!(d.gpus.len(), 2);
        assert!(o.windows.iter().any(|w| w.side_sms > 0));
        assert!(s.windows.iter().all(|w| w.side_sms == 0));
    }
}

/// Without prefix dedup a frozen tower's embeddings are still the rollout's: every reference
/// and actor prefix task reads them, so it must happen after the encode task of its prompts
/// (before, no-dedup plans lacked that edge and the executor had to add a wait of its own).
#[test]
fn prefix_tasks_wait_for_the_encoding_they_read() {
    use rollplex_plan::validate::HappensBefore;
    use rollplex_plan::{BufferClass, Op};
    for dedup in [true, false] {
        for mode in [Mode::Serial, Mode::Overlap] {
            let spec = job(|s| {
                s.schedule.prefix_dedup = dedup;
                s.train.freeze_vision = true;
                s.train.freeze_merger = true;
            });
            let p = summary(&format!("dedup {dedup}"), &spec, mode);
            let hb = HappensBefore::new(&p);
            let emb = p
                .buffers
                .iter()
                .find(|b| b.class == BufferClass::VisionEmbeddings)
                .expect("a video job has an embedding buffer")
                .id;
            let encodes: Vec<_> = p
                .tasks
                .iter()
                .filter(|t| matches!(t.op, Op::EncodeMedia { .. }))
                .collect();
            let mut readers = 0;
            for t in &p.tasks {
                let groups = match &t.op {
                    Op::RefPrefix { groups, .. } => *groups,
                    Op::ActorPrefix { groups, .. } => groups.span(),
                    _ => continue,
                };
                readers += 1;
                assert!(
                    t.reads.contains(&emb),
                    "{} does not read the embeddings",
                    t.name
                );
                for g in groups.start..groups.end {
                    assert!(
                        encodes
                            .iter()
                            .any(|e| matches!(e.op, Op::EncodeMedia { groups: eg, .. }
                            if eg.start <= g && g < eg.end)
                                && hb.strictly_before(e.id, t.id)),
                        "dedup {dedup} {mode:?}: {} may run before group {g} is encoded",
                        t.name
                    );
                }
            }
            assert!(readers > 0);
        }
    }
}

/// The serial plan of the fixture job with prefix dedup on or off and the vision tower and
/// merger trained or frozen.
fn tower_plan(dedup: bool, train_tower: bool) -> rollplex_plan::Plan {
    let spec = job(|s| {
        s.schedule.prefix_dedup = dedup;
        s.train.freeze_vision = !train_tower;
        s.train.freeze_merger = !train_tower;
    });
    summary(
        &format!("dedup {dedup} tower {train_tower}"),
        &spec,
        Mode::Serial,
    )
}

/// The trainers run the vision tower's backward once per group whatever its copies (the
/// copies' encodings are the same bits): what training the tower adds to a micro-batch is the
/// same with and without prefix dedup.
#[test]
fn the_towers_backward_is_counted_once_per_group() {
    use rollplex_plan::Op;
    let mb_flops = |dedup: bool, train_tower: bool| -> Vec<f64> {
        tower_plan(dedup, train_tower)
            .tasks
            .iter()
            .filter(|t| matches!(t.op, Op::TrainMicroBatch { .. }))
            .map(|t| t.work.total_flops())
            .collect()
    };
    let added = |dedup: bool| -> Vec<f64> {
        let (on, off) = (mb_flops(dedup, true), mb_flops(dedup, false));
        assert_eq!(on.len(), off.len());
        on.iter().zip(&off).map(|(a, b)| a - b).collect()
    };
    let (with, without) = (added(true), added(false));
    assert!(
        with.iter().any(|&f| f > 0.0),
        "training the tower adds work"
    );
    assert_eq!(with.len(), without.len());
    for (a, b) in with.iter().zip(&without) {
        assert!((a - b).abs() <= 1e-9 * a.abs().max(1.0), "{a} vs {b}");
    }
}

/// With the tower trained, a prefix that encodes its media itself and a micro-batch that
/// trains the tower hold the tower's work as a part of kind `vision_encode` (priced at the
/// tower's rate): the reference encodes every copy, the training prefix a group's media once
/// (what both runtimes do), and the micro-batch's part is three forwards of one encoding per
/// group; a frozen tower leaves no part anywhere.
#[test]
fn the_towers_work_is_a_part_at_its_own_rate() {
    use rollplex_plan::work::WorkKind;
    use rollplex_plan::Op;
    let parts = |dedup: bool, train_tower: bool| {
        let p = tower_plan(dedup, train_tower);
        let part = |pick: &dyn Fn(&Op) -> bool| -> Vec<f64> {
            p.tasks
                .iter()
                .filter(|t| pick(&t.op))
                .map(|t| {
                    assert!(t
                        .work
                        .parts
                        .iter()
                        .all(|q| q.kind == WorkKind::VisionEncode));
                    t.work.parts.iter().map(|q| q.work.flops).sum()
                })
                .collect()
        };
        let encode: f64 = p
            .tasks
            .iter()
            .filter(|t| matches!(t.op, Op::EncodeMedia { .. }))
            .map(|t| t.work.flops)
            .sum();
        (
            part(&|op| matches!(op, Op::RefPrefix { .. })),
            part(&|op| matches!(op, Op::ActorPrefix { .. })),
            part(&|op| matches!(op, Op::TrainMicroBatch { .. })),
            encode,
        )
    };
    let copies = job(|_| {}).rollout.group_size as f64;
    let (ref_on, train_on, mb_on, enc_on) = parts(true, true);
    let (ref_off, train_off, mb_off, enc_off) = parts(false, true);
    let sum = |v: &[f64]| v.iter().sum::<f64>();
    // dedup on: one encoding per group everywhere, the rollout's as much as each prefix's
    assert!(sum(&ref_on) > 0.0);
    assert!((sum(&ref_on) / enc_on - 1.0).abs() < 1e-9);
    assert!((sum(&train_on) / enc_on - 1.0).abs() < 1e-9);
    assert!((sum(&mb_on) / (3.0 * enc_on) - 1.0).abs() < 1e-9);
    // dedup off: the rollout and the reference encode every copy, the trainer once per group
    assert!((enc_off / enc_on - copies).abs() < 1e-9);
    assert!((sum(&ref_off) / enc_on - copies).abs() < 1e-9);
    assert!((sum(&train_off) / enc_on - 1.0).abs() < 1e-9);
    assert!((sum(&mb_off) / (3.0 * enc_on) - 1.0).abs() < 1e-9);
    let (r, t, m, _) = parts(true, false);
    assert_eq!(
        sum(&r) + sum(&t) + sum(&m),
        0.0,
        "a frozen tower holds no parts"
    );
}

/// With the tower trained, each training prefix keeps its group's vision inputs for the
/// tower's backward (pixel rows, every block's input, the merger's input: what the CUDA
/// trainer's `VisionTrainState` holds), with only the merger trained the merger's input alone,
/// once per group with or without dedup; the plan's `train_prefix` buffer counts them
/// (measured on the H200 before they were: the pool peaked 3.2-3.6 GiB above the 16-prompt
/// plans' arenas).
#[test]
fn a_trained_towers_kept_inputs_are_in_the_train_prefix_buffer() {
    use rollplex_compiler::shapes::Shapes;
    let bytes = |dedup: bool, vision: bool, merger: bool| -> u64 {
        let spec = job(|s| {
            s.schedule.prefix_dedup = dedup;
            s.train.freeze_vision = !vision;
            s.train.freeze_merger = !merger;
        });
        summary("kept", &spec, Mode::Serial)
            .buffers
            .iter()
            .find(|b| b.role == rollplex_plan::BufferRole::TrainPrefix { step: 0 })
            .expect("a single-step job keeps its training prefixes")
            .bytes
    };
    let spec = job(|_| {});
    let sh = Shapes::new(&spec);
    let v = &spec.actor.vision;
    let patch_in = v.patch_dim();
    let vh = v.hidden_size as u64;
    let patches = sh.media_items as u64 * sh.patches_per_item * sh.dtype_bytes;
    let groups = spec.rollout.prompts_per_iter as u64;
    assert!(patches > 0);
    // each kept tensor (pixel rows, block inputs, merger input) placed 256-byte aligned
    let align = |tensors: u64| groups * sh.media_items as u64 * tensors * 256;
    for dedup in [true, false] {
        let frozen = bytes(dedup, false, false);
        assert_eq!(
            bytes(dedup, true, true) - frozen,
            groups * patches * (patch_in + (v.depth as u64 + 1) * vh) + align(v.depth as u64 + 2),
            "dedup {dedup}, tower and merger trained"
        );
        assert_eq!(
            bytes(dedup, false, true) - frozen,
            groups * patches * vh + align(1),
            "dedup {dedup}, merger trained"
        );
    }
}
