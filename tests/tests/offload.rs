//! Plans that keep loop-carried state on the host between its uses, on the CPU backend: the
//! small job whose device budget makes the plan keep the reference weights on the host trains
//! bitwise as the same job with everything in HBM, serial and overlap; and a plan that reads
//! the reference while it is on the host is refused, naming the task and the buffer (the check
//! both backends make as they follow the plan's reloads and offloads, `exec::residency`). The
//! CUDA side, where the data really moves: `gpu_loop.rs`, `gpu_resume.rs`.

mod common;

use rollplex_plan::spec::Mode;
use rollplex_plan::{Op, Plan};
use rollplex_runtime::exec::IterationResult;

/// Tokens, reference log-probs, loss and grad norm of one iteration, as bits.
type IterationBits = (Vec<Vec<u32>>, Vec<Option<Vec<u32>>>, u64, u64);

/// The bits a run's results are compared by: tokens, reference log-probs, losses, grad norms.
fn bits(rs: &[IterationResult]) -> Vec<IterationBits> {
    rs.iter()
        .map(|r| {
            (
                r.tokens.clone(),
                r.ref_logp
                    .iter()
                    .map(|v| v.as_ref().map(|v| v.iter().map(|f| f.to_bits()).collect()))
                    .collect(),
                r.metrics.loss.loss.to_bits(),
                r.metrics.grad_norm.to_bits(),
            )
        })
        .collect()
}

fn reloads(plan: &Plan) -> Vec<&str> {
    plan.tasks
        .iter()
        .filter(|t| matches!(t.op, Op::Reload { .. }))
        .map(|t| t.name.as_str())
        .collect()
}

#[test]
fn a_reloaded_reference_trains_as_in_hbm() {
    let hbm = common::overlap_small_frozen().replace("text_tokens = 256", "text_tokens = 16");
    let in_hbm = common::compile("overlap_small.rpx", &hbm, Mode::Overlap);
    assert!(reloads(&in_hbm).is_empty());
    let (r, w) = common::run_cpu(&in_hbm, 2).expect("in HBM");
    let want = (bits(&r), w);
    assert!(
        want.0.iter().all(|w| w.1.iter().any(Option::is_some)),
        "reference scored"
    );
    for mode in [Mode::Serial, Mode::Overlap] {
        let plan = common::compile(
            "overlap_small.rpx",
            &common::reloaded_reference_small(),
            mode,
        );
        let r = reloads(&plan);
        assert!(r.contains(&"reload.ref_weights"), "{mode:?}: {r:?}");
        let (r, w) = common::run_cpu(&plan, 2).expect("reloaded");
        assert!(
            bits(&r) == want.0,
            "{mode:?}: the run differs from the in-HBM plan's"
        );
        assert!(w == want.1, "{mode:?}: final weights differ");
    }
}

#[test]
fn reading_the_reference_while_it_is_on_the_host_is_refused() {
    let mut plan = common::compile(
        "overlap_small.rpx",
        &common::reloaded_reference_small(),
        Mode::Serial,
    );
    // the reload now fills its own host copy: the device copy is never brought back
    let reload = plan
        .tasks
        .iter_mut()
        .find(|t| matches!(t.op, Op::Reload { .. }))
        .expect("a reload");
    if let Op::Reload { from, to } = &mut reload.op {
        *to = *from;
    }
    assert!(
        plan.buffers.iter().any(|b| b.name == "ref_weights"),
        "the reference's device buffer"
    );
    let e = match common::run_cpu(&plan, 1) {
        Ok(_) => panic!("ran while the reference was on the host"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("ref_prefix") && e.contains("ref_weights") && e.contains("on the host"),
        "{e}"
    );
}

/// The optimizer-state choices of `train { optimizer_state }` on the small job (every layer's
/// activations kept, 16 text tokens a prompt, 1 GiB of host memory): in HBM, on the host reloaded whole, and
/// streamed through the device in chunks. The three train to bitwise the same results and
/// weights over two iterations, serial and overlap; the streamed plan has no whole reload or
/// write-back of the state, its `master_weights` / `adam_moments` are only the staging slots,
/// and its training phase holds less of the state than the in-HBM plan's.
#[test]
fn a_streamed_optimizer_state_trains_as_in_hbm() {
    let base = common::in_train(&common::optimizer_state_small(), "recompute = none");
    let with = |choice: &str, mode: Mode| {
        let src = common::in_train(&base, &format!("optimizer_state = {choice}"));
        common::compile("overlap_small.rpx", &src, mode)
    };
    let moved = |plan: &Plan| -> Vec<String> {
        plan.tasks
            .iter()
            .filter(|t| matches!(t.op, Op::Reload { .. } | Op::Offload { .. }))
            .filter(|t| t.name.contains("master") || t.name.contains("adam"))
            .map(|t| t.name.clone())
            .collect()
    };
    let staging = |plan: &Plan, name: &str| {
        plan.buffers
            .iter()
            .find(|b| b.name == name)
            .map(|b| b.bytes)
            .unwrap()
    };
    let in_hbm = with("hbm", Mode::Serial);
    assert!(in_hbm.optimizer_stream.is_none() && moved(&in_hbm).is_empty());
    let (r, w) = common::run_cpu(&in_hbm, 2).expect("in HBM");
    let want = (bits(&r), w);
    for mode in [Mode::Serial, Mode::Overlap] {
        let host = with("host", mode);
        assert!(host.optimizer_stream.is_none());
        assert_eq!(moved(&host).len(), 4, "{mode:?}: {:?}", moved(&host));
        let streamed = with("stream", mode);
        let st = streamed
            .optimizer_stream
            .clone()
            .unwrap_or_else(|| panic!("{mode:?}: not streamed"));
        assert!(moved(&streamed).is_empty(), "{mode:?}");
        assert!(st.chunks >= 3 && st.slots == 3, "{mode:?}: {st:?}");
        assert_eq!(staging(&streamed, "master_weights"), st.master_bytes());
        assert_eq!(staging(&streamed, "adam_moments"), st.moment_bytes());
        assert!(
            st.moment_bytes() < staging(&in_hbm, "adam_moments"),
            "{mode:?}: staging is a part of the state"
        );
        for (what, plan) in [("whole reload", &host), ("streamed", &streamed)] {
            let (r, w) = common::run_cpu(plan, 2).expect(what);
            assert!(
                bits(&r) == want.0,
                "{mode:?}, {what}: the run differs from the in-HBM plan's"
            );
            assert!(w == want.1, "{mode:?}, {what}: final weights differ");
        }
    }
}
