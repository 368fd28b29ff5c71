//! Checks across fields and sections, run on the resolved spec: TP degrees against the model's
//! heads and widths and against the GPU count, batch divisibility, GRPO group size, M-RoPE
//! sections, media shapes against the vision tower, sequence length, token ids, the
//! reference against the KL coefficient, and whether the training state fits at all.
//!
//! Invariant: a check runs only when every path it reads is good ([`Cx::ok`]), so a value that
//! was already reported as wrong is not reported again through its consequences. Every check
//! runs (none stops at the first failure).

// `%` instead of `is_multiple_of`: the workspace supports Rust 1.85.
#![allow(clippy::manual_is_multiple_of)]

use crate::diag::Diagnostic;
use crate::memory::training_memory;
use crate::table::Cx;
use crate::units::gib;
use rollplex_plan::spec::*;

pub fn check(cx: &mut Cx<'_>, spec: &JobSpec) {
    model_shapes(cx, &spec.actor);
    for (which, tp) in [("rollout", spec.rollout.tp), ("train", spec.train.tp)] {
        tp_divides(cx, which, tp, &spec.actor);
    }
    gpu_count(cx, spec);
    batches(cx, spec);
    media(cx, spec);
    token_ids(cx, spec);
    algorithm(cx, spec);
    schedule(cx, spec);
    fits(cx, spec);
}

/// Reports an error at `path` and marks it bad, so later checks do not report its consequences.
fn err(cx: &mut Cx<'_>, code: &'static str, path: &str, msg: String, help: Option<String>) {
    let sp = cx.span(path);
    cx.mark_bad(path);
    cx.error(Diagnostic::error(code, sp, msg).with_help_opt(help));
}

fn warn(cx: &mut Cx<'_>, code: &'static str, path: &str, msg: String, help: Option<String>) {
    let sp = cx.span(path);
    cx.error(Diagnostic::warning(code, sp, msg).with_help_opt(help));
}

/// The divisors of `n` that are at most `max`, ascending (O(sqrt n)).
fn divisors_up_to(n: u32, max: u32) -> Vec<u32> {
    let mut v = Vec::new();
    let mut d: u32 = 1;
    while (d as u64) * (d as u64) <= n as u64 {
        if n % d == 0 {
            v.push(d);
            if d != n / d {
                v.push(n / d);
            }
        }
        d += 1;
    }
    v.retain(|&x| x <= max);
    v.sort_unstable();
    v
}

