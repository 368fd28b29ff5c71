//! The CUDA executor of the RL loop end to end (compile -> plan -> iterations on the GPU):
//! - serial and overlap plans of the same pipeline give bitwise-identical tokens, log-probs,
//!   rewards, losses and final weights on the GPU (the invariant `serial_overlap.rs` checks on
//!   the CPU backend);
//! - the first iteration on the GPU agrees with the CPU backend on the same plan (greedy
//!   sampling, since the device's sampler draws differently from the CPU's; bf16 vs f32);
//! - each decode window's reported steps, device time and bytes add up to the iteration's.
//!
//! Each test prints `skipped: ...` and passes where no CUDA GPU is present (CI); with
//! `ROLLPLEX_REQUIRE_GPU=1` that is a failure.

mod common;

use rollplex_plan::spec::Mode;
use rollplex_plan::Plan;
use rollplex_runtime::exec::{self, gpu, IterationResult};
use rollplex_runtime::gpu::arena::RegionUsage;

fn run_gpu(plan: &Plan, iterations: u32) -> (Vec<IterationResult>, gpu::WeightBits) {
    let (r, w, _) = run_gpu_in(plan, iterations, false);
    (r, w)
}

/// [`run_gpu`], with the models built for the plan when `placed` (its device arena allocated
/// once, every kept buffer at its plan offset); also each arena region's use.
fn run_gpu_in(
    plan: &Plan,
    iterations: u32,
    placed: bool,
) -> (Vec<IterationResult>, gpu::WeightBits, Vec<RegionUsage>) {
    let spec = &plan.spec;
    let mut models = if placed {
        let actor = exec::host_actor(spec).expect("actor");
        gpu::build_gpu_models_for(plan, &actor).expect("GPU models")
    } else {
        gpu::build_gpu_models(spec).expect("GPU models")
    };
    let mut source = exec::data_source(spec, &spec.rollout.dataset).expect("data");
    let mut reward = exec::reward_fn(spec).expect("reward");
    let mut results = Vec::new();
    gpu::run_gpu_iterations(
        plan,
        &mut models,
        source.as_mut(),
        reward.as_mut(),
        0,
        iterations,
        |it, r, wall| {
            println!(
                "iteration {it}: {:.1} ms, reward {:.3}, loss {:.5}, grad norm {:.4}",
                wall.as_secs_f64() * 1e3,
                r.reward_mean(),
                r.metrics.loss.loss,
                r.metrics.grad_norm
            );
            results.push(r.clone());
            Ok(())
        },
    )
    .expect("GPU run");
    let usage = models.arena.as_ref().map(|a| a.usage()).unwrap_or_default();
    (results, models.weight_bits().expect("weights"), usage)
}

#[test]
fn cuda_serial_and_overlap_plans_give_bitwise_identical_training() {
    serial_and_overlap_bitwise(&common::overlap_small_frozen());
}

/// The same with the vision tower and merger trained (the trainer encodes each prompt's media
/// itself and backpropagates into them).
#[test]
fn cuda_serial_and_overlap_plans_train_the_tower_bitwise_identically() {
    serial_and_overlap_bitwise(&common::overlap_small());
}

/// The loss variants keep the invariant on the GPU too: DAPO with dynamic sampling (8 groups
/// rolled out, 4 trained over two optimizer steps: an old-log-prob pass, truncated importance
/// sampling, training prefixes over training slots), overlong shaping, GSPO's sequence ratio
/// (the device loss's sequence pass), and REINFORCE++'s batch whitening under Dr. GRPO's
/// constant denominator.
#[test]
fn cuda_loss_variants_keep_serial_and_overlap_bitwise_identical() {
    for (algorithm, batches) in [
        (
            "dapo(overlong_buffer = 8, tis_cap = 2.0, kl_coef = 0.01)",
            "mini_batch = 2 * G\n        groups = 4",
        ),
        ("gspo(kl_coef = 0.01)", "mini_batch = PROMPTS * G"),
        (
            "reinforce_pp(loss_agg = seq_mean_token_sum_norm, kl_coef = 0.01)",
            "mini_batch = PROMPTS * G",
        ),
    ] {
        println!("{algorithm}");
        let src = common::with_algorithm(&common::overlap_small_frozen(), algorithm, batches, 8);
        serial_and_overlap_bitwise(&src);
    }
}

