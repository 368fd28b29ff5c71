//! The `model actor { ... }` section: a preset, a checkpoint's config.json (read through
//! [`Env`]), or explicit dimensions; `vision { }`, `text { }` and `tokens { }` override or
//! complete whichever base was given.

// `%` instead of `is_multiple_of`: the workspace supports Rust 1.85.
#![allow(clippy::manual_is_multiple_of)]

use crate::ast::{Body, Ident};
use crate::diag::Diagnostic;
use crate::presets;
use crate::resolve::count_list;
use crate::span::Span;
use crate::table::{as_choice, Cx, Table};
use crate::Env;
use rollplex_plan::spec::*;

/// Where values come from when a key is not written: a preset or a checkpoint.
pub struct Base {
    /// The span of `preset = ...` / `checkpoint = ...`, if one was given and valid.
    pub span: Option<Span>,
    /// A base was named but could not be used (already reported): missing keys stay quiet.
    pub bad: bool,
}

impl Base {
    /// The written value, else the base's (its span is the base's), else a missing-key error.
    #[allow(clippy::too_many_arguments)]
    pub fn pick<T>(
        &self,
        cx: &mut Cx<'_>,
        t: &mut Table<'_>,
        key: &'static str,
        got: Option<T>,
        base: Option<T>,
        what: &str,
        example: &str,
        fallback: T,
    ) -> T {
        if let Some(v) = got {
            return v;
        }
        let path = format!("{}.{key}", t.path);
        if t.has(key) {
            return fallback; // written but invalid: already reported
        }
        match (base, self.span) {
            (Some(b), Some(sp)) => {
                cx.spans.insert(&path, sp);
                b
            }
            _ if self.bad => {
                cx.mark_bad(&path);
                fallback
            }
            _ => {
                t.missing(cx, key, what, example);
                fallback
            }
        }
    }

    /// Like [`Base::pick`], but a key without a base value takes `default` silently.
    pub fn pick_default<T>(
        &self,
        cx: &mut Cx<'_>,
        t: &mut Table<'_>,
        key: &'static str,
        got: Option<T>,
        base: Option<T>,
        default: T,
    ) -> T {
        if let Some(v) = got {
            return v;
        }
        if t.has(key) {
            return default;
        }
        if let (Some(b), Some(sp)) = (base, self.span) {
            cx.spans.insert(&format!("{}.{key}", t.path), sp);
            return b;
        }
        default
    }
}

/// A model spec used when the section is missing (the job is rejected anyway).
pub fn stand_in() -> ModelSpec {
    let p = presets::model("tiny").expect("tiny preset exists");
    ModelSpec {
        name: p.name.into(),
        vision: p.vision,
        text: p.text,
        tokens: p.tokens,
        dtype: DType::Bf16,
        weights: WeightsSource::Random { seed: 0 },
    }
}

