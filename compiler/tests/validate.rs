//! The verifier catches each broken invariant: start from a valid compiled plan, break one
//! rule, and check that `validate` names it.
use rollplex_compiler::fixtures::{job, paper_job, QwenSize};
use rollplex_compiler::{compile, Options};
use rollplex_plan::spec::Mode;
use rollplex_plan::{
    validate, BufferClass, BufferId, BufferRole, Lifetime, Op, Plan, StreamId, TaskId, ALIGN,
};

fn plan(spec: &rollplex_plan::spec::JobSpec, mode: Mode) -> Plan {
    compile(
        spec,
        &Options {
            mode: Some(mode),
            ..Options::default()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"))
    .plan
}

fn overlap_plan() -> Plan {
    plan(&job(|_| {}), Mode::Overlap)
}

/// The rules `validate` reports for `p`.
fn rules(p: &Plan) -> Vec<&'static str> {
    match validate(p) {
        Ok(()) => vec![],
        Err(v) => {
            let mut r: Vec<&'static str> = v.0.iter().map(|x| x.rule).collect();
            r.dedup();
            r
        }
    }
}

fn task_named<'a>(p: &'a Plan, prefix: &str) -> &'a rollplex_plan::Task {
    p.tasks
        .iter()
        .find(|t| t.name.starts_with(prefix))
        .unwrap_or_else(|| panic!("no task {prefix}"))
}

#[test]
fn compiled_plans_are_valid() {
    for (spec, mode) in [
        (job(|_| {}), Mode::Serial),
        (job(|_| {}), Mode::Overlap),
        (paper_job(QwenSize::B7), Mode::Overlap),
        (paper_job(QwenSize::B7), Mode::Disaggregated),
    ] {
        assert_eq!(rules(&plan(&spec, mode)), Vec::<&str>::new());
    }
}

#[test]
fn forward_dependency() {
    let mut p = overlap_plan();
    let last = TaskId::from_index(p.tasks.len() - 1);
    p.tasks[3].deps.push(last);
    assert!(rules(&p).contains(&"deps"));
}

#[test]
fn missing_stream() {
    let mut p = overlap_plan();
    p.tasks[0].stream = StreamId(99);
    assert_eq!(rules(&p), vec!["ids"]);
}

#[test]
fn sm_split_off_granularity() {
    let mut p = overlap_plan();
    let w = p
        .windows
        .iter()
        .position(|w| w.side_sms > 0)
        .expect("the overlap plan splits some window");
    p.windows[w].decode_sms = 60; // not a multiple of 8
    assert!(rules(&p).contains(&"sms"));
    let mut p = overlap_plan();
    p.windows[w].side_sms = p.target.sms; // more than the GPU
    assert!(rules(&p).contains(&"sms"));
}

#[test]
fn later_weights_inside_a_decode_window() {
    // Several steps: a step-1 micro-batch moved into a window breaks the weight-version rule.
    let spec = job(|s| s.train.mini_batch = 64);
    let mut p = plan(&spec, Mode::Overlap);
    let w = p.windows.last().expect("windows").id;
    let side = p.windows.last().expect("windows").side_stream;
    let i = p
        .tasks
        .iter()
        .position(|t| matches!(t.op, Op::TrainMicroBatch { step: 1, .. }))
        .expect("a step-1 micro-batch");
    p.tasks[i].window = Some(w);
    p.tasks[i].stream = side;
    p.tasks[i].sms = 0;
    assert!(rules(&p).contains(&"weights"), "{:?}", rules(&p));
}

#[test]
fn optimizer_step_not_waiting_for_its_micro_batches() {
    let mut p = overlap_plan();
    let i = p
        .tasks
        .iter()
        .position(|t| matches!(t.op, Op::OptimizerStep { step: 0 }))
        .expect("a step");
    p.tasks[i].deps.clear();
    // Without its dependencies the step still follows earlier main-stream work, so move it
    // to the copy stream, where nothing orders it after the micro-batches.
    let copy = p
        .streams
        .iter()
        .find(|s| s.name == "copy")
        .expect("a copy stream")
        .id;
    p.tasks[i].stream = copy;
    assert!(rules(&p).contains(&"weights"), "{:?}", rules(&p));
}

