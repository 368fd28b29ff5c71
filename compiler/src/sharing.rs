//! Parallelism-aware weight sharing: every actor parameter under the training TP layout and
//! the rollout TP layout of the same GPUs, classified as identical (the same memory), a view
//! (the rollout shard lies inside the local training shard: a slice or a strided view) or
//! incompatible (the rollout shard needs other GPUs' data and is rebuilt by the weight sync).
//!
//! Splits are Megatron-style: column-parallel linears (q/k/v, gate/up, the vision qkv and MLP
//! in, the merger's first linear) split their output rows by heads or features, row-parallel
//! linears (o_proj, down, the vision proj, the merger's second linear) split their input
//! columns, the embedding and the LM head split the vocabulary rows, norms and the biases of
//! row-parallel linears and the patch embedding are replicated: the same table as the runtime's
//! `tp::shard` (see [`shard`] for the ranges, uneven ones included: the vision MLP's 3,420
//! features at TP 8 split 428/427, and such ranges do not nest across TP degrees).
//!
//! Ranks: GPU `i` of a block of `max(train TP, rollout TP)` consecutive GPUs has a training
//! rank and a rollout rank. The group memberships are fixed by [`crate::topology`] (consecutive
//! GPUs); only the rank order inside the larger-TP side's groups is ours to choose. The
//! identity order (`i mod tp` on both sides) and the aligned order (the larger-TP side's rank
//! `k r + i div tp_small` for the smaller side's rank `r`, `k` the TP ratio) are both
//! classified and the one needing less extra memory is kept (ties: identity). With the aligned
//! order, a rollout TP at least the training TP makes every shard identical or a view; a
//! smaller rollout TP makes every split tensor incompatible, with the local training shard
//! inside the rollout shard (aliased in place) and the rest gathered.
//!
//! Invariant: per class and GPU, `aliased + extra == rollout bytes`; the totals are those of
//! the GPU of the block with the most extra bytes; the classes' element counts sum to
//! `ModelSpec::param_count`.
use rollplex_plan::spec::JobSpec;
use rollplex_plan::{ParamSharing, ShareClass, WeightSharing};

/// Which dimension of a `[rows, cols]` tensor TP splits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Axis {
    Rows,
    Cols,
}

/// How a parameter class is laid out and split.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamClass {
    pub name: String,
    pub count: u32,
    pub rows: u64,
    pub cols: u64,
    /// `None`: replicated under every TP.
    pub split: Option<SplitSpec>,
    pub trainable: bool,
}

/// `segments` blocks of `units` units of `unit` indices each along `axis` (fused q/k/v: 3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitSpec {
    pub axis: Axis,
    pub units: u64,
    pub unit: u64,
    pub segments: u64,
    /// `heads` or `features`/`vocab` (for the readable split).
    pub what: &'static str,
}

impl ParamClass {
    pub fn elements(&self) -> u64 {
        self.rows * self.cols * self.count as u64
    }

    fn split_text(&self) -> String {
        match self.split {
            None => "replicated".into(),
            Some(s) => format!(
                "{} by {} {}{}",
                match s.axis {
                    Axis::Rows => "rows",
                    Axis::Cols => "cols",
                },
                s.units,
                s.what,
                if s.segments > 1 {
                    format!(" x {} segments", s.segments)
                } else {
                    String::new()
                }
            ),
        }
    }
}