pub fn model(
    cx: &mut Cx<'_>,
    label: Option<&Ident>,
    head: Span,
    body: &Body,
    seed: u64,
    env: &dyn Env,
) -> ModelSpec {
    match label {
        Some(l) if l.name == "actor" => {}
        Some(l) => cx.error(
            Diagnostic::error("model-name", l.span, format!("a model named `{}`", l.name))
                .with_label("expected `actor`")
                .with_help("the job declares one model, `model actor { ... }`; the reference is a frozen copy of it (`reference = on`)"),
        ),
        None => cx.error(
            Diagnostic::error("model-name", head, "the model has no name")
                .with_help("write `model actor { ... }`"),
        ),
    }
    let mut t = Table::from_body(cx, "actor", "`model actor`", head, body);
    t.hints = &[
        ("model", "preset"),
        ("path", "checkpoint"),
        ("torch_dtype", "dtype"),
    ];
    let preset_given = t.has("preset");
    let preset = t
        .typed(cx, "preset", |v, _| as_choice(v, presets::MODEL_PRESETS))
        .and_then(presets::model);
    let ckpt_dir = t.string(cx, "checkpoint");
    let ckpt_given = t.has("checkpoint");
    if preset_given && ckpt_given {
        let sp = cx.span("actor.checkpoint");
        cx.error(
            Diagnostic::error("conflict", sp, "both `preset` and `checkpoint` are given")
                .with_help("the checkpoint's config.json already gives the dimensions; drop `preset`, or drop `checkpoint` and use `weights = random(seed)`"),
        );
    }
    // The base dims: the checkpoint's config.json, else the preset.
    let mut base_bad = preset_given && preset.is_none();
    let mut base_span = cx
        .spans
        .get_exact("actor.preset")
        .filter(|_| preset.is_some());
    let mut base: Option<(VisionDims, TextDims, SpecialTokens)> = preset
        .as_ref()
        .map(|p| (p.vision.clone(), p.text.clone(), p.tokens.clone()));
    if let Some(dir) = &ckpt_dir {
        let sp = cx.span("actor.checkpoint");
        let path = config_path(dir);
        match env
            .read_file(&path)
            .map_err(|e| format!("cannot read `{path}`: {e}"))
            .and_then(|text| {
                rollplex_plan::hf_config::parse(&text).map_err(|e| format!("`{path}`: {e}"))
            }) {
            Ok(c) => {
                base = Some((c.vision, c.text, c.tokens));
                base_span = Some(sp);
            }
            Err(msg) => {
                base = None;
                base_bad = true;
                cx.error(Diagnostic::error("checkpoint", sp, msg).with_help(
                    "`checkpoint` names a Hugging Face Qwen2.5-VL directory holding config.json",
                ));
            }
        }
    } else if ckpt_given {
        base_bad = true;
    }
    let b = Base {
        span: base_span,
        bad: base_bad,
    };
    let name = t
        .string(cx, "name")
        .unwrap_or_else(|| match (&preset, &ckpt_dir) {
            (_, Some(dir)) => dir
                .trim_end_matches('/')
                .rsplit('/')
                .next()
                .unwrap_or(dir)
                .to_string(),
            (Some(p), None) => p.name.to_string(),
            (None, None) => "custom".to_string(),
        });
    let dtype = match t.choice(cx, "dtype", &["bf16", "f16", "f32"]) {
        Some("f16") => DType::F16,
        Some("f32") => DType::F32,
        _ => DType::Bf16,
    };
    let weights = weights(cx, &mut t, ckpt_dir.as_deref(), seed);

    let has_sections = t.has("vision") || t.has("text");
    if b.span.is_none() && !b.bad && !has_sections && !t.broken {
        cx.error(
            Diagnostic::error("missing-key", head, "`model actor` needs its dimensions")
                .with_help("give `preset = \"qwen2.5-vl-3b\"` (or -7b, -32b, tiny), `checkpoint = \"dir\"`, or `vision { ... }` and `text { ... }`"),
        );
        cx.mark_bad("actor");
    }
    let quiet = Base {
        span: b.span,
        bad: b.bad || !has_sections,
    };
    let (bv, bt, btok) = match base {
        Some((v, t, k)) => (Some(v), Some(t), Some(k)),
        None => (None, None, None),
    };
    let mut vision = vision(cx, &mut t, &quiet, bv);
    let text = text(cx, &mut t, &quiet, bt.as_ref());
    if vision.out_hidden_size == 0 {
        vision.out_hidden_size = text.hidden_size;
    }
    let tokens = tokens(
        cx,
        &mut t,
        &b,
        btok.or_else(|| Some(presets::qwen_tokens())),
    );
    t.finish(cx);
    dims_in_range(cx, &vision, &text);
    ModelSpec {
        name,
        vision,
        text,
        tokens,
        dtype,
        weights,
    }
}