#[test]
fn decode_waiting_on_a_slot_task_deadlocks() {
    let mut p = overlap_plan();
    let reward = task_named(&p, "reward.slot").id;
    let d = p
        .tasks
        .iter()
        .rposition(|t| matches!(t.op, Op::DecodeWindow { .. }))
        .expect("decode");
    assert!(
        d > reward.index(),
        "the plan puts a reward inside a window before the last decode"
    );
    p.tasks[d].deps.push(reward);
    assert!(rules(&p).contains(&"deadlock"), "{:?}", rules(&p));
}

#[test]
fn overlapping_live_buffers() {
    let mut p = overlap_plan();
    // kv.prompt and kv.response are both alive during decode.
    let a = role_at(&p, BufferRole::KvPrompt);
    let b = role_at(&p, BufferRole::KvResponse);
    p.buffers[b].offset = p.buffers[a].offset;
    assert!(rules(&p).contains(&"memory"));
}

fn role_at(p: &Plan, role: BufferRole) -> usize {
    p.buffers
        .iter()
        .position(|b| b.role == role)
        .unwrap_or_else(|| panic!("no {role:?} buffer"))
}

#[test]
fn role_of_another_class() {
    let mut p = overlap_plan();
    let i = role_at(&p, BufferRole::ActorWeights);
    p.buffers[i].class = BufferClass::RefWeights;
    assert_eq!(rules(&p), vec!["roles"]);
}

#[test]
fn two_buffers_of_one_role() {
    let mut p = overlap_plan();
    let i = role_at(&p, BufferRole::RefWeights);
    p.buffers[i].role = BufferRole::ActorWeights;
    p.buffers[i].class = BufferClass::ActorWeights;
    assert_eq!(rules(&p), vec!["roles"]);
    // every training program has its optimizer state
    let mut p = overlap_plan();
    let i = role_at(&p, BufferRole::AdamMoments);
    p.buffers[i].role = BufferRole::Scalars;
    p.buffers[i].class = BufferClass::Scalars;
    assert!(rules(&p).contains(&"roles"), "{:?}", rules(&p));
}

#[test]
fn grads_of_a_step_that_does_not_run() {
    let mut p = overlap_plan();
    let i = role_at(&p, BufferRole::Grads { step: 0 });
    p.buffers[i].role = BufferRole::Grads { step: 9 };
    assert_eq!(rules(&p), vec!["roles"]);
}

#[test]
fn decode_kv_rows_apart() {
    let mut p = overlap_plan();
    let i = role_at(&p, BufferRole::KvPrompt);
    p.buffers[i].offset += ALIGN;
    assert!(rules(&p).contains(&"roles"), "{:?}", rules(&p));
}

#[test]
fn buffer_used_outside_its_lifetime() {
    let mut p = overlap_plan();
    let i = p
        .buffers
        .iter()
        .position(|b| {
            matches!(b.lifetime, Lifetime::Tasks { .. }) && b.name.starts_with("scratch.")
        })
        .expect("a scratch buffer");
    p.tasks[0].reads.push(BufferId::from_index(i));
    assert!(rules(&p).contains(&"memory"));
}

#[test]
fn over_budget() {
    let mut p = overlap_plan();
    p.memory.gpus[0].budget = p.memory.gpus[0].peak - 1;
    assert_eq!(rules(&p), vec!["memory"]);
}

#[test]
fn start_before_dependency_ends() {
    let mut p = overlap_plan();
    let t = &mut p.tasks[2];
    t.start_s = 0.0;
    assert!(rules(&p).contains(&"timing"));
}

#[test]
fn slot_out_of_range() {
    let mut p = overlap_plan();
    let i = p
        .tasks
        .iter()
        .position(|t| matches!(t.op, Op::Reward { .. }))
        .expect("a reward");
    p.tasks[i].op = Op::Reward { slot: 1000 };
    assert_eq!(rules(&p), vec!["ranges"]);
}

/// Training ops count training slots: a micro-batch past the trained groups, or more groups
/// trained than scored, is refused.
#[test]
fn training_past_the_trained_groups() {
    let mut p = overlap_plan();
    p.parallel.trained_groups_per_train_replica = p.parallel.prompts_per_train_replica + 1;
    assert_eq!(rules(&p), vec!["ranges"]);
    let mut p = overlap_plan();
    assert!(p.parallel.prompts_per_train_replica > 1);
    p.parallel.trained_groups_per_train_replica = 1;
    assert_eq!(
        rules(&p),
        vec!["ranges"],
        "micro-batches past one trained group"
    );
}