/// With one optimizer step the plan leaves the old-log-prob pass out and the device loss takes
/// the micro-batch's own log-probs as the old ones: the ratio is exactly 1 (nothing clipped,
/// `approx_kl` 0) and every trained sample's old log-probs are recorded. Forced beside the
/// first step's prompt forwards (`old_logprobs = recompute`), serial and overlap plans stay
/// bitwise identical.
#[test]
fn cuda_old_logprob_pass_left_out_or_forced() {
    let Some(_gpu) = common::gpu_device() else {
        return;
    };
    let src = common::overlap_small_frozen();
    let plan = common::compile_gpu("overlap_small.rpx", &src, Mode::Overlap);
    assert_eq!(
        plan.old_logprobs,
        rollplex_plan::OldLogProbSource::TrainForward
    );
    let (rs, _) = run_gpu(&plan, 2);
    for (i, r) in rs.iter().enumerate() {
        let l = &r.metrics.loss;
        assert_eq!(l.clip_frac, 0.0, "iteration {i}: ratio 1");
        assert_eq!(l.approx_kl, 0.0, "iteration {i}: ratio 1");
        let a = r.metrics.rollout_agreement.expect("agreement measured");
        assert_eq!(a.tokens as usize, r.response_tokens(), "iteration {i}");
        for (s, t) in r.tokens.iter().enumerate() {
            let old = r.old_logp[s].as_ref().expect("old log-probs recorded");
            assert_eq!(old.len(), t.len(), "iteration {i} sample {s}");
        }
    }
    let forced = common::with_old_logprob_pass(&src);
    let plan = common::compile_gpu("overlap_small.rpx", &forced, Mode::Overlap);
    assert_eq!(plan.old_logprobs, rollplex_plan::OldLogProbSource::Pass);
    drop(_gpu); // taken again by the check below
    serial_and_overlap_bitwise(&forced);
}

/// The rollout's prefill kept as the training prompt forwards (`train_prefix: rollout`, what a
/// frozen tower and one optimizer step give) and a training-prompt pass of their own
/// (`prompt_forward = recompute`) train bitwise alike: the same tokens, losses, gradients and
/// final weights, serial and overlap.
#[test]
fn cuda_prefill_kept_for_training_trains_as_its_own_pass() {
    let Some(_gpu) = common::gpu_device() else {
        return;
    };
    let src = common::overlap_small_frozen();
    let own = common::in_train(&src, "prompt_forward = recompute");
    for mode in [Mode::Serial, Mode::Overlap] {
        let kept = common::compile_gpu("overlap_small.rpx", &src, mode);
        let pass = common::compile_gpu("overlap_small.rpx", &own, mode);
        assert_eq!(kept.train_prefix, rollplex_plan::TrainPrefixSource::Rollout);
        assert_eq!(pass.train_prefix, rollplex_plan::TrainPrefixSource::Pass);
        let (ra, wa) = run_gpu(&kept, 2);
        let (rb, wb) = run_gpu(&pass, 2);
        assert_same_training(&ra, &rb, "prefill kept", "own pass");
        assert!(wa == wb, "{mode:?}: final weights differ");
    }
}

