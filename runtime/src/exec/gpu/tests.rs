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

/// A plan whose pinned host copies and host model exceed the machine's available memory is
/// refused with both numbers and the `host_memory` that would fit; one under it passes.
#[test]
fn host_memory_beyond_the_machine_is_refused_before_the_build() {
    let p = plan("examples/h200-7b-video.plan.yaml");
    let pinned = p.memory.host_total();
    assert!(
        pinned > 10 << 30,
        "the 7B plan keeps its reference on the host"
    );
    let gib = 1u64 << 30;
    super::models::check_host_memory_against(&p, 400 * gib).expect("fits in 400 GiB");
    let e = super::models::check_host_memory_against(&p, 40 * gib)
        .expect_err("pinned reference + fp32 host actor exceed 40 GiB")
        .to_string();
    assert!(e.contains("this machine has 40.0 GiB available"), "{e}");
    assert!(e.contains("host_memory"), "{e}");
    assert!(
        e.contains(&format!("pins {:.1} GiB", pinned as f64 / gib as f64)),
        "{e}"
    );
}

#[test]
fn meminfo_available_is_read_in_bytes() {
    let text =
        "MemTotal:       131072000 kB\nMemFree:         1000 kB\nMemAvailable:   120000000 kB\n";
    assert_eq!(
        super::models::meminfo_available(text),
        Some(120_000_000 * 1024)
    );
    assert_eq!(super::models::meminfo_available("MemTotal: 5 kB\n"), None);
}