/// The parameter classes of the job's actor, as Hugging Face Qwen2.5-VL lays them out.
pub fn param_classes(spec: &JobSpec) -> Vec<ParamClass> {
    let m = &spec.actor;
    let v = &m.vision;
    let t = &m.text;
    let (vh, vi, vheads) = (
        v.hidden_size as u64,
        v.intermediate_size as u64,
        v.num_heads.max(1) as u64,
    );
    let vhd = vh / vheads;
    let patch_in = v.patch_dim();
    let depth = v.depth;
    let m2 = (v.spatial_merge_size as u64).pow(2);
    let mh = vh * m2;
    let out = v.out_hidden_size as u64;
    let (h, f, voc, layers) = (
        t.hidden_size as u64,
        t.intermediate_size as u64,
        t.vocab_size as u64,
        t.num_layers,
    );
    let hd = t.head_dim() as u64;
    let (nq, nkv) = (t.num_heads as u64, t.num_kv_heads as u64);
    let vis = !spec.train.freeze_vision;
    let mer = !spec.train.freeze_merger;
    let rows = |units: u64, unit: u64, segments: u64, what| {
        Some(SplitSpec {
            axis: Axis::Rows,
            units,
            unit,
            segments,
            what,
        })
    };
    let cols = |units: u64, unit: u64, what| {
        Some(SplitSpec {
            axis: Axis::Cols,
            units,
            unit,
            segments: 1,
            what,
        })
    };
    let p = |name: &str, count: u32, r: u64, c: u64, split, trainable| ParamClass {
        name: name.into(),
        count,
        rows: r,
        cols: c,
        split,
        trainable,
    };
    let mut v = vec![
        p("visual.patch_embed.proj.weight", 1, vh, patch_in, None, vis),
        p(
            "visual.blocks.*.norm{1,2}.weight",
            2 * depth,
            vh,
            1,
            None,
            vis,
        ),
        p(
            "visual.blocks.*.attn.qkv.weight",
            depth,
            3 * vh,
            vh,
            rows(vheads, vhd, 3, "heads"),
            vis,
        ),
        p(
            "visual.blocks.*.attn.qkv.bias",
            depth,
            3 * vh,
            1,
            rows(vheads, vhd, 3, "heads"),
            vis,
        ),
        p(
            "visual.blocks.*.attn.proj.weight",
            depth,
            vh,
            vh,
            cols(vheads, vhd, "heads"),
            vis,
        ),
        p("visual.blocks.*.attn.proj.bias", depth, vh, 1, None, vis),
        p(
            "visual.blocks.*.mlp.{gate,up}_proj.weight",
            2 * depth,
            vi,
            vh,
            rows(vi, 1, 1, "features"),
            vis,
        ),
        p(
            "visual.blocks.*.mlp.{gate,up}_proj.bias",
            2 * depth,
            vi,
            1,
            rows(vi, 1, 1, "features"),
            vis,
        ),
        p(
            "visual.blocks.*.mlp.down_proj.weight",
            depth,
            vh,
            vi,
            cols(vi, 1, "features"),
            vis,
        ),
        p(
            "visual.blocks.*.mlp.down_proj.bias",
            depth,
            vh,
            1,
            None,
            vis,
        ),
        p("visual.merger.ln_q.weight", 1, vh, 1, None, mer),
        p(
            "visual.merger.mlp.0.weight",
            1,
            mh,
            mh,
            rows(mh, 1, 1, "features"),
            mer,
        ),
        p(
            "visual.merger.mlp.0.bias",
            1,
            mh,
            1,
            rows(mh, 1, 1, "features"),
            mer,
        ),
        p(
            "visual.merger.mlp.2.weight",
            1,
            out,
            mh,
            cols(mh, 1, "features"),
            mer,
        ),
        p("visual.merger.mlp.2.bias", 1, out, 1, None, mer),
        p(
            "model.embed_tokens.weight",
            1,
            voc,
            h,
            rows(voc, 1, 1, "vocab"),
            true,
        ),
        p(
            "model.layers.*.{input,post_attention}_layernorm.weight",
            2 * layers,
            h,
            1,
            None,
            true,
        ),
        p(
            "model.layers.*.self_attn.q_proj.weight",
            layers,
            nq * hd,
            h,
            rows(nq, hd, 1, "heads"),
            true,
        ),
        p(
            "model.layers.*.self_attn.q_proj.bias",
            layers,
            nq * hd,
            1,
            rows(nq, hd, 1, "heads"),
            true,
        ),
        p(
            "model.layers.*.self_attn.{k,v}_proj.weight",
            2 * layers,
            nkv * hd,
            h,
            rows(nkv, hd, 1, "kv heads"),
            true,
        ),
        p(
            "model.layers.*.self_attn.{k,v}_proj.bias",
            2 * layers,
            nkv * hd,
            1,
            rows(nkv, hd, 1, "kv heads"),
            true,
        ),
        p(
            "model.layers.*.self_attn.o_proj.weight",
            layers,
            h,
            nq * hd,
            cols(nq, hd, "heads"),
            true,
        ),
        p(
            "model.layers.*.mlp.{gate,up}_proj.weight",
            2 * layers,
            f,
            h,
            rows(f, 1, 1, "features"),
            true,
        ),
        p(
            "model.layers.*.mlp.down_proj.weight",
            layers,
            h,
            f,
            cols(f, 1, "features"),
            true,
        ),
        p("model.norm.weight", 1, h, 1, None, true),
    ];
    if !t.tie_word_embeddings {
        v.push(p(
            "lm_head.weight",
            1,
            voc,
            h,
            rows(voc, 1, 1, "vocab"),
            true,
        ));
    }
    v.retain(|c| c.elements() > 0);
    v
}