/// Each decode window reports its steps, device time and bytes: in step order they cover
/// every step the iteration took (and at most a few launched before the host learnt that every
/// sample had stopped) and add up to its decode totals; the device's longest wait for the host
/// between two steps lies inside the window.
#[test]
fn cuda_decode_windows_account_for_the_iterations_decode() {
    let Some(_gpu) = common::gpu_device() else {
        return;
    };
    let src = common::overlap_small_frozen();
    let plan = common::compile_gpu("overlap_small.rpx", &src, Mode::Overlap);
    let (rs, _) = run_gpu(&plan, 2);
    for (i, r) in rs.iter().enumerate() {
        let m = &r.metrics;
        assert!(
            m.decode_windows.len() > 1,
            "iteration {i}: the overlap plan's windows"
        );
        let mut next = 0;
        for w in &m.decode_windows {
            assert_eq!(w.first_step, next, "iteration {i}: windows in step order");
            next += w.steps;
            assert!(
                w.steps > 0 && w.device_s > 0.0 && w.bytes > 0.0,
                "iteration {i}: {w:?}"
            );
            assert!(
                w.max_gap_s >= 0.0 && w.max_gap_s < w.device_s,
                "iteration {i}: {w:?}"
            );
        }
        // every step the book took was launched in a window; a window may launch a few more,
        // until the host learns (LAG steps late, asynchronously) that every sample stopped
        let lag = rollplex_runtime::gpu::decode::LAG;
        assert!(
            m.decode_steps <= next && next <= m.decode_steps + 3 * lag,
            "iteration {i}: {next} steps launched in windows, {} taken",
            m.decode_steps
        );
        let s: f64 = m.decode_windows.iter().map(|w| w.device_s).sum();
        let b: f64 = m.decode_windows.iter().map(|w| w.bytes).sum();
        assert_eq!(s.to_bits(), m.decode_device_s.to_bits(), "iteration {i}");
        assert!(
            (b - m.decode_bytes).abs() <= 1e-9 * m.decode_bytes,
            "iteration {i}"
        );
        // the rows run hold every live sample, and a live sample draws one response token
        let tokens = r.response_tokens() as u64;
        assert!(
            m.decode_live_rows > 0 && m.decode_live_rows <= m.decode_rows,
            "iteration {i}: {} live rows of {}",
            m.decode_live_rows,
            m.decode_rows
        );
        assert!(m.decode_live_rows <= tokens, "iteration {i}");
    }
}

fn serial_and_overlap_bitwise(src: &str) {
    let Some(_gpu) = common::gpu_device() else {
        return;
    };
    let serial = common::compile_gpu("overlap_small.rpx", src, Mode::Serial);
    let overlap = common::compile_gpu("overlap_small.rpx", src, Mode::Overlap);
    let side_work = |p: &Plan| {
        p.tasks
            .iter()
            .filter(|t| {
                t.window.is_some() && !matches!(t.op, rollplex_plan::Op::DecodeWindow { .. })
            })
            .count()
    };
    assert_eq!(side_work(&serial), 0);
    assert!(
        side_work(&overlap) > 0,
        "the overlap plan should move side work into decode windows"
    );
    // both at their plans' arena offsets (what rollplex-run does), and serial again from the
    // memory pool: placement changes no number either
    let (ra, wa, ua) = run_gpu_in(&serial, 3, true);
    let (rb, wb, ub) = run_gpu_in(&overlap, 3, true);
    let pool = run_gpu(&serial, 3);
    for u in ua.iter().chain(&ub) {
        println!("{u:?}");
        assert_eq!(
            u.spills, 0,
            "{}: buffers did not fit the plan's ranges",
            u.name
        );
        assert!(u.peak > 0 && u.peak <= u.capacity, "{}: {u:?}", u.name);
    }
    assert!(ua.len() >= 6, "regions placed: {ua:?}");
    assert_eq!(pool.0.len(), ra.len());
    for (i, (x, y)) in ra.iter().zip(&pool.0).enumerate() {
        assert_eq!(
            x.tokens, y.tokens,
            "iteration {i}: placed and pooled tokens differ"
        );
        assert_eq!(
            x.metrics.loss.loss.to_bits(),
            y.metrics.loss.loss.to_bits(),
            "iteration {i}: placed and pooled losses differ"
        );
    }
    assert!(wa == pool.1, "placed and pooled final weights differ");
    assert_same_training(&ra, &rb, "serial", "overlap");
    assert!(wa == wb, "final weights differ");
    // the weights really moved, or the comparison above proves little
    let initial = gpu::build_gpu_models(&serial.spec)
        .and_then(|m| m.weight_bits())
        .expect("initial weights");
    assert!(initial != wa, "training changed the weights");
    // the vision tower's and merger's weights moved exactly when they train
    let t = &serial.spec.train;
    let frozen = t.freeze_vision && t.freeze_merger;
    let vision_moved = initial.vision != wa.vision;
    assert_eq!(
        vision_moved, !frozen,
        "vision weights moved: {vision_moved}"
    );
}