#[test]
fn negative_or_nested_work() {
    use rollplex_plan::work::{Work, WorkKind, WorkPart};
    let mut p = overlap_plan();
    p.tasks[2].work.bytes = -1.0;
    assert_eq!(rules(&p), vec!["work"]);
    let mut p = overlap_plan();
    let part = WorkPart {
        kind: WorkKind::VisionEncode,
        work: p.tasks[2].work.clone(),
    };
    p.tasks[2].work.parts = vec![WorkPart {
        kind: WorkKind::VisionEncode,
        work: Work {
            parts: vec![part],
            ..Default::default()
        },
    }];
    assert_eq!(rules(&p), vec!["work"]);
    let mut p = overlap_plan();
    p.tasks[2].work.parts = vec![WorkPart {
        kind: WorkKind::VisionEncode,
        work: Work {
            flops: f64::NAN,
            ..Default::default()
        },
    }];
    assert_eq!(rules(&p), vec!["work"]);
}

/// A plan that takes the old log-probs from the training forward has no old-log-prob pass; one
/// with the pass scores every trained slot before its micro-batch.
#[test]
fn old_logprobs_source_and_tasks_disagree() {
    use rollplex_plan::spec::OldLogProbPass;
    use rollplex_plan::{OldLogProbSource, Purpose};
    let forced = plan(
        &job(|s| s.train.old_logprobs = OldLogProbPass::Recompute),
        Mode::Overlap,
    );
    assert_eq!(forced.old_logprobs, OldLogProbSource::Pass);
    assert_eq!(rules(&forced), Vec::<&str>::new());
    let mut p = forced.clone();
    p.old_logprobs = OldLogProbSource::TrainForward;
    p.spec.train.old_logprobs = OldLogProbPass::Auto;
    assert_eq!(
        rules(&p),
        vec!["old_logprobs"],
        "pass tasks in a plan without one"
    );
    let mut p = overlap_plan();
    assert_eq!(p.old_logprobs, OldLogProbSource::TrainForward);
    p.spec.train.old_logprobs = OldLogProbPass::Recompute;
    assert_eq!(
        rules(&p),
        vec!["old_logprobs"],
        "the job asked for the pass"
    );
    let mut p = overlap_plan();
    p.old_logprobs = OldLogProbSource::Pass;
    assert_eq!(rules(&p), vec!["old_logprobs"], "a pass that never runs");
    // slot 0's old log-probs scored twice and slot 1's never
    let mut p = forced;
    let i = p
        .tasks
        .iter()
        .position(|t| {
            t.op == Op::ActorSuffix {
                slot: 1,
                purpose: Purpose::OldLogProb,
            }
        })
        .expect("slot 1's old-log-prob suffix");
    p.tasks[i].op = Op::ActorSuffix {
        slot: 0,
        purpose: Purpose::OldLogProb,
    };
    assert_eq!(rules(&p), vec!["old_logprobs"]);
}

/// Kept activation layers, of the response rows and of the prompt rows, are at most the text
/// layers, and what `recompute = none | full` fixes.
#[test]
fn kept_layers_past_the_model_or_against_the_job() {
    use rollplex_plan::spec::Recompute;
    let p = overlap_plan();
    let layers = p.spec.actor.text.num_layers;
    for prompt in [false, true] {
        let set = |p: &mut Plan, n: u32| match prompt {
            true => p.kept_prompt_layers = n,
            false => p.kept_act_layers = n,
        };
        let mut q = p.clone();
        set(&mut q, layers + 1);
        assert_eq!(rules(&q), vec!["activations"], "prompt rows: {prompt}");
        let mut q = p.clone();
        q.spec.train.recompute = Recompute::Full;
        q.kept_act_layers = 0;
        q.kept_prompt_layers = 0;
        assert_eq!(rules(&q), Vec::<&str>::new());
        set(&mut q, 1);
        assert_eq!(
            rules(&q),
            vec!["activations"],
            "prompt rows: {prompt}, full"
        );
    }
}