/// Every dimension within what a real model uses (and what the parameter count can add up
/// without overflow), whether written, from a preset or from a config.json.
fn dims_in_range(cx: &mut Cx<'_>, v: &VisionDims, t: &TextDims) {
    const K: u32 = 1 << 10;
    let dims: [(&str, u32, u32, u32); 17] = [
        ("vision.depth", v.depth, 1, 4 * K),
        ("vision.hidden", v.hidden_size, 1, K * K),
        ("vision.heads", v.num_heads, 1, 64 * K),
        ("vision.ffn", v.intermediate_size, 1, 4 * K * K),
        ("vision.patch", v.patch_size, 1, K),
        ("vision.temporal_patch", v.temporal_patch_size, 1, 64),
        ("vision.merge", v.spatial_merge_size, 1, 16),
        ("vision.window", v.window_size, 1, 64 * K),
        ("vision.in_channels", v.in_channels, 1, 64),
        ("vision.out_hidden", v.out_hidden_size, 1, K * K),
        ("text.layers", t.num_layers, 1, 4 * K),
        ("text.hidden", t.hidden_size, 1, K * K),
        ("text.heads", t.num_heads, 1, 64 * K),
        ("text.kv_heads", t.num_kv_heads, 1, 64 * K),
        ("text.ffn", t.intermediate_size, 1, 4 * K * K),
        ("text.vocab", t.vocab_size, 1, 16 * K * K),
        ("text.max_positions", t.max_position_embeddings, 1, u32::MAX),
    ];
    for (key, x, lo, hi) in dims {
        let path = format!("actor.{key}");
        if (lo..=hi).contains(&x) || cx.bad.contains(&path) {
            continue;
        }
        let sp = cx.span(&path);
        cx.mark_bad(&path);
        cx.mark_bad("actor");
        cx.error(
            Diagnostic::error(
                "range",
                sp,
                format!("model dimension `{key}` = {x} is outside {lo}..={hi}"),
            )
            .with_help("give a value a Qwen2.5-VL-family model can have"),
        );
    }
}

/// `dir/config.json`.
pub fn config_path(dir: &str) -> String {
    if dir.is_empty() {
        "config.json".into()
    } else if dir.ends_with('/') {
        format!("{dir}config.json")
    } else {
        format!("{dir}/config.json")
    }
}

fn weights(cx: &mut Cx<'_>, t: &mut Table<'_>, ckpt: Option<&str>, seed: u64) -> WeightsSource {
    let Some(c) = t.call(cx, "weights", &["random", "checkpoint"]) else {
        return match ckpt {
            Some(dir) => WeightsSource::Checkpoint {
                path: dir.to_string(),
            },
            None => WeightsSource::Random { seed },
        };
    };
    if c.name.name == "random" {
        let mut w = Table::from_call(cx, "actor.weights", &c, &["seed"]);
        let s = w.u64(cx, "seed").unwrap_or(seed);
        w.finish(cx);
        WeightsSource::Random { seed: s }
    } else {
        let mut w = Table::from_call(cx, "actor.weights", &c, &["path"]);
        let p = w.string(cx, "path");
        w.finish(cx);
        match p.or_else(|| ckpt.map(str::to_string)) {
            Some(path) => WeightsSource::Checkpoint { path },
            None => {
                cx.mark_bad("actor.weights");
                cx.error(
                    Diagnostic::error("missing-key", c.name.span, "`weights = checkpoint` without a checkpoint")
                        .with_help("add `checkpoint = \"dir\"` to the model, or write `weights = checkpoint(\"dir\")`"),
                );
                WeightsSource::Random { seed }
            }
        }
    }
}

const VISION_HINTS: &[(&str, &str)] = &[
    ("hidden_size", "hidden"),
    ("embed_dim", "hidden"),
    ("num_heads", "heads"),
    ("intermediate_size", "ffn"),
    ("patch_size", "patch"),
    ("temporal_patch_size", "temporal_patch"),
    ("spatial_merge_size", "merge"),
    ("window_size", "window"),
    ("fullatt_block_indexes", "full_attention"),
    ("fullatt", "full_attention"),
    ("in_chans", "in_channels"),
    ("out_hidden_size", "out_hidden"),
];