/// A readable list (long ones are elided in the middle).
fn list(xs: &[u32]) -> String {
    let s = |xs: &[u32]| {
        xs.iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    if xs.len() > 16 {
        format!("{}, ..., {}", s(&xs[..8]), s(&xs[xs.len() - 4..]))
    } else {
        s(xs)
    }
}

fn model_shapes(cx: &mut Cx<'_>, m: &ModelSpec) {
    let t = &m.text;
    if cx.ok(&["actor.text.hidden", "actor.text.heads"]) {
        if t.hidden_size % t.num_heads != 0 {
            err(
                cx,
                "model-shape",
                "actor.text.heads",
                format!(
                    "text hidden size {} is not divisible by its {} heads",
                    t.hidden_size, t.num_heads
                ),
                Some(format!(
                    "heads that divide {}: {}",
                    t.hidden_size,
                    list(&divisors_up_to(t.hidden_size, 128))
                )),
            );
        } else if cx.ok(&["actor.text.mrope"]) {
            let hd = t.head_dim();
            let sum: u32 = t.mrope_section.iter().sum();
            if hd % 2 != 0 {
                err(
                    cx,
                    "model-shape",
                    "actor.text.heads",
                    format!(
                        "head dim {hd} (= {} / {}) is odd; rotary embeddings need an even head dim",
                        t.hidden_size, t.num_heads
                    ),
                    None,
                );
            } else if sum != hd / 2 {
                err(
                    cx,
                    "mrope",
                    "actor.text.mrope",
                    format!(
                        "M-RoPE sections {:?} sum to {sum}, but head_dim / 2 = {} / 2 = {}",
                        t.mrope_section,
                        hd,
                        hd / 2
                    ),
                    Some(format!(
                        "the three sections (temporal, height, width) must add up to {}",
                        hd / 2
                    )),
                );
            }
        }
    }
    if cx.ok(&["actor.text.heads", "actor.text.kv_heads"])
        && (t.num_kv_heads > t.num_heads || t.num_heads % t.num_kv_heads != 0)
    {
        err(
            cx,
            "model-shape",
            "actor.text.kv_heads",
            format!(
                "{} key/value heads do not evenly serve {} query heads",
                t.num_kv_heads, t.num_heads
            ),
            Some(format!(
                "kv_heads must divide heads: {}",
                list(&divisors_up_to(t.num_heads, t.num_heads))
            )),
        );
    }
    let v = &m.vision;
    if cx.ok(&["actor.vision.hidden", "actor.vision.heads"]) && v.hidden_size % v.num_heads != 0 {
        err(
            cx,
            "model-shape",
            "actor.vision.heads",
            format!(
                "vision hidden size {} is not divisible by its {} heads",
                v.hidden_size, v.num_heads
            ),
            None,
        );
    }
    if cx.ok(&["actor.vision.out_hidden", "actor.text.hidden"])
        && v.out_hidden_size != t.hidden_size
    {
        err(
            cx,
            "model-shape",
            "actor.vision.out_hidden",
            format!(
                "the vision merger outputs width {}, but the text model is {} wide",
                v.out_hidden_size, t.hidden_size
            ),
            Some("`vision.out_hidden` must equal `text.hidden`".into()),
        );
    }
    if cx.ok(&[
        "actor.vision.window",
        "actor.vision.patch",
        "actor.vision.merge",
    ]) && v.window_size % (v.patch_size * v.spatial_merge_size) != 0
    {
        let unit = v.patch_size * v.spatial_merge_size;
        err(
            cx,
            "model-shape",
            "actor.vision.window",
            format!(
                "vision window {} px is not a multiple of patch x merge = {unit} px",
                v.window_size
            ),
            Some(format!(
                "e.g. `window = {}`",
                (v.window_size / unit).max(1) * unit
            )),
        );
    }
    if cx.ok(&["actor.vision.full_attention", "actor.vision.depth"]) {
        if let Some(&bad) = v.fullatt_block_indexes.iter().find(|&&i| i >= v.depth) {
            err(
                cx,
                "model-shape",
                "actor.vision.full_attention",
                format!("full-attention block {bad} does not exist: the vision tower has {} blocks (0..{})", v.depth, v.depth - 1),
                None,
            );
        }
    }
}

fn tp_divides(cx: &mut Cx<'_>, which: &str, tp: u32, m: &ModelSpec) {
    let path = format!("{which}.tp");
    if tp <= 1
        || !cx.ok(&[
            &path,
            "actor.text.heads",
            "actor.text.kv_heads",
            "actor.text.ffn",
            "actor.vision.heads",
            "actor.vision.ffn",
        ])
    {
        return;
    }
    let t = &m.text;
    let v = &m.vision;
    let dims = [
        ("text attention heads", t.num_heads),
        ("text key/value heads", t.num_kv_heads),
        ("text MLP width (ffn)", t.intermediate_size),
        ("vision attention heads", v.num_heads),
    ];
    let bad: Vec<String> = dims
        .iter()
        .filter(|(_, n)| n % tp != 0)
        .map(|(w, n)| format!("{w} ({n})"))
        .collect();
    if !bad.is_empty() {
        let ok: Vec<u32> = (1..=tp.clamp(8, 1 << 16) * 2)
            .filter(|d| dims.iter().all(|(_, n)| n % d == 0))
            .collect();
        err(
            cx,
            "tp-divides",
            &path,
            format!("{which} tp = {tp} does not divide the {}", bad.join(", ")),
            Some(format!("tensor parallelism splits heads and MLP columns evenly; degrees that work for this model: {}", list(&ok))),
        );
    }
    if bad.is_empty() && v.intermediate_size % tp != 0 {
        let hi = v.intermediate_size.div_ceil(tp);
        warn(
            cx,
            "tp-uneven",
            &path,
            format!("{which} tp = {tp} splits the vision MLP width {} unevenly ({} to {hi} columns per GPU)", v.intermediate_size, v.intermediate_size / tp),
            Some("the result is the same, but the largest shard sets the vision MLP's time".into()),
        );
    }
}

fn gpu_count(cx: &mut Cx<'_>, s: &JobSpec) {
    let n = s.cluster.count;
    if !cx.ok(&["gpu.count"]) {
        return;
    }
    let (rt, tt) = (s.rollout.tp, s.train.tp);
    if s.schedule.mode == Mode::Disaggregated {
        if cx.ok(&["rollout.tp", "train.tp"]) && rt as u64 + tt as u64 > n as u64 {
            err(
                cx,
                "gpu-count",
                "gpu.count",
                format!("disaggregated mode needs separate GPUs for rollout (tp = {rt}) and training (tp = {tt}): {} GPUs, but `count` is {n}", rt as u64 + tt as u64),
                Some(format!("raise `count` to at least {}, or use mode = overlap", rt as u64 + tt as u64)),
            );
        }
        return;
    }
    for (which, tp) in [("rollout", rt), ("train", tt)] {
        let path = format!("{which}.tp");
        if !cx.ok(&[&path]) {
            continue;
        }
        if tp > n {
            err(
                cx,
                "gpu-count",
                &path,
                format!("{which} tp = {tp} needs {tp} GPUs, but the job has {n}"),
                Some(format!("lower tp to at most {n}, or raise `gpu.count`")),
            );
        } else if n % tp != 0 {
            warn(
                cx,
                "gpu-count",
                &path,
                format!(
                    "{which} tp = {tp} does not divide the {n} GPUs: {} of them stay idle",
                    n % tp
                ),
                None,
            );
        }
        if tp > s.cluster.gpus_per_node && tp <= n && cx.ok(&["gpu.gpus_per_node"]) {
            warn(
                cx,
                "tp-across-nodes",
                &path,
                format!("{which} tp = {tp} spans nodes of {} GPUs: its all-reduces cross the slower inter-node link", s.cluster.gpus_per_node),
                None,
            );
        }
    }
}

fn batches(cx: &mut Cx<'_>, s: &JobSpec) {
    if !cx.ok(&["rollout.samples"]) {
        return;
    }
    // Training is sized by the trained groups (all rolled-out ones unless dynamic sampling).
    let groups = s
        .train
        .trained_groups(&s.rollout)
        .min(s.rollout.prompts_per_iter);
    let samples = groups * s.rollout.group_size;
    let (micro, mini) = (s.train.micro_batch, s.train.mini_batch);
    let base_ok = cx.ok(&["rollout.prompts", "rollout.group"]);
    let explicit_mini = cx.spans.get_exact("train.mini_batch").is_some();
    if base_ok && cx.ok(&["train.mini_batch"]) && (mini > samples || samples % mini != 0) {
        let path = if explicit_mini {
            "train.mini_batch"
        } else {
            "train.micro_batch"
        };
        let micro_ok = cx.ok(&["train.micro_batch"]);
        let ok: Vec<u32> = divisors_up_to(samples, samples)
            .into_iter()
            .filter(|d| !micro_ok || d % micro == 0)
            .collect();
        let with = if micro_ok {
            format!(" and be a multiple of micro_batch = {micro}")
        } else {
            String::new()
        };
        err(
            cx,
            "batch-divides",
            path,
            format!(
                "{} samples per iteration ({} {groups} x group {}) do not split into mini-batches of {mini}",
                samples,
                if s.train.groups.is_some() { "train groups" } else { "prompts" },
                s.rollout.group_size
            ),
            Some(format!("mini_batch must divide {samples}{with}: {}", list(&ok))),
        );
    } else if cx.ok(&["train.mini_batch", "train.micro_batch"])
        && (micro > mini || mini % micro != 0)
    {
        err(
            cx,
            "batch-divides",
            "train.micro_batch",
            format!("a mini-batch of {mini} samples does not split into micro-batches of {micro}"),
            Some(format!(
                "micro_batch must divide mini_batch = {mini}: {}",
                list(&divisors_up_to(mini, mini))
            )),
        );
    } else if cx.ok(&[
        "train.mini_batch",
        "train.micro_batch",
        "train.tp",
        "gpu.count",
    ]) && s.schedule.mode != Mode::Disaggregated
    {
        let dp = (s.cluster.count / s.train.tp.max(1)).max(1);
        if dp > 1 && mini as u64 % (micro as u64 * dp as u64) != 0 {
            err(
                cx,
                "batch-divides",
                "train.mini_batch",
                format!("a mini-batch of {mini} samples does not split over {dp} data-parallel replicas in micro-batches of {micro}"),
                Some(format!(
                    "{} GPUs / train tp {} = {dp} replicas; mini_batch must be a multiple of micro_batch x {dp} = {}",
                    s.cluster.count,
                    s.train.tp,
                    micro as u64 * dp as u64
                )),
            );
        }
    }
    if s.schedule.prefix_dedup
        && cx.ok(&["train.micro_batch", "rollout.group"])
        && micro % s.rollout.group_size != 0
        && s.rollout.group_size % micro != 0
    {
        warn(
            cx,
            "group-split",
            "train.micro_batch",
            format!("micro-batches of {micro} split GRPO groups of {}: a split group's shared prefix is computed once per piece", s.rollout.group_size),
            Some(format!("use a multiple of the group size ({})", s.rollout.group_size)),
        );
    }
}

fn media(cx: &mut Cx<'_>, s: &JobSpec) {
    let v = &s.actor.vision;
    if !cx.ok(&["rollout.media", "actor.vision"]) {
        return;
    }
    let unit = v.patch_size * v.spatial_merge_size;
    let (w, h, frames) = match s.rollout.media {
        MediaSpec::None => (0, 0, 0),
        MediaSpec::Image {
            width,
            height,
            count,
        } => (width, height, count),
        MediaSpec::Video {
            width,
            height,
            frames,
        } => (width, height, frames),
    };
    if frames > 0 && (w % unit != 0 || h % unit != 0) {
        let fix = |x: u32| (x.div_ceil(unit)).max(1) as u64 * unit as u64;
        err(
            cx,
            "media-shape",
            "rollout.media",
            format!(
                "{w}x{h} is not a multiple of patch x merge = {} x {} = {unit} px",
                v.patch_size, v.spatial_merge_size
            ),
            Some(format!("e.g. `size = {}x{}`", fix(w), fix(h))),
        );
        return;
    }
    if let MediaSpec::Video { frames, .. } = s.rollout.media {
        if frames % v.temporal_patch_size != 0 {
            err(
                cx,
                "media-shape",
                "rollout.media",
                format!(
                    "{frames} frames do not group into temporal patches of {}",
                    v.temporal_patch_size
                ),
                Some(format!(
                    "use a multiple of {}, e.g. `frames = {}`",
                    v.temporal_patch_size,
                    frames.div_ceil(v.temporal_patch_size) as u64 * v.temporal_patch_size as u64
                )),
            );
            return;
        }
    }
    // Sequence length: media tokens + text tokens + response tokens.
    let per_frame = (w / unit) as u64 * (h / unit) as u64;
    let media_tokens = match s.rollout.media {
        MediaSpec::None => 0,
        MediaSpec::Image { count, .. } => count as u64 * per_frame,
        MediaSpec::Video { frames, .. } => (frames / v.temporal_patch_size) as u64 * per_frame,
    };
    let total =
        media_tokens + s.rollout.prompt_text_tokens as u64 + s.rollout.max_new_tokens as u64;
    let maxp = s.actor.text.max_position_embeddings as u64;
    if cx.ok(&[
        "rollout.text_tokens",
        "rollout.max_new_tokens",
        "actor.text.max_positions",
    ]) && total > maxp
    {
        err(
            cx,
            "sequence-length",
            "rollout.media",
            format!(
                "a sample is {total} tokens ({media_tokens} media + {} text + {} new), more than the model's {maxp} positions",
                s.rollout.prompt_text_tokens, s.rollout.max_new_tokens
            ),
            Some("use fewer frames, a smaller size, or fewer max_new_tokens".into()),
        );
    }
}

fn token_ids(cx: &mut Cx<'_>, s: &JobSpec) {
    if !cx.ok(&["actor.text.vocab"]) {
        return;
    }
    let vocab = s.actor.text.vocab_size;
    let k = &s.actor.tokens;
    let named = [
        ("actor.tokens.image", "image", k.image_token_id),
        ("actor.tokens.video", "video", k.video_token_id),
        (
            "actor.tokens.vision_start",
            "vision_start",
            k.vision_start_token_id,
        ),
        (
            "actor.tokens.vision_end",
            "vision_end",
            k.vision_end_token_id,
        ),
    ];
    for (path, name, id) in named {
        if id >= vocab && cx.ok(&[path]) {
            err(
                cx,
                "token-id",
                path,
                format!("the {name} token id {id} is outside the vocabulary of {vocab}"),
                Some("set it in `tokens { ... }` inside the model".into()),
            );
        }
    }
    if cx.ok(&["actor.tokens.eos"]) {
        if let Some(id) = k.eos_token_ids.iter().find(|&&i| i >= vocab) {
            err(
                cx,
                "token-id",
                "actor.tokens.eos",
                format!("the end-of-sequence id {id} is outside the vocabulary of {vocab}"),
                Some("set `eos = [...]` in `tokens { ... }` inside the model".into()),
            );
        }
        if k.eos_token_ids.is_empty() {
            warn(
                cx,
                "token-id",
                "actor.tokens.eos",
                "no end-of-sequence token: every sample runs to max_new_tokens".into(),
                None,
            );
        }
    }
    if cx.ok(&["rollout.sampling.stop"]) {
        if let Some(id) = s
            .rollout
            .sampling
            .stop_token_ids
            .iter()
            .find(|&&i| i >= vocab)
        {
            err(
                cx,
                "token-id",
                "rollout.sampling.stop",
                format!("stop token {id} is outside the vocabulary of {vocab}"),
                None,
            );
        }
    }
}

fn algorithm(cx: &mut Cx<'_>, s: &JobSpec) {
    let loss = s.train.algorithm.loss();
    if let Algorithm::Grpo(_) = s.train.algorithm {
        if cx.ok(&["rollout.group"]) && s.rollout.group_size < 2 {
            err(
                cx,
                "group-size",
                "rollout.group",
                format!("GRPO needs at least 2 samples per prompt, `group` is {}", s.rollout.group_size),
                Some("GRPO's advantage is a sample's reward relative to its group; use `group = 4` or more, or `algorithm = ppo_clip`".into()),
            );
        }
        if cx.ok(&["rollout.sampling.temperature", "rollout.group"])
            && s.rollout.sampling.temperature == 0.0
            && s.rollout.group_size > 1
        {
            warn(
                cx,
                "greedy-group",
                "rollout.sampling.temperature",
                "temperature 0 samples greedily: every sample of a group is the same, so every advantage is 0".into(),
                None,
            );
        }
    }
    if cx.ok(&["reference", "train.algorithm"]) {
        let explicit = cx.spans.get_exact("reference").is_some();
        if !s.reference.enabled && loss.kl_coef > 0.0 {
            err(
                cx,
                "reference",
                "reference",
                format!(
                    "`reference = off`, but the KL term (kl_coef = {}) needs the reference model",
                    loss.kl_coef
                ),
                Some("turn the reference on, or set `kl_coef = 0` in the algorithm".into()),
            );
        } else if s.reference.enabled && loss.kl_coef == 0.0 && explicit {
            warn(
                cx,
                "reference",
                "reference",
                "the reference model is scored, but kl_coef = 0 leaves its log-probs unused".into(),
                Some("drop `reference = on` to skip the reference pass".into()),
            );
        }
    }
    if cx.ok(&["train.algorithm"]) && loss.clip_low >= 1.0 {
        err(
            cx,
            "range",
            "train.algorithm",
            format!("clip_low = {} allows a ratio of 0 or less", loss.clip_low),
            Some("clip bounds are usually 0.1-0.3".into()),
        );
    }
}

fn schedule(cx: &mut Cx<'_>, s: &JobSpec) {
    if cx.ok(&["schedule.memory", "gpu.hbm"]) && s.schedule.memory_budget > s.cluster.gpu.hbm_bytes
    {
        err(
            cx,
            "memory",
            "schedule.memory",
            format!(
                "the memory budget {} is more than the GPU's {}",
                gib(s.schedule.memory_budget as f64),
                gib(s.cluster.gpu.hbm_bytes as f64)
            ),
            Some(format!(
                "at most `memory = {}MiB`",
                s.cluster.gpu.hbm_bytes >> 20
            )),
        );
    }
    let max_new = s.rollout.max_new_tokens;
    if cx.ok(&["rollout.response_length", "rollout.max_new_tokens"])
        && cx.spans.get_exact("rollout.response_length").is_some()
    {
        let over = match s.rollout.response_len {
            LengthDist::Fixed { tokens } => (tokens > max_new).then(|| format!("fixed({tokens})")),
            LengthDist::Uniform { max, .. } => {
                (max > max_new).then(|| format!("a maximum of {max}"))
            }
            LengthDist::LogNormal { median, .. } => {
                (median > max_new as f64).then(|| format!("a median of {median}"))
            }
        };
        if let Some(what) = over {
            warn(cx, "response-length", "rollout.response_length", format!("response_length has {what}, above max_new_tokens = {max_new}: lengths are capped there"), None);
        }
    }
}

fn fits(cx: &mut Cx<'_>, s: &JobSpec) {
    if !cx.ok(&[
        "actor",
        "train.tp",
        "schedule.memory",
        "schedule.host_memory",
        "gpu.hbm",
        "reference",
    ]) {
        return;
    }
    let m = training_memory(s);
    let need = m.total();
    let have = s.schedule.memory_budget as f64 + s.schedule.host_memory as f64;
    if need > have {
        let path = if cx.spans.get_exact("train.tp").is_some() {
            "train.tp"
        } else {
            "actor"
        };
        let mut parts = format!(
            "{} weights + {} gradients + {} fp32 master + {} Adam moments",
            gib(m.weights),
            gib(m.grads),
            gib(m.master),
            gib(m.moments)
        );
        if m.reference > 0.0 {
            parts.push_str(&format!(" + {} reference", gib(m.reference)));
        }
        err(
            cx,
            "does-not-fit",
            path,
            format!(
                "the training state does not fit even with offload, by {}: it needs {} per GPU, and there is {} of device memory + {} of host memory",
                gib(need - have),
                gib(need),
                gib(s.schedule.memory_budget as f64),
                gib(s.schedule.host_memory as f64)
            ),
            Some(format!(
                "per GPU at train tp = {}: {parts}; raise train.tp, freeze the vision tower, set `schedule {{ host_memory = ... }}`, or turn the reference off",
                s.train.tp
            )),
        );
    }
}
