//! What the end-to-end tests share: compiling a pipeline source into a plan, finding the
//! repository's pipelines, a scratch directory, a run's metrics without timings, the `BLESS=1`
//! rule of the golden harnesses and the GPU check of the GPU tests. Each test
//! binary includes this module (`mod common;`) and uses a part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use rollplex_plan::spec::{JobSpec, Mode};
use rollplex_plan::Plan;

/// The DSL's file access: the real filesystem.
pub struct Files;
impl rollplex_dsl::Env for Files {
    fn read_file(&self, path: &str) -> Result<String, String> {
        std::fs::read_to_string(path).map_err(|e| e.to_string())
    }
}

/// The checked job of pipeline source `src` (`name` in diagnostics); panics with the rendered
/// diagnostics when it does not check.
pub fn spec(name: &str, src: &str) -> JobSpec {
    rollplex_dsl::compile_source(name, src, &Files)
        .unwrap_or_else(|d| panic!("{}", d.render(name, src, false)))
        .spec
}

/// `spec` compiled with `opts`.
pub fn compile_spec(spec: &JobSpec, opts: &rollplex_compiler::Options) -> Plan {
    rollplex_compiler::compile(spec, opts)
        .expect("compiles")
        .plan
}

/// Pipeline source `src` compiled in `mode`.
pub fn compile(name: &str, src: &str, mode: Mode) -> Plan {
    let opts = rollplex_compiler::Options {
        mode: Some(mode),
        ..Default::default()
    };
    compile_spec(&spec(name, src), &opts)
}

/// [`compile`] for the GPU this machine has: the tests' pipelines name an H200 (`gpu { preset =
/// H200 }`); on another GPU with a preset (an H100) they are compiled for that one, so the GPU
/// tests run there too. Without a GPU: as written.
#[allow(dead_code)] // only the GPU test binaries use it
pub fn compile_gpu(name: &str, src: &str, mode: Mode) -> Plan {
    static PRESET: std::sync::OnceLock<Option<&'static str>> = std::sync::OnceLock::new();
    let preset = PRESET.get_or_init(|| {
        let gpu = rollplex_kernels::cuda::Gpu::new(0).ok()?;
        rollplex_runtime::exec::gpu::preset_of(gpu.name())
    });
    match preset {
        Some(p) if *p != "H200" => {
            assert!(
                src.contains("preset = H200"),
                "{name}: no H200 gpu preset to retarget"
            );
            compile(
                name,
                &src.replace("preset = H200", &format!("preset = {p}")),
                mode,
            )
        }
        _ => compile(name, src, mode),
    }
}