const TEXT_HINTS: &[(&str, &str)] = &[
    ("num_hidden_layers", "layers"),
    ("num_layers", "layers"),
    ("hidden_size", "hidden"),
    ("num_attention_heads", "heads"),
    ("num_heads", "heads"),
    ("num_key_value_heads", "kv_heads"),
    ("num_kv_heads", "kv_heads"),
    ("intermediate_size", "ffn"),
    ("vocab_size", "vocab"),
    ("mrope_section", "mrope"),
    ("tie_word_embeddings", "tied"),
    ("rms_norm_eps", "rms_eps"),
    ("max_position_embeddings", "max_positions"),
];

fn sub_table<'b>(cx: &mut Cx<'_>, t: &mut Table<'b>, key: &'static str) -> Option<Table<'b>> {
    let (label, head, body) = t.section(cx, key)?;
    if let Some(l) = label {
        cx.error(
            Diagnostic::error("syntax", l.span, format!("`{key}` takes no name"))
                .with_help(format!("write `{key} {{ ... }}`")),
        );
    }
    Some(Table::from_body(
        cx,
        &format!("actor.{key}"),
        &format!("`{key}`"),
        head,
        body,
    ))
}

/// An empty table standing in for an absent section (so base values and missing keys flow
/// through the same code).
fn absent<'b>(path: &str, title: &str, span: Span) -> Table<'b> {
    static EMPTY: Body = Body {
        items: Vec::new(),
        broken: false,
    };
    let mut cx_dummy = Cx::new("");
    Table::from_body(&mut cx_dummy, path, title, span, &EMPTY)
}

fn vision(cx: &mut Cx<'_>, t: &mut Table<'_>, b: &Base, base: Option<VisionDims>) -> VisionDims {
    let span = t.span;
    let sub = sub_table(cx, t, "vision");
    let silent = Base {
        span: None,
        bad: true,
    };
    let b = if sub.is_none() && b.span.is_none() && !b.bad {
        t.missing_section(cx, "vision", "vision { depth = 32, hidden = 1280, heads = 16, ffn = 3420, full_attention = [7, 15, 23, 31] }");
        &silent
    } else {
        b
    };
    let mut v = sub.unwrap_or_else(|| absent("actor.vision", "`vision`", span));
    v.hints = VISION_HINTS;
    let bv = base.as_ref();
    let depth = v.count(cx, "depth", 1);
    let depth = b.pick(
        cx,
        &mut v,
        "depth",
        depth,
        bv.map(|x| x.depth),
        "vision blocks",
        "32",
        1,
    );
    let hidden = v.count(cx, "hidden", 1);
    let hidden = b.pick(
        cx,
        &mut v,
        "hidden",
        hidden,
        bv.map(|x| x.hidden_size),
        "vision width",
        "1280",
        1,
    );
    let heads = v.count(cx, "heads", 1);
    let heads = b.pick(
        cx,
        &mut v,
        "heads",
        heads,
        bv.map(|x| x.num_heads),
        "vision attention heads",
        "16",
        1,
    );
    let ffn = v.count(cx, "ffn", 1);
    let ffn = b.pick(
        cx,
        &mut v,
        "ffn",
        ffn,
        bv.map(|x| x.intermediate_size),
        "vision MLP width",
        "3420",
        1,
    );
    let patch = v.count(cx, "patch", 1);
    let patch = b.pick_default(cx, &mut v, "patch", patch, bv.map(|x| x.patch_size), 14);
    let tpatch = v.count(cx, "temporal_patch", 1);
    let tpatch = b.pick_default(
        cx,
        &mut v,
        "temporal_patch",
        tpatch,
        bv.map(|x| x.temporal_patch_size),
        2,
    );
    let merge = v.count(cx, "merge", 1);
    let merge = b.pick_default(
        cx,
        &mut v,
        "merge",
        merge,
        bv.map(|x| x.spatial_merge_size),
        2,
    );
    let window = v.count(cx, "window", 1);
    let window = b.pick_default(cx, &mut v, "window", window, bv.map(|x| x.window_size), 112);
    let full = v.typed(cx, "full_attention", |x, _| count_list(x, "full_attention"));
    let full = b.pick(
        cx,
        &mut v,
        "full_attention",
        full,
        bv.map(|x| x.fullatt_block_indexes.clone()),
        "indexes of full-attention blocks",
        "[7, 15, 23, 31]",
        vec![],
    );
    let inch = v.count(cx, "in_channels", 1);
    let inch = b.pick_default(
        cx,
        &mut v,
        "in_channels",
        inch,
        bv.map(|x| x.in_channels),
        3,
    );
    let out = v.count(cx, "out_hidden", 1);
    // 0 = "the text width", filled in by `text` below when not given
    let out = b.pick_default(
        cx,
        &mut v,
        "out_hidden",
        out,
        bv.map(|x| x.out_hidden_size),
        0,
    );
    v.finish(cx);
    VisionDims {
        depth,
        hidden_size: hidden,
        num_heads: heads,
        intermediate_size: ffn,
        patch_size: patch,
        temporal_patch_size: tpatch,
        spatial_merge_size: merge,
        window_size: window,
        fullatt_block_indexes: full,
        in_channels: inch,
        out_hidden_size: out,
    }
}