/// Both runs trained, and bit for bit alike in every iteration.
fn assert_same_training(a: &[IterationResult], b: &[IterationResult], na: &str, nb: &str) {
    assert!(
        a.iter().all(|r| r.metrics.optimizer_steps > 0),
        "{na}: every iteration trained"
    );
    common::assert_same_iterations(a, b, &format!("{na} vs {nb}"));
}

/// The plan's reloads run for real: with a device budget that leaves room only for the
/// reference weights from the first reference task on, the plan keeps them on the host (a
/// `Reload` before reference scoring; other buffers laid over their range outside it), and the
/// job trains bitwise as with everything in HBM, serial and overlap.
#[test]
fn cuda_reloaded_reference_trains_as_in_hbm() {
    let Some(_gpu) = common::gpu_device() else {
        return;
    };
    let hbm = common::overlap_small_frozen().replace("text_tokens = 256", "text_tokens = 16");
    let moved = common::reloaded_reference_small();
    let reloads = |p: &Plan| -> Vec<String> {
        p.tasks
            .iter()
            .filter(|t| matches!(t.op, rollplex_plan::Op::Reload { .. }))
            .map(|t| t.name.clone())
            .collect()
    };
    let in_hbm = common::compile_gpu("overlap_small.rpx", &hbm, Mode::Overlap);
    assert!(reloads(&in_hbm).is_empty(), "{:?}", reloads(&in_hbm));
    let (r0, w0, _) = run_gpu_in(&in_hbm, 3, true);
    for mode in [Mode::Serial, Mode::Overlap] {
        let plan = common::compile_gpu("overlap_small.rpx", &moved, mode);
        let r = reloads(&plan);
        assert!(
            r.iter().any(|n| n == "reload.ref_weights"),
            "{mode:?}: {r:?}"
        );
        let ref_buf = plan
            .buffers
            .iter()
            .find(|b| b.role == rollplex_plan::BufferRole::RefWeights)
            .expect("reference weights");
        // the range is given to other buffers outside the reference's lifetime (the kept
        // training prefixes), so each iteration's reload really restores it
        let shared = plan.buffers.iter().any(|b| {
            b.id != ref_buf.id
                && b.arena == ref_buf.arena
                && b.offset < ref_buf.offset + ref_buf.bytes
                && ref_buf.offset < b.offset + b.bytes
        });
        assert!(shared, "{mode:?}: no buffer reuses the reference's range");
        let (r, w, usage) = run_gpu_in(&plan, 3, true);
        for u in &usage {
            println!("{mode:?}: {u:?}");
        }
        // the reference lies in its range (what spills elsewhere comes from the pool)
        let reference = usage
            .iter()
            .find(|u| u.name == "RefWeights")
            .expect("the reference placed");
        assert!(
            reference.spills == 0 && reference.peak > 0,
            "{mode:?}: {reference:?}"
        );
        assert_same_training(&r0, &r, "in HBM", &format!("reloaded, {mode:?}"));
        assert!(w0 == w, "{mode:?}: final weights differ");
    }
}