/// Index ranges `[a, b)` along the split axis that rank `r` of TP `tp` holds, as the
/// runtime's `tp::shard` splits (`runtime/src/tp/shard.rs`): the `r`-th of `tp` contiguous
/// unit ranges whose sizes differ by at most one (the first ones larger) when there are at
/// least `tp` units; one unit, `r units / tp`, replicated over `tp / units` ranks when the
/// units divide `tp`; the whole tensor otherwise (the DSL rejects such degrees).
pub fn shard(s: &SplitSpec, tp: u32, r: u32) -> Vec<(u64, u64)> {
    let (tp, r) = (tp.max(1) as u64, r as u64);
    let (a, b) = if s.units >= tp {
        let (base, rem) = (s.units / tp, s.units % tp);
        let a = r * base + r.min(rem);
        (a, a + base + u64::from(r < rem))
    } else if tp % s.units == 0 {
        let u = r * s.units / tp;
        (u, u + 1)
    } else {
        (0, s.units)
    };
    let seg = s.units * s.unit;
    (0..s.segments)
        .map(|k| (k * seg + a * s.unit, k * seg + b * s.unit))
        .collect()
}

fn len(r: &[(u64, u64)]) -> u64 {
    r.iter().map(|(a, b)| b - a).sum()
}

/// Whether every range of `inner` lies inside one range of `outer`.
fn within(inner: &[(u64, u64)], outer: &[(u64, u64)]) -> bool {
    inner
        .iter()
        .all(|&(a, b)| outer.iter().any(|&(c, d)| c <= a && b <= d))
}

/// One class on one GPU: (class, train, rollout, aliased) elements or bytes.
type Entry = (ShareClass, u64, u64, u64);

/// One class on one GPU: (class, train elements, rollout elements, aliased elements).
pub fn classify(
    c: &ParamClass,
    train: (u32, u32),
    rollout: (u32, u32),
) -> (ShareClass, u64, u64, u64) {
    let per = c.rows * c.cols;
    let Some(s) = c.split else {
        return (ShareClass::Identical, per, per, per);
    };
    let other = match s.axis {
        Axis::Rows => c.cols,
        Axis::Cols => c.rows,
    };
    let t = shard(&s, train.0, train.1);
    let r = shard(&s, rollout.0, rollout.1);
    let (te, re) = (len(&t) * other, len(&r) * other);
    let class = if t == r {
        ShareClass::Identical
    } else if within(&r, &t) {
        // Rows of a row-major tensor are contiguous when the slice is one range; columns or
        // several segments need a stride.
        if s.axis == Axis::Rows && r.len() == 1 {
            ShareClass::SliceView
        } else {
            ShareClass::StridedView
        }
    } else {
        ShareClass::Incompatible
    };
    let aliased = match class {
        ShareClass::Incompatible if within(&t, &r) => te,
        ShareClass::Incompatible => 0,
        _ => re,
    };
    (class, te, re, aliased)
}

/// Training and rollout rank of each GPU of a block, identity order.
pub fn identity_ranks(train_tp: u32, rollout_tp: u32) -> (Vec<u32>, Vec<u32>) {
    let n = train_tp.max(rollout_tp).max(1);
    (
        (0..n).map(|i| i % train_tp.max(1)).collect(),
        (0..n).map(|i| i % rollout_tp.max(1)).collect(),
    )
}