/// The text of `rel` (a path from the repository root, e.g. `examples/tiny.rpx`): found from
/// this crate's manifest dir, else from the working directory (the GPU test binaries run from a
/// copy of the tree on another machine).
pub fn repo_file(rel: &str) -> String {
    let path = [
        Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel),
        PathBuf::from(rel),
    ]
    .into_iter()
    .find(|p| p.exists())
    .unwrap_or_else(|| panic!("{rel} not found"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// tests/in/e2e/overlap_small.rpx (the tiny model with prompts large enough that the overlap
/// plan moves side work into decode windows).
pub fn overlap_small() -> String {
    repo_file("tests/in/e2e/overlap_small.rpx")
}

/// [`overlap_small`] with the vision tower and merger frozen, as the GPU trainer requires.
pub fn overlap_small_frozen() -> String {
    let src = overlap_small();
    let anchor = "mini_batch = PROMPTS * G   // the whole iteration: one optimizer step";
    assert!(
        src.contains(anchor),
        "overlap_small.rpx changed: update tests/tests/common"
    );
    src.replace(
        anchor,
        &format!("{anchor}\n        freeze = [vision, merger]"),
    )
}

/// [`overlap_small_frozen`] with 16 text tokens a prompt, every layer's activations kept and a
/// device budget of 6,600 KiB (1 GiB of host memory): the plan then keeps the reference weights
/// on the host, reloads them before reference scoring, and lays the kept training prefixes over
/// their range.
#[allow(dead_code)] // not every test binary uses it
pub fn reloaded_reference_small() -> String {
    // every layer's activations kept: under `auto` the planner would rather recompute layers
    // than move the reference
    let src = in_train(
        &overlap_small_frozen().replace("text_tokens = 256", "text_tokens = 16"),
        "recompute = none",
    );
    let moved = src.replace(
        "decode_window = 4",
        "decode_window = 4\n        memory = 6600KiB\n        host_memory = 1GiB",
    );
    assert_ne!(
        moved, src,
        "overlap_small.rpx changed: update tests/tests/common"
    );
    moved
}

/// `src` (overlap_small.rpx or a variant) with 1 GiB of host memory: room for the optimizer
/// state on the host (`optimizer_state = host | stream`).
#[allow(dead_code)] // not every test binary uses it
pub fn with_host_memory(src: &str) -> String {
    let s = src.replace(
        "decode_window = 4",
        "decode_window = 4\n        host_memory = 1GiB",
    );
    assert_ne!(
        s, src,
        "overlap_small.rpx changed: update tests/tests/common"
    );
    s
}

/// [`overlap_small_frozen`] with 16 text tokens a prompt and 1 GiB of host memory: the small
/// job the optimizer-state choices (`train { optimizer_state }`) are compared on.
#[allow(dead_code)] // not every test binary uses it
pub fn optimizer_state_small() -> String {
    with_host_memory(&overlap_small_frozen().replace("text_tokens = 256", "text_tokens = 16"))
}

/// `src` with `old_logprobs = recompute` in its `train` section: the old-log-prob pass
/// forced where one optimizer step would leave it out.
pub fn with_old_logprob_pass(src: &str) -> String {
    in_train(src, "old_logprobs = recompute")
}

/// `src` with `line` first in its `train` section.
pub fn in_train(src: &str, line: &str) -> String {
    let head = "    train {";
    let at = src.find(head).expect("a `train {` section") + head.len();
    format!("{}\n        {line}{}", &src[..at], &src[at..])
}

/// A scratch directory under the system temp dir, removed when dropped.
pub struct Scratch(PathBuf);
impl Scratch {
    pub fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("rollplex-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Scratch(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}
impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Whether a golden harness rewrites its expected files instead of comparing: `BLESS=1` (unset
/// or any other value compares). The one rule of every golden harness here.
pub fn bless() -> bool {
    std::env::var("BLESS").is_ok_and(|v| v == "1")
}

/// The GPU, held by one test at a time: `None` (after printing why) when no CUDA GPU opens
/// here: GPU tests then pass as skipped (CI has no GPU), unless `ROLLPLEX_REQUIRE_GPU=1` makes
/// that a failure ([`rollplex_kernels::cuda::test_gpu`], the rule of every GPU test). The tests
/// of a binary run on threads of one process, sharing the device's memory pool and SMs: a test
/// that measures the pool or partitions the SMs must not see another's work, so each holds the
/// guard while it uses the GPU (taking it twice on one thread deadlocks).
#[allow(dead_code)] // not every test binary has GPU tests
pub fn gpu_device() -> Option<std::sync::MutexGuard<'static, ()>> {
    static GPU: std::sync::Mutex<()> = std::sync::Mutex::new(());
    rollplex_kernels::cuda::test_gpu()?;
    Some(GPU.lock().unwrap_or_else(|e| e.into_inner()))
}

/// A run's metrics.jsonl without its measurements (`metrics::is_measurement`): what two runs
/// of the same plan and seed must agree on.
/// A `rollplex-run` of `plan` on `backend` for `iterations`, writing to `out`: quiet, a
/// checkpoint every iteration (the newest 2 kept), nothing else asked for. Tests change what
/// they need with `RunArgs { .., ..run_args(..) }`.
#[allow(dead_code)] // not every test binary runs the CLI
pub fn run_args(
    plan: &Path,
    backend: rollplex_runtime::cli::BackendChoice,
    out: &Path,
    iterations: u32,
) -> rollplex_runtime::cli::RunArgs {
    rollplex_runtime::cli::RunArgs {
        plan: plan.to_path_buf(),
        backend,
        iterations,
        out: out.to_path_buf(),
        trace: None,
        svg: None,
        cost_profile: None,
        profile: None,
        save_every: 1,
        keep_checkpoints: 2,
        resume: None,
        eval: 0,
        eval_every: 0,
        eval_data: None,
        quiet: true,
        task_log: false,
        no_green_contexts: false,
        eager_decode: false,
    }
}

pub fn metrics_without_times(out: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap_or_else(|e| panic!("{}: {e}", out.join("metrics.jsonl").display()))
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            v.as_object_mut()
                .unwrap()
                .retain(|k, _| !rollplex_runtime::metrics::is_measurement(k));
            v
        })
        .collect()
}

/// `src`, a pipeline whose `train` section has an `algorithm = grpo { ... }` block and a
/// `mini_batch = ...` line (`examples/tiny.rpx`, [`overlap_small`]), with that block replaced
/// by `algorithm` and that line by `batches`; `prompts` replaces the value of its
/// `const PROMPTS`.
pub fn with_algorithm(src: &str, algorithm: &str, batches: &str, prompts: u32) -> String {
    let start = src
        .find("algorithm = grpo {")
        .expect("an `algorithm = grpo { ... }` block");
    let end = start + src[start..].find('}').expect("the block's `}`") + 1;
    let mut out = format!("{}algorithm = {algorithm}{}", &src[..start], &src[end..]);
    let line = out.find("mini_batch =").expect("a `mini_batch = ...` line");
    let eol = line + out[line..].find('\n').expect("a line end");
    out.replace_range(line..eol, batches);
    let c = out.find("const PROMPTS = ").expect("a `const PROMPTS`") + "const PROMPTS = ".len();
    let n = c + out[c..]
        .find(|ch: char| !ch.is_ascii_digit())
        .expect("a number");
    out.replace_range(c..n, &prompts.to_string());
    out
}

/// Runs `iterations` RL iterations of `plan` on the CPU backend from its initial models: every
/// result and the final actor weights' bits.
#[allow(dead_code)] // not every test binary runs the CPU loop
pub fn run_cpu(
    plan: &Plan,
    iterations: u32,
) -> Result<
    (Vec<rollplex_runtime::exec::IterationResult>, Vec<u32>),
    rollplex_runtime::exec::ExecError,
> {
    use rollplex_runtime::exec;
    let spec = &plan.spec;
    let mut models = [exec::build_cpu_models(spec).expect("models")];
    let mut source = exec::data_source(spec, &spec.rollout.dataset).expect("data");
    let mut reward = exec::reward_fn(spec).expect("reward");
    let mut results = Vec::new();
    exec::run_cpu_iterations(
        plan,
        &mut models,
        source.as_mut(),
        reward.as_mut(),
        0,
        iterations,
        |_, r, _| {
            results.push(r.clone());
            Ok(())
        },
    )?;
    let bits = models[0]
        .actor()
        .weights
        .data
        .iter()
        .map(|x| x.to_bits())
        .collect();
    Ok((results, bits))
}

/// The bits of each sample's log-probs (so NaN and -0.0 compare as bits).
pub fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|r| r.iter().map(|f| f.to_bits()).collect())
        .collect()
}