fn text(cx: &mut Cx<'_>, t: &mut Table<'_>, b: &Base, base: Option<&TextDims>) -> TextDims {
    let span = t.span;
    let sub = sub_table(cx, t, "text");
    let silent = Base {
        span: None,
        bad: true,
    };
    let b = if sub.is_none() && b.span.is_none() && !b.bad {
        t.missing_section(cx, "text", "text { layers = 36, hidden = 2048, heads = 16, kv_heads = 2, ffn = 11008, vocab = 151936, mrope = [16, 24, 24] }");
        &silent
    } else {
        b
    };
    let mut x = sub.unwrap_or_else(|| absent("actor.text", "`text`", span));
    x.hints = TEXT_HINTS;
    let layers = x.count(cx, "layers", 1);
    let layers = b.pick(
        cx,
        &mut x,
        "layers",
        layers,
        base.map(|d| d.num_layers),
        "decoder layers",
        "36",
        1,
    );
    let hidden = x.count(cx, "hidden", 1);
    let hidden = b.pick(
        cx,
        &mut x,
        "hidden",
        hidden,
        base.map(|d| d.hidden_size),
        "model width",
        "2048",
        1,
    );
    let heads = x.count(cx, "heads", 1);
    let heads = b.pick(
        cx,
        &mut x,
        "heads",
        heads,
        base.map(|d| d.num_heads),
        "attention heads",
        "16",
        1,
    );
    let kv = x.count(cx, "kv_heads", 1);
    let kv = b.pick(
        cx,
        &mut x,
        "kv_heads",
        kv,
        base.map(|d| d.num_kv_heads),
        "key/value heads",
        "2",
        1,
    );
    let ffn = x.count(cx, "ffn", 1);
    let ffn = b.pick(
        cx,
        &mut x,
        "ffn",
        ffn,
        base.map(|d| d.intermediate_size),
        "MLP width",
        "11008",
        1,
    );
    let vocab = x.count(cx, "vocab", 1);
    let vocab = b.pick(
        cx,
        &mut x,
        "vocab",
        vocab,
        base.map(|d| d.vocab_size),
        "vocabulary size",
        "151936",
        1,
    );
    let theta = x.float(cx, "rope_theta", f64::MIN_POSITIVE, f64::INFINITY);
    let theta = b.pick_default(
        cx,
        &mut x,
        "rope_theta",
        theta,
        base.map(|d| d.rope_theta),
        1e6,
    );
    let mrope = x.typed(cx, "mrope", |v, _| {
        let l = count_list(v, "mrope")?;
        <[u32; 3]>::try_from(l).map_err(|_| {
            (
                "expected three sections (temporal, height, width)".to_string(),
                Some("e.g. `mrope = [16, 24, 24]`".to_string()),
            )
        })
    });
    let mrope = b.pick(
        cx,
        &mut x,
        "mrope",
        mrope,
        base.map(|d| d.mrope_section),
        "M-RoPE sections, summing to head_dim / 2",
        "[16, 24, 24]",
        [0, 0, 0],
    );
    let tied = x.bool(cx, "tied");
    let tied = b.pick_default(
        cx,
        &mut x,
        "tied",
        tied,
        base.map(|d| d.tie_word_embeddings),
        false,
    );
    let eps = x.float(cx, "rms_eps", f64::MIN_POSITIVE, 1.0);
    let eps = b.pick_default(
        cx,
        &mut x,
        "rms_eps",
        eps,
        base.map(|d| d.rms_norm_eps),
        1e-6,
    );
    let maxp = x.count(cx, "max_positions", 1);
    let maxp = b.pick_default(
        cx,
        &mut x,
        "max_positions",
        maxp,
        base.map(|d| d.max_position_embeddings),
        128000,
    );
    x.finish(cx);
    TextDims {
        num_layers: layers,
        hidden_size: hidden,
        num_heads: heads,
        num_kv_heads: kv,
        intermediate_size: ffn,
        vocab_size: vocab,
        rope_theta: theta,
        mrope_section: mrope,
        tie_word_embeddings: tied,
        rms_norm_eps: eps,
        max_position_embeddings: maxp,
    }
}