/// The aligned order: the larger-TP side's rank is `k r + i div tp_small` for the smaller
/// side's rank `r = i mod tp_small`, so each larger-TP shard lies inside the local
/// smaller-TP shard (or contains it).
pub fn aligned_ranks(train_tp: u32, rollout_tp: u32) -> (Vec<u32>, Vec<u32>) {
    let (t, r) = (train_tp.max(1), rollout_tp.max(1));
    let n = t.max(r);
    let (small, k) = (t.min(r), t.max(r) / t.min(r));
    let small_rank: Vec<u32> = (0..n).map(|i| i % small).collect();
    let big_rank: Vec<u32> = (0..n).map(|i| k * (i % small) + i / small).collect();
    if t <= r {
        (small_rank, big_rank)
    } else {
        (big_rank, small_rank)
    }
}

/// The sharing report under given rank orders; element counts times `dtype_bytes`.
pub fn report(
    classes: &[ParamClass],
    train_tp: u32,
    rollout_tp: u32,
    train_rank: &[u32],
    rollout_rank: &[u32],
    dtype_bytes: u64,
) -> WeightSharing {
    let n = train_rank.len().min(rollout_rank.len());
    // Per GPU of the block: (class entries, totals).
    let per_gpu: Vec<Vec<Entry>> = (0..n)
        .map(|i| {
            classes
                .iter()
                .map(|c| {
                    let (cl, te, re, al) =
                        classify(c, (train_tp, train_rank[i]), (rollout_tp, rollout_rank[i]));
                    let k = c.count as u64 * dtype_bytes;
                    (cl, te * k, re * k, al * k)
                })
                .collect()
        })
        .collect();
    let extra_of = |g: &Vec<Entry>| -> u64 { g.iter().map(|&(_, _, re, al)| re - al).sum() };
    // The GPU with the most extra bytes (first on ties) sets the totals.
    let worst = (0..n)
        .max_by(|&a, &b| {
            extra_of(&per_gpu[a])
                .cmp(&extra_of(&per_gpu[b]))
                .then(b.cmp(&a))
        })
        .unwrap_or(0);
    let params: Vec<ParamSharing> = classes
        .iter()
        .enumerate()
        .map(|(ci, c)| {
            // Per class: the worst class over the block's GPUs, bytes of the GPU that needs
            // the most extra for it.
            let g = (0..n)
                .max_by(|&a, &b| {
                    let ea = per_gpu[a][ci].2 - per_gpu[a][ci].3;
                    let eb = per_gpu[b][ci].2 - per_gpu[b][ci].3;
                    ea.cmp(&eb)
                        .then(per_gpu[a][ci].0.cmp(&per_gpu[b][ci].0))
                        .then(b.cmp(&a))
                })
                .unwrap_or(0);
            let (class, te, re, al) = per_gpu[g][ci];
            ParamSharing {
                name: c.name.clone(),
                count: c.count,
                split: c.split_text(),
                class,
                trainable: c.trainable,
                train_bytes: te,
                rollout_bytes: re,
                aliased_bytes: al,
                extra_bytes: re - al,
            }
        })
        .collect();
    let w = per_gpu.get(worst);
    let sum = |f: &dyn Fn(usize, &Entry) -> u64| -> u64 {
        w.map(|g| g.iter().enumerate().map(|(ci, e)| f(ci, e)).sum())
            .unwrap_or(0)
    };
    WeightSharing {
        train_tp,
        rollout_tp,
        train_rank: train_rank[..n].to_vec(),
        rollout_rank: rollout_rank[..n].to_vec(),
        params,
        rollout_bytes: sum(&|_, e| e.2),
        aliased_bytes: sum(&|_, e| e.3),
        extra_bytes: sum(&|_, e| e.2 - e.3),
        resharded_bytes: sum(&|ci, e| {
            if classes[ci].trainable {
                e.2 - e.3
            } else {
                0
            }
        }),
        frozen_rebuilt: false,
        reshard_point: Default::default(),
    }
}

