//! Weight sharing between the training and rollout TP layouts for the paper's model sizes.
//!
//! `cargo run -p rollplex-compiler --example sharing_table` prints, per (train TP, rollout TP),
//! the rollout layout's bytes per GPU, how much aliases training memory, the extra bytes and
//! what the weight sync rebuilds per iteration (vision tower and merger frozen, as in
//! `examples/paper-*.rpx`), under the rank order the compiler picks and under the identity order.
// `u32::is_multiple_of` is newer than the workspace's rust-version (1.85).
#![allow(clippy::manual_is_multiple_of)]
use rollplex_compiler::fixtures::{paper_job, QwenSize};
use rollplex_compiler::sharing::{
    analyse, identity_ranks, param_classes, report, shared_class_fraction, shared_fraction,
};

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

fn main() {
    println!("| model | train TP | rollout TP | rollout layout GiB/GPU | aliased | in wholly shared tensors | extra GiB/GPU | resharded GiB/iter | extra GiB, identity rank order |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for size in [QwenSize::B7, QwenSize::B32] {
        for (t, r) in [
            (1, 1),
            (2, 2),
            (4, 4),
            (4, 2),
            (2, 4),
            (2, 1),
            (4, 1),
            (8, 4),
            (4, 8),
        ] {
            let mut s = paper_job(size);
            if s.actor.text.num_heads % t.max(r) != 0 && t.max(r) > 4 {
                continue; // 28 query heads do not split over 8
            }
            s.train.tp = t;
            s.rollout.tp = r;
            s.train.freeze_vision = true;
            s.train.freeze_merger = true;
            let w = analyse(&s);
            let (it, ir) = identity_ranks(t, r);
            let id = report(&param_classes(&s), t, r, &it, &ir, s.actor.dtype.bytes());
            println!(
                "| {size:?} | {t} | {r} | {:.2} | {:.1}% | {:.1}% | {:.2} | {:.2} | {:.2} |",
                gib(w.rollout_bytes),
                100.0 * shared_fraction(&w),
                100.0 * shared_class_fraction(&w),
                gib(w.extra_bytes),
                gib(w.resharded_bytes),
                gib(id.extra_bytes),
            );
        }
    }
}
