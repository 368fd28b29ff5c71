use super::Held;
use rollplex_plan::plan::Plan;
use rollplex_plan::BufferRole;

fn plan(rel: &str) -> Plan {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(rel);
    let yaml = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    rollplex_plan::from_yaml(&yaml).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Each held state is retired after a task that uses one of its buffers, and no task
/// later in plan order (the walker's) uses any of them; the states the 3B plan ends
/// early are all there.
#[test]
fn held_state_retires_after_its_buffers_last_task() {
    for rel in [
        "examples/h200-3b-video.plan.yaml",
        "examples/tiny.plan.yaml",
        "tests/out/plans/no_dedup.yaml",
        "tests/out/plans/overlap_images_steps.yaml",
    ] {
        let p = plan(rel);
        let r = Held::retirements(&p);
        assert!(
            r.windows(2).all(|w| w[0].0 <= w[1].0),
            "{rel}: in task order"
        );
        for &(t, h) in &r {
            let bufs: Vec<_> = p
                .buffers
                .iter()
                .filter(|b| Held::of(b.role) == Some(h))
                .map(|b| b.id)
                .collect();
            let uses = |i: usize| {
                let task = &p.tasks[i];
                task.reads
                    .iter()
                    .chain(&task.writes)
                    .any(|b| bufs.contains(b))
            };
            assert!(
                uses(t.index()),
                "{rel}: {h:?} retires after {t}, which does not use it"
            );
            for i in t.index() + 1..p.tasks.len() {
                assert!(
                    !uses(i),
                    "{rel}: {h:?} retires after {t} but {} uses it",
                    p.tasks[i].name
                );
            }
        }
        if rel.contains("h200-3b") {
            let held: Vec<Held> = r.iter().map(|&(_, h)| h).collect();
            for h in [
                Held::DecodeKv,
                Held::Media,
                Held::RefPrefixes,
                Held::TrainPrefixes,
            ] {
                assert!(held.contains(&h), "{rel}: {h:?} is never retired: {r:?}");
            }
        }
    }
    assert_eq!(
        Held::of(BufferRole::TrainPrefix { step: 12 }),
        Some(Held::TrainPrefixes)
    );
    assert_eq!(Held::of(BufferRole::KeptChunk), None);
    assert_eq!(Held::of(BufferRole::TrainMediaEmbeddings), None);
}