/// The job's sharing report: both rank orders classified, the one with less extra memory
/// kept (ties: identity).
pub fn analyse(spec: &JobSpec) -> WeightSharing {
    let classes = param_classes(spec);
    let (t, r) = (spec.train.tp.max(1), spec.rollout.tp.max(1));
    let db = spec.actor.dtype.bytes();
    let (it, ir) = identity_ranks(t, r);
    let id = report(&classes, t, r, &it, &ir, db);
    let (at, ar) = aligned_ranks(t, r);
    let al = report(&classes, t, r, &at, &ar, db);
    if al.extra_bytes < id.extra_bytes {
        al
    } else {
        id
    }
}

/// Training-layout weight bytes of one GPU (the largest over the block's ranks).
pub fn train_bytes(spec: &JobSpec) -> u64 {
    layout_bytes(spec, spec.train.tp)
}

/// Bytes of one GPU's shard of every parameter under TP `tp` (the largest over ranks).
pub fn layout_bytes(spec: &JobSpec, tp: u32) -> u64 {
    let db = spec.actor.dtype.bytes();
    let classes = param_classes(spec);
    (0..tp.max(1))
        .map(|r| {
            classes
                .iter()
                .map(|c| {
                    let per = match c.split {
                        None => c.rows * c.cols,
                        Some(s) => {
                            let other = match s.axis {
                                Axis::Rows => c.cols,
                                Axis::Cols => c.rows,
                            };
                            len(&shard(&s, tp, r)) * other
                        }
                    };
                    per * c.count as u64 * db
                })
                .sum::<u64>()
        })
        .max()
        .unwrap_or(0)
}

/// Shared fraction of the rollout layout: aliased bytes over a separate copy's bytes.
pub fn shared_fraction(w: &WeightSharing) -> f64 {
    if w.rollout_bytes == 0 {
        1.0
    } else {
        w.aliased_bytes as f64 / w.rollout_bytes as f64
    }
}