/// The streamed optimizer step on the device: with `optimizer_state = stream` the masters and
/// moments live in pinned host memory and every step copies them through three staging chunks
/// on a copy stream, ordered by events against the update kernels; the job trains bitwise as
/// with the state in HBM, serial and overlap.
#[test]
fn cuda_streamed_optimizer_state_trains_as_in_hbm() {
    let Some(_gpu) = common::gpu_device() else {
        return;
    };
    let base = common::optimizer_state_small();
    let with = |choice: &str, mode: Mode| {
        let src = common::in_train(&base, &format!("optimizer_state = {choice}"));
        common::compile_gpu("overlap_small.rpx", &src, mode)
    };
    let in_hbm = with("hbm", Mode::Overlap);
    assert!(in_hbm.optimizer_stream.is_none());
    let (r0, w0, _) = run_gpu_in(&in_hbm, 3, true);
    for mode in [Mode::Serial, Mode::Overlap] {
        let plan = with("stream", mode);
        let st = plan.optimizer_stream.clone().expect("streamed");
        assert!(st.chunks >= 3, "{mode:?}: {st:?}");
        let (r, w, _) = run_gpu_in(&plan, 3, true);
        assert_same_training(&r0, &r, "in HBM", &format!("streamed, {mode:?}"));
        assert!(w0 == w, "{mode:?}: final weights differ");
    }
}

#[test]
fn cuda_first_iteration_agrees_with_the_cpu_backend() {
    let Some(_gpu) = common::gpu_device() else {
        return;
    };
    let src = common::overlap_small_frozen();
    let mut plan = common::compile_gpu("overlap_small.rpx", &src, Mode::Overlap);
    // greedy: the device's sampler and the CPU's draw different tokens from equal logits
    plan.spec.rollout.sampling.temperature = 0.0;
    let (gpu_run, _) = run_gpu(&plan, 1);
    let g = &gpu_run[0];
    let spec = &plan.spec;
    let mut models = [exec::build_cpu_models(spec).expect("CPU models")];
    let mut source = exec::data_source(spec, &spec.rollout.dataset).expect("data");
    let mut reward = exec::reward_fn(spec).expect("reward");
    let mut cpu_run = Vec::new();
    exec::run_cpu_iterations(
        &plan,
        &mut models,
        source.as_mut(),
        reward.as_mut(),
        0,
        1,
        |_, r, _| {
            cpu_run.push(r.clone());
            Ok(())
        },
    )
    .expect("CPU run");
    let c = &cpu_run[0];
    // Greedy tokens agree up to bf16 near-ties: compare each sample's tokens up to the first
    // difference (after it the two continuations condition on different text).
    let mut agreed = 0usize;
    let mut total = 0usize;
    let mut worst = [0f32; 3];
    for s in 0..c.tokens.len() {
        let n = c.tokens[s]
            .iter()
            .zip(&g.tokens[s])
            .take_while(|(a, b)| a == b)
            .count();
        agreed += n;
        total += c.tokens[s].len().max(g.tokens[s].len());
        let diff = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .take(n)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max)
        };
        worst[0] = worst[0].max(diff(&c.rollout_logp[s], &g.rollout_logp[s]));
        if let (Some(a), Some(b)) = (&c.ref_logp[s], &g.ref_logp[s]) {
            worst[1] = worst[1].max(diff(a, b));
        }
        if let (Some(a), Some(b)) = (&c.old_logp[s], &g.old_logp[s]) {
            worst[2] = worst[2].max(diff(a, b));
        }
    }
    let agree = agreed as f64 / total.max(1) as f64;
    println!(
        "CPU vs CUDA, iteration 0 (greedy): {:.3} of response tokens agree (up to each sample's first \
         difference); max |d logp| there: rollout {:.2e}, reference {:.2e}, old {:.2e}; reward mean {:.4} vs {:.4}",
        agree,
        worst[0],
        worst[1],
        worst[2],
        c.reward_mean(),
        g.reward_mean()
    );
    assert!(
        agree >= 0.5,
        "greedy tokens agree for only {agree:.3} of the responses"
    );
    // bf16 weights and activations vs f32: docs/gpu-model.md bounds the model's log-probs by
    // 2 x 3e-2 x max |logit|; the tiny model's logits are O(1)
    for (what, w) in ["rollout", "reference", "old"].iter().zip(worst) {
        assert!(
            w < 0.1,
            "{what} log-probs differ by {w} between CPU and CUDA"
        );
    }
}

