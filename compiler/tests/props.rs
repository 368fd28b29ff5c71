//! Property tests over generated pipelines: every job either compiles into a plan that passes
//! the verifier or is refused with a user error (never an internal error, never a panic), and
//! the serial and overlap plans of one job compute the same batches (bitwise identity between
//! modes depends on it) with the overlap plan predicted no slower.
use proptest::prelude::*;
use rollplex_compiler::fixtures::{gpu, job, qwen_model, QwenSize};
use rollplex_compiler::{compile, CompileError, Options};
use rollplex_plan::spec::*;
use rollplex_plan::{validate, Op, Plan};

#[derive(Debug, Clone)]
struct Gen {
    size: QwenSize,
    layers: u32,
    count: u32,
    rtp: u32,
    ttp: u32,
    prompts_per_replica: u32,
    group: u32,
    media: u8,
    max_new: u32,
    dist: u8,
    micro_div: u32,
    steps: u32,
    epochs: u32,
    dedup: bool,
    reference: bool,
    recompute: u8,
    freeze: u8,
    window: u32,
}

fn gen() -> impl Strategy<Value = Gen> {
    (
        (
            prop_oneof![Just(QwenSize::Tiny), Just(QwenSize::B3), Just(QwenSize::B7)],
            1u32..5,
            prop_oneof![Just(1u32), Just(2), Just(4)],
            0u32..3,
            0u32..3,
        ),
        (
            1u32..5,
            2u32..9,
            0u8..3,
            prop_oneof![Just(4u32), Just(32), Just(200)],
            0u8..3,
        ),
        (
            prop_oneof![Just(1u32), Just(2)],
            prop_oneof![Just(1u32), Just(2)],
            1u32..3,
            any::<bool>(),
            any::<bool>(),
            0u8..3,
            0u8..3,
            prop_oneof![Just(1u32), Just(4), Just(16), Just(64)],
        ),
    )
        .prop_map(
            |(
                (size, layers, count, rtp, ttp),
                (ppr, group, media, max_new, dist),
                (micro_div, steps, epochs, dedup, reference, recompute, freeze, window),
            )| Gen {
                size,
                layers,
                count,
                rtp: 1 << rtp,
                ttp: 1 << ttp,
                prompts_per_replica: ppr,
                group,
                media,
                max_new,
                dist,
                micro_div,
                steps,
                epochs,
                dedup,
                reference,
                recompute,
                freeze,
                window,
            },
        )
}

fn spec_of(g: &Gen) -> JobSpec {
    job(|s| {
        let mut m = qwen_model(g.size);
        m.text.num_layers = g.layers.min(m.text.num_layers);
        s.actor = m;
        s.cluster.gpu = gpu("H200");
        s.cluster.count = g.count;
        s.rollout.tp = g.rtp.min(g.count);
        s.train.tp = g.ttp.min(g.count);
        let replicas = g.count / s.rollout.tp.min(s.train.tp);
        s.rollout.prompts_per_iter = g.prompts_per_replica * replicas;
        s.rollout.group_size = g.group;
        s.rollout.media = match g.media {
            0 => MediaSpec::None,
            1 => MediaSpec::Image {
                count: 2,
                height: 112,
                width: 84,
            },
            _ => MediaSpec::Video {
                frames: 4,
                height: 112,
                width: 112,
            },
        };
        s.rollout.max_new_tokens = g.max_new;
        s.rollout.response_len = match g.dist {
            0 => LengthDist::Fixed {
                tokens: g.max_new / 2 + 1,
            },
            1 => LengthDist::Uniform {
                min: 1,
                max: g.max_new,
            },
            _ => LengthDist::LogNormal {
                median: g.max_new as f64 / 3.0,
                sigma: 0.7,
            },
        };
        let samples = s.rollout.prompts_per_iter * g.group;
        s.train.mini_batch = samples / g.steps;
        let train_replicas = g.count / s.train.tp;
        s.train.micro_batch = (s.train.mini_batch / train_replicas / g.micro_div).max(1);
        s.train.epochs = g.epochs;
        s.reference.enabled = g.reference;
        s.train.recompute = match g.recompute {
            0 => Recompute::Full,
            1 => Recompute::None,
            _ => Recompute::Auto,
        };
        s.train.freeze_vision = g.freeze >= 1;
        s.train.freeze_merger = g.freeze >= 2;
        s.schedule.prefix_dedup = g.dedup;
        s.schedule.decode_window = g.window;
    })
}

/// The batches a plan computes: every op except transfers and placement-only tasks.
fn batches(p: &Plan) -> Vec<String> {
    let mut v: Vec<String> = p
        .tasks
        .iter()
        .filter(|t| !matches!(t.op, Op::Offload { .. } | Op::Reload { .. }))
        .map(|t| format!("{}:{:?}", t.name, t.op))
        .collect();
    v.sort();
    v
}

fn outcome(spec: &JobSpec, mode: Mode) -> Result<Plan, String> {
    match compile(
        spec,
        &Options {
            mode: Some(mode),
            time_limit_s: 5.0,
            check_ir: true,
            ..Options::default()
        },
    ) {
        Ok(c) => {
            validate(&c.plan).map_err(|v| format!("INTERNAL: {v}"))?;
            Ok(c.plan)
        }
        Err(CompileError::User { message, .. }) => Err(message),
        Err(e @ CompileError::Internal(_)) => Err(format!("INTERNAL: {e}")),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn generated_pipelines_compile_to_valid_plans(g in gen()) {
        let spec = spec_of(&g);
        let serial = outcome(&spec, Mode::Serial);
        let overlap = outcome(&spec, Mode::Overlap);
        for r in [&serial, &overlap] {
            if let Err(m) = r {
                prop_assert!(!m.starts_with("INTERNAL"), "{g:?}: {m}");
            }
        }
        if let (Ok(s), Ok(o)) = (&serial, &overlap) {
            prop_assert_eq!(batches(s), batches(o), "modes must compute the same batches");
            prop_assert!(o.predicted.iteration_s <= s.predicted.iteration_s * 1.01 + 1e-6,
                "overlap {} slower than serial {} for {:?} (kept {} / {})", o.predicted.iteration_s, s.predicted.iteration_s, g, o.kept_act_layers, s.kept_act_layers);
        }
        if spec.cluster.count >= 2 {
            if let Err(m) = outcome(&spec, Mode::Disaggregated) {
                prop_assert!(!m.starts_with("INTERNAL"), "{g:?}: {m}");
            }
        }
    }
}
