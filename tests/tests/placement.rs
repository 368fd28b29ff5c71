//! Which plan buffers the CUDA executor places at the plan's offsets (`exec::placement`), on the
//! shipped pipelines the CUDA backend runs and the GPU tests' pipelines: every kept buffer of a
//! one-step frozen-tower plan is placed, the decode KV arena's two buffers touch (the runtime's
//! keys and values each span both), and what is left to the pool says why. The placement on
//! the device is tested by `gpu_loop.rs` (no allocation spills, bitwise equal to the pool).

mod common;

use rollplex_plan::spec::Mode;
use rollplex_plan::Plan;
use rollplex_runtime::exec::placement::{layout, Layout, Role};

fn layout_of(plan: &Plan) -> Layout {
    layout(plan, plan.gpus[0].id)
}

fn check_decode_kv(name: &str, l: &Layout) {
    let kv = &l.regions[&Role::DecodeKv];
    let (mut r, mut end) = (kv.clone(), 0);
    r.sort_unstable();
    for (o, b) in r {
        assert!(
            end == 0 || o == end,
            "{name}: kv.prompt and kv.response apart: {kv:?}"
        );
        end = o + b;
    }
}

#[test]
fn the_3b_video_plans_place_every_kept_buffer() {
    let src = common::repo_file("examples/h200-3b-video.rpx");
    for mode in [Mode::Serial, Mode::Overlap] {
        let plan = common::compile("h200-3b-video.rpx", &src, mode);
        let l = layout_of(&plan);
        assert!(l.unplaced.is_empty(), "{mode:?}: {:?}", l.unplaced);
        let roles: Vec<Role> = l.regions.keys().copied().collect();
        assert_eq!(
            roles,
            vec![
                Role::ActorWeights,
                Role::RefWeights,
                Role::Masters,
                Role::Moments,
                Role::Grads(0),
                Role::Media,
                Role::DecodeKv,
                Role::RefPrefixes,
                Role::TrainPrefixes,
            ],
            "{mode:?}"
        );
        check_decode_kv(&format!("{mode:?}"), &l);
        // inside the arena
        for (role, ranges) in &l.regions {
            for (o, b) in ranges {
                assert!(o + b <= l.arena_bytes, "{role:?} past the arena");
            }
        }
    }
}

/// With the tower trained, an old-log-prob prefix (plans of several optimizer steps) reuses the
/// rollout's embeddings outside their plan lifetime: those plans leave them to the pool, and so
/// do several-step plans their kept prompt forwards (one store for every step's groups).
#[test]
fn what_a_plan_reads_outside_its_lifetimes_stays_in_the_pool() {
    let one_step = "mini_batch = PROMPTS * G   // the whole iteration: one optimizer step";
    for (name, src) in [
        ("overlap_small", common::overlap_small()),
        ("overlap_small_frozen", common::overlap_small_frozen()),
    ] {
        for steps in [1, 2] {
            let src = if steps == 1 {
                src.clone()
            } else {
                assert!(src.contains(one_step), "overlap_small.rpx changed");
                src.replace(one_step, "mini_batch = PROMPTS * G / 2")
            };
            for mode in [Mode::Serial, Mode::Overlap] {
                let plan = common::compile("overlap_small.rpx", &src, mode);
                let l = layout_of(&plan);
                let t = &plan.spec.train;
                let frozen = t.freeze_vision && t.freeze_merger;
                let what = format!("{name}, {steps} steps, {mode:?}");
                let mut expect = Vec::new();
                if !frozen && steps > 1 {
                    expect.push("vision_emb");
                }
                if steps > 1 {
                    expect.extend(["train_prefix.s0", "train_prefix.s1"]);
                }
                let unplaced: Vec<&str> = l.unplaced.iter().map(|(n, _)| n.as_str()).collect();
                assert_eq!(unplaced, expect, "{what}");
                assert_eq!(
                    l.regions.contains_key(&Role::OldPrefixes),
                    steps > 1,
                    "{what}"
                );
                check_decode_kv(&what, &l);
            }
        }
    }
}

/// The shipped pipelines whose plans the CUDA backend runs declare prompts as long as their
/// datasets' (a longer prompt than the plan counts does not fit its buffers: the executor takes
/// it from the pool and warns).
#[test]
fn shipped_pipelines_declare_their_datasets_prompt_lengths() {
    for file in ["examples/tiny-h200.rpx", "examples/tiny.rpx"] {
        let plan = common::compile(file, &common::repo_file(file), Mode::Overlap);
        let spec = &plan.spec;
        let declared = rollplex_compiler::shapes::Shapes::new(spec).prompt_tokens as usize;
        let mut source =
            rollplex_runtime::exec::data_source(spec, &spec.rollout.dataset).expect("data");
        let longest = (0..64)
            .flat_map(|it| source.prompts(it, 8).expect("prompts"))
            .map(|p| p.ids.len())
            .max()
            .unwrap();
        assert!(
            longest <= declared,
            "{file}: prompts of {longest} tokens, the plan counts {declared}"
        );
    }
}