/// examples/tiny-h200.rpx trains the tiny model on the GPU until its greedy answers to held-out
/// moving-shapes videos are right >= 90% of the time, within `TINY_H200_ITERS`
/// iterations (default 1000; the CPU backend's tiny job needs 350-400). The count depends on
/// the run's bits, as sampled RL does: on one H200 with the same seed, 400 iterations when the
/// weight gradients were rounded to bf16 before their fp32 sum, 950 since they are summed in
/// fp32 (held-out accuracy near 0.7 from iteration 350 to 800, then 0.92). Prints the curve: mean
/// sampled reward of the last 50 iterations, held-out and train-split greedy accuracy on 64
/// prompts each, median iteration time.
#[test]
fn cuda_tiny_h200_learns_the_moving_shapes_task() {
    use rollplex_runtime::exec::data;
    use rollplex_runtime::tasks::moving_shapes::Split;
    let Some(_gpu) = common::gpu_device() else {
        return;
    };
    let src = common::repo_file("examples/tiny-h200.rpx");
    let plan = common::compile_gpu("tiny-h200.rpx", &src, Mode::Overlap);
    let spec = &plan.spec;
    let iterations: u32 = std::env::var("TINY_H200_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let (every, eval) = (50u32, 64u32);
    let mut models = gpu::build_gpu_models(spec).expect("GPU models");
    let mut source = exec::data_source(spec, &spec.rollout.dataset).expect("data");
    let mut reward = exec::reward_fn(spec).expect("reward");
    println!("iteration\ttrain_reward\theldout_acc\ttrain_acc\titer_ms_median\ttrain_s");
    let (mut done, mut train_s, mut best) = (0u32, 0f64, 0f64);
    let (mut rewards, mut times): (Vec<f64>, Vec<f64>) = (Vec::new(), Vec::new());
    loop {
        let acc = |split| {
            data::evaluate_split_with(spec, split, eval, &mut |p, i, cfg| {
                gpu::generate_tokens(&models, p, i, cfg)
            })
            .expect("evaluation")
            .expect("moving shapes has a test split")
        };
        let (held, train) = (acc(Split::Test), acc(Split::Train));
        best = best.max(held);
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        times.sort_by(f64::total_cmp);
        println!(
            "{done}\t{:.4}\t{held:.4}\t{train:.4}\t{:.2}\t{train_s:.2}",
            mean(&rewards),
            times.get(times.len() / 2).copied().unwrap_or(f64::NAN)
        );
        if held >= 0.9 || done >= iterations {
            break;
        }
        rewards.clear();
        times.clear();
        let n = every.min(iterations - done);
        gpu::run_gpu_iterations(
            &plan,
            &mut models,
            source.as_mut(),
            reward.as_mut(),
            done,
            n,
            |_, r, wall| {
                rewards.push(r.reward_mean());
                times.push(wall.as_secs_f64() * 1e3);
                Ok(())
            },
        )
        .expect("GPU run");
        train_s += times.iter().sum::<f64>() / 1e3;
        done += n;
    }
    assert!(
        best >= 0.9,
        "held-out greedy accuracy reached only {best:.3} in {done} iterations"
    );
}

/// The CUDA runner's pick order (every ready non-blocking task before a blocking one,
/// `exec::gpu::blocks_host`) changes when tasks run, never what they compute: one iteration on
/// the CPU backend walked in plan order and in that order gives the same results bitwise, and
/// the orders really differ. Runs without a GPU.
#[test]
fn cuda_pick_order_changes_no_number() {
    use rollplex_runtime::exec::cpu::CpuIteration;
    use rollplex_runtime::exec::walker::{walk, TaskRunner};
    struct Ranked<'a, R>(&'a mut R, bool);
    impl<R: TaskRunner<Error = exec::ExecError>> TaskRunner for Ranked<'_, R> {
        type Error = exec::ExecError;
        fn run(&mut self, t: &rollplex_plan::plan::Task) -> Result<(), exec::ExecError> {
            self.0.run(t)
        }
        fn slots_bound(&self) -> u32 {
            self.0.slots_bound()
        }
        fn rank(&self, t: &rollplex_plan::plan::Task) -> u8 {
            u8::from(self.1 && gpu::blocks_host(&t.op))
        }
    }
    let plan = common::compile_gpu(
        "overlap_small.rpx",
        &common::overlap_small_frozen(),
        Mode::Overlap,
    );
    let spec = &plan.spec;
    let run = |ranked: bool| {
        let mut models = exec::build_cpu_models(spec).expect("CPU models");
        let mut source = exec::data_source(spec, &spec.rollout.dataset).expect("data");
        let mut reward = exec::reward_fn(spec).expect("reward");
        let prompts = source
            .prompts(0, plan.parallel.prompts_per_rollout_replica as usize)
            .expect("prompts");
        let mut engine = exec::cpu::RankEngine {
            models: &mut models,
            comm: &rollplex_runtime::tp::SoloComm,
        };
        let mut iter =
            CpuIteration::new(&plan, &mut engine, reward.as_mut(), 0, &prompts).expect("iteration");
        let mut order = Vec::new();
        walk(
            &plan,
            plan.gpus[0].id,
            &mut Ranked(&mut iter, ranked),
            |t, _| order.push(t),
        )
        .expect("walk");
        (iter.finish(), order)
    };
    let (a, order_a) = run(false);
    let (b, order_b) = run(true);
    assert_ne!(
        order_a, order_b,
        "the rank hook should reorder this plan's tasks"
    );
    assert!(a.metrics.optimizer_steps > 0);
    assert_eq!(a.tokens, b.tokens);
    assert_eq!(common::bits(&a.rollout_logp), common::bits(&b.rollout_logp));
    assert_eq!(common::obits(&a.ref_logp), common::obits(&b.ref_logp));
    assert_eq!(a.metrics.loss.loss.to_bits(), b.metrics.loss.loss.to_bits());
    assert_eq!(a.metrics.grad_norm.to_bits(), b.metrics.grad_norm.to_bits());
}

