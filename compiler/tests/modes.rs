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
fn h200_3b_all_modes() {
    let spec = job(|_| {});
    let s = summary("3b", &spec, Mode::Serial);
    let o = summary("3b", &spec, Mode::Overlap);
    assert!(o.predicted.iteration_s <= s.predicted.iteration_s + 1e-9);
}

#[test]
fn paper_all_modes() {
    for size in [QwenSize::B7, QwenSize::B32] {
        let spec = paper_job(size);
        for mode in [Mode::Serial, Mode::Overlap, Mode::Disaggregated] {
            summary(&format!("{size:?}"), &spec, mode);
        }
    }
}

#[test]
#[ignore]
fn debug_b7_overlap() {
    let which = std::env::var("WHICH").unwrap_or("B7".into());
    let spec = match which.as_str() {
        "3b" => job(|_| {}),
        "B32" => paper_job(QwenSize::B32),
        _ => paper_job(QwenSize::B7),
    };
    let mode = if std::env::var_os("SERIAL").is_some() {
        Mode::Serial
    } else {
        Mode::Overlap
    };
    let p = summary(&which, &spec, mode);
    eprintln!("solver {:?}", p.solver);
    for w in &p.windows {
        eprintln!(
            "win{} steps {}+{} sms {}/{} {:.3}..{:.3} active {:.1} done {}",
            w.id.0,
            w.first_step,
            w.steps,
            w.decode_sms,
            w.side_sms,
            w.start_s,
            w.end_s,
            w.expected_active,
            w.expected_groups_done
        );
        for t in p.tasks.iter().filter(|t| t.window == Some(w.id)) {
            eprintln!(
                "    {:<28} {:?} {:.3}..{:.3} ({:.3})",
                t.name,
                t.kind,
                t.start_s,
                t.end_s,
                t.end_s - t.start_s
            );
        }
    }
    for t in p.tasks.iter().filter(|t| t.window.is_none()) {
        eprintln!(
            "  {:<28} {} {:.3}..{:.3} ({:.3})",
            t.name,
            p.streams[t.stream.index()].name,
            t.start_s,
            t.end_s,
            t.end_s - t.start_s
        );
    }
    eprintln!("phases {:?}", p.predicted.phases);
}