/// [`bits`] of log-probs a sample may lack.
pub fn obits(v: &[Option<Vec<f32>>]) -> Vec<Option<Vec<u32>>> {
    v.iter()
        .map(|r| r.as_ref().map(|r| r.iter().map(|f| f.to_bits()).collect()))
        .collect()
}

/// Everything two runs produced in each iteration, bit for bit: sampled tokens, rollout,
/// reference and old log-probs, rewards, advantages, the loss and its parts, entropy, grad
/// norm and the rollout/trainer agreement. `what` names the comparison in a failure.
pub fn assert_same_iterations(
    a: &[rollplex_runtime::exec::IterationResult],
    b: &[rollplex_runtime::exec::IterationResult],
    what: &str,
) {
    assert_eq!(a.len(), b.len(), "{what}: iterations");
    let fb = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let at = format!("{what}: iteration {i}");
        assert_eq!(x.tokens, y.tokens, "{at}: sampled tokens");
        assert_eq!(
            bits(&x.rollout_logp),
            bits(&y.rollout_logp),
            "{at}: rollout log-probs"
        );
        assert_eq!(
            obits(&x.ref_logp),
            obits(&y.ref_logp),
            "{at}: reference log-probs"
        );
        assert_eq!(
            obits(&x.old_logp),
            obits(&y.old_logp),
            "{at}: old log-probs"
        );
        assert_eq!(fb(&x.rewards), fb(&y.rewards), "{at}: rewards");
        assert_eq!(fb(&x.advantages), fb(&y.advantages), "{at}: advantages");
        let (l, m) = (&x.metrics.loss, &y.metrics.loss);
        for (name, p, q) in [
            ("loss", l.loss, m.loss),
            ("pg_loss", l.pg_loss, m.pg_loss),
            ("kl", l.kl, m.kl),
            ("clip_frac", l.clip_frac, m.clip_frac),
            ("approx_kl", l.approx_kl, m.approx_kl),
            ("grad norm", x.metrics.grad_norm, y.metrics.grad_norm),
        ] {
            assert_eq!(p.to_bits(), q.to_bits(), "{at}: {name} {p} against {q}");
        }
        assert_eq!(
            l.entropy.map(f64::to_bits),
            m.entropy.map(f64::to_bits),
            "{at}: entropy"
        );
        assert_eq!(
            x.metrics.rollout_agreement, y.metrics.rollout_agreement,
            "{at}: rollout/trainer agreement"
        );
    }
}