fn tokens(
    cx: &mut Cx<'_>,
    t: &mut Table<'_>,
    b: &Base,
    base: Option<SpecialTokens>,
) -> SpecialTokens {
    let span = t.span;
    let mut x =
        sub_table(cx, t, "tokens").unwrap_or_else(|| absent("actor.tokens", "`tokens`", span));
    x.hints = &[
        ("image_token_id", "image"),
        ("video_token_id", "video"),
        ("vision_start_token_id", "vision_start"),
        ("vision_end_token_id", "vision_end"),
        ("eos_token_id", "eos"),
        ("eos_token_ids", "eos"),
    ];
    let d = base.unwrap_or_else(presets::qwen_tokens);
    let image = x.count(cx, "image", 0);
    let image = b.pick_default(
        cx,
        &mut x,
        "image",
        image,
        Some(d.image_token_id),
        d.image_token_id,
    );
    let video = x.count(cx, "video", 0);
    let video = b.pick_default(
        cx,
        &mut x,
        "video",
        video,
        Some(d.video_token_id),
        d.video_token_id,
    );
    let vs = x.count(cx, "vision_start", 0);
    let vs = b.pick_default(
        cx,
        &mut x,
        "vision_start",
        vs,
        Some(d.vision_start_token_id),
        d.vision_start_token_id,
    );
    let ve = x.count(cx, "vision_end", 0);
    let ve = b.pick_default(
        cx,
        &mut x,
        "vision_end",
        ve,
        Some(d.vision_end_token_id),
        d.vision_end_token_id,
    );
    let eos = x.typed(cx, "eos", |v, _| count_list(v, "eos"));
    let eos = b.pick_default(
        cx,
        &mut x,
        "eos",
        eos,
        Some(d.eos_token_ids.clone()),
        d.eos_token_ids,
    );
    x.finish(cx);
    SpecialTokens {
        image_token_id: image,
        video_token_id: video,
        vision_start_token_id: vs,
        vision_end_token_id: ve,
        eos_token_ids: eos,
    }
}