/// Fraction of the rollout layout's bytes in parameter classes that are wholly shared
/// (identical or a view).
pub fn shared_class_fraction(w: &WeightSharing) -> f64 {
    let shared: u64 = w
        .params
        .iter()
        .filter(|p| p.class.shared())
        .map(|p| p.rollout_bytes)
        .sum();
    if w.rollout_bytes == 0 {
        1.0
    } else {
        shared as f64 / w.rollout_bytes as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{job, paper_job, QwenSize};

    fn with_tp(train: u32, rollout: u32, size: Option<QwenSize>) -> JobSpec {
        let mut s = match size {
            Some(q) => paper_job(q),
            None => job(|_| {}),
        };
        s.train.tp = train;
        s.rollout.tp = rollout;
        s
    }

    #[test]
    fn classes_cover_every_parameter() {
        for size in [QwenSize::B7, QwenSize::B32] {
            let s = paper_job(size);
            let n: u64 = param_classes(&s).iter().map(|c| c.elements()).sum();
            assert_eq!(n, s.actor.param_count().total(), "{size:?}");
        }
        let s = job(|_| {});
        let n: u64 = param_classes(&s).iter().map(|c| c.elements()).sum();
        assert_eq!(n, s.actor.param_count().total());
    }

    #[test]
    fn equal_tp_is_all_identical() {
        for tp in [1, 2, 4] {
            let w = analyse(&with_tp(tp, tp, Some(QwenSize::B7)));
            assert!(w.params.iter().all(|p| p.class == ShareClass::Identical));
            assert_eq!(w.extra_bytes, 0);
            assert_eq!(w.aliased_bytes, w.rollout_bytes);
            assert_eq!(shared_fraction(&w), 1.0);
            assert_eq!(
                w.rollout_bytes,
                train_bytes(&with_tp(tp, tp, Some(QwenSize::B7)))
            );
        }
    }

    /// Hand-computed: 28 q heads of 128 rows, train TP 2 (14 heads per rank), rollout TP 4
    /// (7 heads). Identity order: GPU 1 holds train heads 14..28 but rolls out heads 7..14.
    #[test]
    fn worked_case_q_proj_train2_rollout4() {
        let s = SplitSpec {
            axis: Axis::Rows,
            units: 28,
            unit: 128,
            segments: 1,
            what: "heads",
        };
        assert_eq!(shard(&s, 2, 1), vec![(14 * 128, 28 * 128)]);
        assert_eq!(shard(&s, 4, 1), vec![(7 * 128, 14 * 128)]);
        let c = ParamClass {
            name: "q".into(),
            count: 1,
            rows: 28 * 128,
            cols: 3584,
            split: Some(s),
            trainable: true,
        };
        // identity order, GPU 1: not local.
        assert_eq!(
            classify(&c, (2, 1), (4, 1)),
            (ShareClass::Incompatible, 14 * 128 * 3584, 7 * 128 * 3584, 0)
        );
        // aligned order: GPU 1 rolls out as rank 2 (heads 14..21) inside its heads 14..28.
        let (tr, rr) = aligned_ranks(2, 4);
        assert_eq!(
            (tr.clone(), rr.clone()),
            (vec![0, 1, 0, 1], vec![0, 2, 1, 3])
        );
        for i in 0..4 {
            let (cl, _, re, al) = classify(&c, (2, tr[i]), (4, rr[i]));
            assert_eq!(cl, ShareClass::SliceView);
            assert_eq!(re, al);
        }
        // o_proj (columns): a strided view.
        let o = ParamClass {
            split: Some(SplitSpec {
                axis: Axis::Cols,
                ..s
            }),
            rows: 3584,
            cols: 28 * 128,
            ..c.clone()
        };
        assert_eq!(classify(&o, (2, 1), (4, 2)).0, ShareClass::StridedView);
        // rollout TP 1 replica over train TP 2: the local half is aliased, the rest gathered.
        let (cl, te, re, al) = classify(&c, (2, 1), (1, 0));
        assert_eq!(cl, ShareClass::Incompatible);
        assert_eq!((te, re, al), (re / 2, 28 * 128 * 3584, re / 2));
    }

    #[test]
    fn kv_heads_fewer_than_ranks_replicate() {
        let s = SplitSpec {
            axis: Axis::Rows,
            units: 4,
            unit: 128,
            segments: 1,
            what: "kv heads",
        };
        // TP 8 over 4 kv heads: ranks 2k and 2k+1 hold head k.
        assert_eq!(shard(&s, 8, 5), vec![(2 * 128, 3 * 128)]);
        // Vision MLP 3420 features over 8: 428 for ranks 0-3, 427 after (as the runtime).
        let v = SplitSpec {
            units: 3420,
            unit: 1,
            what: "features",
            ..s
        };
        assert_eq!(shard(&v, 8, 3), vec![(1284, 1712)]);
        assert_eq!(shard(&v, 8, 4), vec![(1712, 2139)]);
        // ... which does not nest in the 855-wide ranges of TP 4: rank 1's 428..856 crosses
        // the TP-4 boundary at 855.
        assert_eq!(shard(&v, 4, 0), vec![(0, 855)]);
        assert!(!within(&shard(&v, 8, 1), &shard(&v, 4, 0)));
        // fused qkv of 16 heads at TP 4, rank 1: heads 4..8 of each segment.
        let q = SplitSpec {
            units: 16,
            unit: 80,
            segments: 3,
            ..s
        };
        assert_eq!(
            shard(&q, 4, 1),
            vec![
                (320, 640),
                (1280 + 320, 1280 + 640),
                (2560 + 320, 2560 + 640)
            ]
        );
    }

    #[test]
    fn rollout_tp_above_train_tp_shares_everything_with_aligned_ranks() {
        let w = analyse(&with_tp(2, 4, Some(QwenSize::B7)));
        assert_eq!(w.extra_bytes, 0, "{w:#?}");
        assert_eq!(w.rollout_rank, vec![0, 2, 1, 3]);
        let id = {
            let c = param_classes(&with_tp(2, 4, Some(QwenSize::B7)));
            let (t, r) = identity_ranks(2, 4);
            report(&c, 2, 4, &t, &r, 2)
        };
        assert!(id.extra_bytes > 0);
    }

    #[test]
    fn rollout_tp_below_train_tp_aliases_the_local_shard() {
        let s = with_tp(8, 4, Some(QwenSize::B32));
        let w = analyse(&s);
        assert_eq!(w.aliased_bytes + w.extra_bytes, w.rollout_bytes);
        assert_eq!(w.rollout_bytes, layout_bytes(&s, 4));
        // Every split text tensor is incompatible; its local half is aliased.
        let q = w
            .params
            .iter()
            .find(|p| p.name.contains("q_proj.weight"))
            .unwrap();
        assert_eq!(q.class, ShareClass::Incompatible);
        assert_eq!(q.aliased_bytes * 2, q.rollout_bytes);
        // Frozen vision and merger are not resharded per iteration.
        let frozen: u64 = w
            .params
            .iter()
            .filter(|p| !p.trainable)
            .map(|p| p.extra_bytes)
            .sum();
        assert_eq!(w.resharded_bytes + frozen, w.extra_bytes);
        assert!(frozen > 0);
    }

    /// The 7B paper setting (train TP 4, rollout TP 2): every split dimension divides by 4,
    /// so each split tensor's rollout shard is half the tensor and its local training shard a
    /// quarter: extra = (params - replicated) / 4, counted by hand from the dims.
    #[test]
    fn paper_7b_extra_is_a_quarter_of_the_split_parameters() {
        let s = paper_job(QwenSize::B7);
        assert_eq!((s.train.tp, s.rollout.tp), (4, 2));
        let (v, t) = (&s.actor.vision, &s.actor.text);
        let (vh, h) = (v.hidden_size as u64, t.hidden_size as u64);
        let patch = v.patch_dim();
        // per block: norm1, norm2, attn.proj bias, mlp.down bias; merger ln_q and mlp.2 bias;
        // text: two norms per layer and the final norm.
        let replicated = patch * vh
            + v.depth as u64 * 4 * vh
            + vh
            + v.out_hidden_size as u64
            + (2 * t.num_layers as u64 + 1) * h;
        let total = s.actor.param_count().total();
        let w = analyse(&s);
        assert_eq!(w.extra_bytes, (total - replicated) * 2 / 4);
        assert_eq!(
            w.rollout_bytes,
            (total - replicated) * 2 / 2 + replicated * 2
        );
        assert!(w
            .params
            .iter()
            .all(|p| (p.split == "replicated") == p.class.shared()));
    }

    /// The plan's weight sync moves exactly the incompatible trainable tensors' extra bytes,
    /// and the rollout buffers hold exactly the extra bytes.
    #[test]
    fn plan_reshard_covers_the_incompatible_set() {
        use rollplex_plan::spec::Mode;
        use rollplex_plan::{Op, ReshardWhat};
        let spec = paper_job(QwenSize::B32);
        let opts = crate::Options {
            mode: Some(Mode::Serial),
            ..Default::default()
        };
        let plan = crate::compile(&spec, &opts).unwrap().plan;
        let w = plan.weight_sharing.as_ref().expect("colocated plans share");
        assert!(w.resharded_bytes > 0);
        let r = plan
            .reshards
            .iter()
            .find(|r| r.what == ReshardWhat::Weights)
            .unwrap();
        assert_eq!(r.bytes_moved, w.resharded_bytes);
        let incompatible_trainable: u64 = w
            .params
            .iter()
            .filter(|p| p.trainable && p.class == ShareClass::Incompatible)
            .map(|p| p.extra_bytes)
            .sum();
        assert_eq!(incompatible_trainable, w.resharded_bytes);
        let sync = plan
            .tasks
            .iter()
            .find(|t| matches!(t.op, Op::WeightSync { .. }))
            .unwrap();
        assert_eq!(sync.work.net_bytes, w.resharded_bytes as f64);
        let rollout: u64 = plan
            .buffers
            .iter()
            .filter(|b| b.class == rollplex_plan::BufferClass::RolloutWeights)
            .map(|b| b.bytes)
            .sum();
        assert_eq!(rollout, w.extra_bytes);
        // Disaggregated plans keep a separate copy and carry no sharing report.
        let opts = crate::Options {
            mode: Some(Mode::Disaggregated),
            ..Default::default()
        };
        let plan = crate::compile(&spec, &opts).unwrap().plan;
        assert!(plan.weight_sharing.is_none());
    }
}