/// A plan whose prefill keeps the training prompt forwards runs no training-prompt task, trains
/// after every prefill, and only where the job allows it.
#[test]
fn train_prefix_source_and_tasks_disagree() {
    use rollplex_plan::{Groups, Purpose, Span, TrainPrefixSource};
    let kept = plan(&job(|s| s.train.freeze_merger = true), Mode::Overlap);
    assert_eq!(kept.train_prefix, TrainPrefixSource::Rollout);
    assert_eq!(rules(&kept), Vec::<&str>::new());
    assert!(!kept.tasks.iter().any(|t| matches!(
        t.op,
        Op::ActorPrefix {
            purpose: Purpose::Train { .. },
            ..
        }
    )));
    // the merger trains: the job does not allow it
    let mut p = kept.clone();
    p.spec.train.freeze_merger = false;
    assert_eq!(rules(&p), vec!["train_prefix"], "a trained merger");
    // a training-prompt task beside the prefill's
    let mut p = kept.clone();
    let i = p
        .tasks
        .iter()
        .position(|t| matches!(t.op, Op::RefPrefix { .. }))
        .expect("a reference prefix");
    p.tasks[i].op = Op::ActorPrefix {
        groups: Groups::Prompts(Span::new(0, 1)),
        copies: 1,
        purpose: Purpose::Train { step: 0 },
    };
    assert!(rules(&p).contains(&"train_prefix"), "{:?}", rules(&p));
    // the job asks for the pass of their own
    let mut p = kept.clone();
    p.spec.train.prompt_forward = rollplex_plan::spec::PromptForwardPass::Recompute;
    assert_eq!(rules(&p), vec!["train_prefix"], "asked for their own pass");
    // the job's default (a trained merger) runs the pass: claiming the prefill's is refused
    let mut p = overlap_plan();
    assert_eq!(p.train_prefix, TrainPrefixSource::Pass);
    p.train_prefix = TrainPrefixSource::Rollout;
    assert!(rules(&p).contains(&"train_prefix"), "{:?}", rules(&p));
}

/// The job of [`overlap_plan`] with its optimizer state streamed (`optimizer_state = stream`).
fn streamed_plan() -> Plan {
    use rollplex_plan::spec::OptimizerState;
    plan(
        &job(|s| {
            s.train.optimizer_state = OptimizerState::Stream;
            s.schedule.host_memory = 1 << 40;
        }),
        Mode::Overlap,
    )
}

#[test]
fn malformed_optimizer_stream() {
    let good = streamed_plan();
    let st = good.optimizer_stream.clone().expect("streamed");
    assert_eq!(rules(&good), Vec::<&str>::new());
    // a slot count the executors do not run, chunks of nothing, a chunk count that does not
    // cover the state, staging of another size, a GPU that is not there
    let broken: [&dyn Fn(&mut Plan); 5] = [
        &|p| p.optimizer_stream.as_mut().unwrap().slots = 4,
        &|p| p.optimizer_stream.as_mut().unwrap().chunk_elems = 0,
        &|p| p.optimizer_stream.as_mut().unwrap().chunks += 1,
        &|p| {
            let i = role_at(p, BufferRole::AdamMoments);
            p.buffers[i].bytes -= 4;
        },
        &|p| p.optimizer_stream.as_mut().unwrap().gpu = rollplex_plan::GpuId(9),
    ];
    for (k, f) in broken.iter().enumerate() {
        let mut p = good.clone();
        f(&mut p);
        assert!(
            rules(&p).contains(&"optimizer_stream"),
            "case {k} ({st:?}): {:?}",
            rules(&p)
        );
    }
    // the optimizer step must update the host copies
    let mut p = good.clone();
    for t in p.tasks.iter_mut() {
        if matches!(t.op, Op::OptimizerStep { .. }) {
            t.reads
                .retain(|&b| good.buffers[b.index()].role != BufferRole::HostCopy);
        }
    }
    assert!(rules(&p).contains(&"optimizer_stream"), "{:?}", rules(&p));
    // a plan without the state on the host cannot stream it
    let mut p = overlap_plan();
    p.optimizer_stream = Some(st);
    assert!(rules(&p).contains(&"optimizer_stream"), "{:?}", rules(&p));
}