/// Memory of one loop goes with it: the pool holds the same bytes after the second and the
/// third loop over the same models (each loop makes its own streams, whose GEMM workspaces the
/// loop frees at its end: they had piled up, 32 MiB per stream and loop), and between loops the
/// trainer holds no gradient sums (they live from a mini-batch's first micro-batch to its
/// optimizer step), so a loop ends where it began once its lazily made state exists.
#[test]
fn cuda_loops_leave_the_pool_as_they_found_it() {
    let Some(_gpu) = common::gpu_device() else {
        return;
    };
    let plan = common::compile_gpu(
        "overlap_small.rpx",
        &common::overlap_small_frozen(),
        Mode::Overlap,
    );
    let spec = &plan.spec;
    let mut models = gpu::build_gpu_models(spec).expect("GPU models");
    let mut source = exec::data_source(spec, &spec.rollout.dataset).expect("data");
    let mut reward = exec::reward_fn(spec).expect("reward");
    let mut used = Vec::new();
    for first in 0..3 {
        gpu::run_gpu_iterations(
            &plan,
            &mut models,
            source.as_mut(),
            reward.as_mut(),
            first,
            1,
            |_, _, _| Ok(()),
        )
        .expect("GPU run");
        models.gpu.ctx().synchronize().expect("sync");
        used.push(models.gpu.pool_usage().expect("pool").0);
    }
    println!("pool in use after each loop: {used:?} bytes");
    assert_eq!(used[1], used[2], "a loop left memory behind: {used:?}");
}
