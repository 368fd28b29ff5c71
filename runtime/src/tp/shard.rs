//! Megatron-style sharding of Qwen2.5-VL weights for tensor-parallel degree `T`, and its inverse.
//!
//! Which part of a parameter each rank holds is the parameter's [`ShardRule`], set in the one
//! parameter table (`model::weights::build_table`); [`TpPlan::new`] checks that a config splits
//! (errors name the dimension and the fix) and turns every rule into each rank's [`Split`]:
//!
//! | parameter | split |
//! |---|---|
//! | text q_proj (w, b) | column-parallel: rows of the rank's `heads / T` query heads |
//! | text k_proj, v_proj (w, b) | column-parallel over kv heads when `T` divides them; when `T` is a multiple of the kv heads, each rank holds the one kv head its query heads read (replicated on `T / kv` ranks, as Megatron does) |
//! | text o_proj | row-parallel: the rank's query-head columns; the all-reduce follows |
//! | gate_proj, up_proj (w, b) | column-parallel: a contiguous range of the intermediate rows |
//! | down_proj | row-parallel: the same range of columns; a bias is replicated and added once after the all-reduce |
//! | vision fused qkv (w, b) | the rank's heads' rows of each of the q, k and v thirds |
//! | vision attn.proj | row-parallel (bias replicated) |
//! | merger mlp.0 / mlp.2 | column-parallel / row-parallel (bias of mlp.2 replicated) |
//! | embed_tokens, lm_head | vocab-parallel: a contiguous range of vocabulary rows (tied: the same rows) |
//! | norms, patch_embed | replicated |
//!
//! Ranges of the intermediate, merger and vocabulary dimensions may be uneven (sizes differ by
//! at most one; rank `r` gets the `r`-th): every collective over them reduces scalars or the
//! hidden width. Heads must divide evenly (query heads of both towers; kv heads either way).
//!
//! Invariants: a rank's shard is a [`Weights`] whose table has every parameter of the full
//! model, in the same order (so `ParamId`s agree across ranks and with the full model), with the
//! same Hugging Face names and the rank's shapes; `unshard(shard(w))` is `w` bitwise; replicated
//! parameters (and replicated kv heads) must be bitwise equal on every rank that holds them,
//! which `unshard` checks.

use std::collections::HashMap;
use std::ops::Range;

use crate::model::weights::{build_table, ParamId, ParamTable, ShardRule, TpDim};
use crate::model::{ModelConfig, Weights};

use super::TpError;

/// Which part of one parameter a rank holds. `Rows` ranges index the first dimension (a row is
/// the product of the other dimensions); `Cols` indexes the second dimension of a `[out, in]`
/// matrix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Split {
    Replicated,
    /// The listed row ranges, concatenated in this order.
    Rows(Vec<Range<usize>>),
    Cols(Range<usize>),
}

/// The `r`-th of `t` contiguous ranges of `0..n` (sizes differ by at most one).
pub fn split_range(n: usize, t: usize, r: usize) -> Range<usize> {
    let (base, rem) = (n / t, n % t);
    let start = r * base + r.min(rem);
    start..start + base + usize::from(r < rem)
}

/// One rank's widths: what its forward reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankDims {
    /// Text query heads and kv heads of this rank.
    pub q_heads: usize,
    pub kv_heads: usize,
    /// Text MLP intermediate rows.
    pub ffn: Range<usize>,
    /// Vocabulary ids this rank owns (embedding rows and lm-head rows).
    pub vocab: Range<usize>,
    pub vision_heads: usize,
    pub vision_ffn: Range<usize>,
    /// Merger hidden rows (`mlp.0` outputs).
    pub merger: Range<usize>,
}

impl RankDims {
    /// The widths of the whole model: what rank 0 of a group of one holds.
    pub fn whole(config: &ModelConfig) -> Self {
        let (t, v) = (config.text(), config.vision());
        let m2 = (v.spatial_merge_size * v.spatial_merge_size) as usize;
        RankDims {
            q_heads: t.num_heads as usize,
            kv_heads: t.num_kv_heads as usize,
            ffn: 0..t.intermediate_size as usize,
            vocab: 0..t.vocab_size as usize,
            vision_heads: v.num_heads as usize,
            vision_ffn: 0..v.intermediate_size as usize,
            merger: 0..v.hidden_size as usize * m2,
        }
    }
}

/// How a model is split over `degree` ranks.
#[derive(Clone, Debug)]
pub struct TpPlan {
    pub config: ModelConfig,
    pub degree: usize,
    /// `true` when the kv heads are fewer than the ranks (each replicated on `degree / kv` ranks).
    pub kv_replicated: bool,
    /// `splits[rank][param]`.
    splits: Vec<Vec<Split>>,
    dims: Vec<RankDims>,
    full: ParamTable,
}

impl TpPlan {
    /// Checks that `config` splits over `degree` ranks and records every parameter's split.
    pub fn new(config: &ModelConfig, degree: usize) -> Result<Self, TpError> {
        config.validate()?;
        let (t, v) = (config.text(), config.vision());
        let mut errs = Vec::new();
        if degree == 0 {
            return Err(TpError::Config(
                "tensor-parallel degree must be at least 1".into(),
            ));
        }
        let (nq, nkv) = (t.num_heads as usize, t.num_kv_heads as usize);
        if !nq.is_multiple_of(degree) {
            errs.push(format!(
                "text num_heads {nq} is not divisible by the TP degree {degree} (use a degree that divides it)"
            ));
        }
        let kv_replicated = nkv < degree;
        if !nkv.is_multiple_of(degree) && !degree.is_multiple_of(nkv) {
            errs.push(format!(
                "text num_kv_heads {nkv} neither divides by nor divides the TP degree {degree} \
                 (kv heads are split when the degree divides them, replicated when they divide the degree)"
            ));
        }
        let vh = v.num_heads as usize;
        if !vh.is_multiple_of(degree) {
            errs.push(format!(
                "vision num_heads {vh} is not divisible by the TP degree {degree}"
            ));
        }
        let m2 = (v.spatial_merge_size * v.spatial_merge_size) as usize;
        let mh = v.hidden_size as usize * m2;
        for (name, n) in [
            ("text intermediate_size", t.intermediate_size as usize),
            ("text vocab_size", t.vocab_size as usize),
            ("vision intermediate_size", v.intermediate_size as usize),
            ("merger hidden size", mh),
        ] {
            if n < degree {
                errs.push(format!(
                    "{name} {n} is smaller than the TP degree {degree}: some rank would hold nothing"
                ));
            }
        }
        if !errs.is_empty() {
            return Err(TpError::Config(errs.join("; ")));
        }
        let (full, _) = build_table(config);
        let hd = t.head_dim() as usize;
        let vhd = config.vision_head_dim();
        let mut splits = Vec::with_capacity(degree);
        let mut dims = Vec::with_capacity(degree);
        for r in 0..degree {
            let q_heads = nq / degree;
            let qrows = r * q_heads * hd..(r + 1) * q_heads * hd;
            let (kv_heads, kvrows) = if kv_replicated {
                // the kv head that this rank's query heads read: q head h reads h / (nq / nkv)
                let head = r * q_heads / (nq / nkv);
                (1, head * hd..(head + 1) * hd)
            } else {
                let n = nkv / degree;
                (n, r * n * hd..(r + 1) * n * hd)
            };
            let d = RankDims {
                q_heads,
                kv_heads,
                ffn: split_range(t.intermediate_size as usize, degree, r),
                vocab: split_range(t.vocab_size as usize, degree, r),
                vision_heads: vh / degree,
                vision_ffn: split_range(v.intermediate_size as usize, degree, r),
                merger: split_range(mh, degree, r),
            };
            let vq = r * d.vision_heads * vhd..(r + 1) * d.vision_heads * vhd;
            // the rank's rows (or columns) of each width the table's rules name
            let range = |dim: TpDim| match dim {
                TpDim::Heads => qrows.clone(),
                TpDim::KvHeads => kvrows.clone(),
                TpDim::Ffn => d.ffn.clone(),
                TpDim::Vocab => d.vocab.clone(),
                TpDim::VisionHeads => vq.clone(),
                TpDim::VisionFfn => d.vision_ffn.clone(),
                TpDim::Merger => d.merger.clone(),
            };
            let s: Vec<Split> = full
                .entries()
                .iter()
                .map(|e| match e.shard {
                    ShardRule::Replicated => Split::Replicated,
                    ShardRule::Rows { dim, parts } => {
                        let (rg, block) = (range(dim), e.shape[0] / parts);
                        Split::Rows(
                            (0..parts)
                                .map(|p| p * block + rg.start..p * block + rg.end)
                                .collect(),
                        )
                    }
                    ShardRule::Cols(dim) => Split::Cols(range(dim)),
                })
                .collect();
            splits.push(s);
            dims.push(d);
        }
        Ok(TpPlan {
            config: config.clone(),
            degree,
            kv_replicated,
            splits,
            dims,
            full,
        })
    }

    pub fn dims(&self, rank: usize) -> &RankDims {
        &self.dims[rank]
    }

    /// Whether `rank` counts parameter `id` in a global sum over the model's elements (a
    /// gradient norm): every rank its own part, a replicated parameter on rank 0 only, a
    /// replicated kv head on the first rank that holds it.
    pub fn counts_once(&self, rank: usize, id: ParamId) -> bool {
        match &self.splits[rank][id.0 as usize] {
            Split::Replicated => rank == 0,
            sp => (0..rank).all(|r| &self.splits[r][id.0 as usize] != sp),
        }
    }

    /// The split of parameter `id` on `rank`.
    pub fn split(&self, rank: usize, id: ParamId) -> &Split {
        &self.splits[rank][id.0 as usize]
    }

    fn check_rank(&self, rank: usize) -> Result<(), TpError> {
        if rank >= self.degree {
            return Err(TpError::Config(format!(
                "rank {rank} outside a TP group of {}",
                self.degree
            )));
        }
        Ok(())
    }

    /// Rank `rank`'s shard of full weights `w` (built for this plan's config).
    pub fn shard(&self, w: &Weights, rank: usize) -> Result<Weights, TpError> {
        self.check_rank(rank)?;
        if w.table != self.full {
            return Err(TpError::Config(
                "shard: the weights were built for another configuration".into(),
            ));
        }
        let mut table = ParamTable {
            entries: Vec::new(),
            by_name: HashMap::new(),
            total: 0,
        };
        let mut data = Vec::new();
        for (i, e) in self.full.entries().iter().enumerate() {
            let src = &w.data[e.offset..e.offset + e.len];
            let sp = &self.splits[rank][i];
            let (shape, part) = cut(&e.shape, src, sp);
            table.push(e.name.clone(), shape, e.init, e.shard);
            data.extend_from_slice(&part);
        }
        let layout = self.local_layout(w, rank);
        Ok(Weights {
            table,
            layout,
            data,
        })
    }

    /// Rank `rank`'s layout: the full layout with each linear's local widths.
    fn local_layout(&self, w: &Weights, rank: usize) -> crate::model::Layout {
        let d = &self.dims[rank];
        let t = self.config.text();
        let hd = t.head_dim() as usize;
        let vhd = self.config.vision_head_dim();
        let mut l = w.layout.clone();
        for b in &mut l.vision_blocks {
            let n = d.vision_heads * vhd;
            for (p, lin) in [&mut b.q, &mut b.k, &mut b.v].into_iter().enumerate() {
                lin.out = n;
                lin.row0 = p * n;
            }
            b.o.inp = n;
            b.gate.out = d.vision_ffn.len();
            b.up.out = d.vision_ffn.len();
            b.down.inp = d.vision_ffn.len();
        }
        l.merger_fc1.out = d.merger.len();
        l.merger_fc2.inp = d.merger.len();
        for b in &mut l.text_layers {
            b.q.out = d.q_heads * hd;
            b.k.out = d.kv_heads * hd;
            b.v.out = d.kv_heads * hd;
            b.o.inp = d.q_heads * hd;
            b.gate.out = d.ffn.len();
            b.up.out = d.ffn.len();
            b.down.inp = d.ffn.len();
        }
        l
    }

    /// Gathers shards (one per rank, in rank order) back into full weights in Hugging Face
    /// layout. Replicated parameters and replicated kv heads must agree bitwise across the
    /// ranks holding them; the error names the first that does not.
    pub fn unshard(&self, shards: &[Weights]) -> Result<Weights, TpError> {
        if shards.len() != self.degree {
            return Err(TpError::Config(format!(
                "unshard: {} shards for a TP degree of {}",
                shards.len(),
                self.degree
            )));
        }
        let (table, layout) = build_table(&self.config);
        let mut data = vec![0f32; table.total()];
        // which rank first wrote each element, to check replicas agree
        let mut owner: Vec<u32> = vec![0; table.total()];
        for (rank, sh) in shards.iter().enumerate() {
            if sh.table.entries().len() != table.entries().len() {
                return Err(TpError::Config(format!(
                    "unshard: shard {rank} has {} parameters, the model {}",
                    sh.table.entries().len(),
                    table.entries().len()
                )));
            }
            for (i, e) in table.entries().iter().enumerate() {
                let le = &sh.table.entries()[i];
                let shape = cut_shape(&e.shape, &self.splits[rank][i]);
                if le.name != e.name || le.shape != shape {
                    return Err(TpError::Config(format!(
                        "unshard: shard {rank} holds {} {:?}, expected {} {:?}",
                        le.name, le.shape, e.name, shape
                    )));
                }
                let src = &sh.data[le.offset..le.offset + le.len];
                let dst = &mut data[e.offset..e.offset + e.len];
                let own = &mut owner[e.offset..e.offset + e.len];
                paste(
                    &e.shape,
                    dst,
                    own,
                    rank as u32 + 1,
                    src,
                    &self.splits[rank][i],
                )
                .map_err(|j| {
                    TpError::Config(format!(
                        "unshard: {} element {j} differs between rank {} and rank {rank} \
                         (replicated values must stay equal; were their gradients all-reduced?)",
                        e.name,
                        own_rank(own[j])
                    ))
                })?;
            }
        }
        Ok(Weights {
            table,
            layout,
            data,
        })
    }
}

fn own_rank(o: u32) -> usize {
    o.saturating_sub(1) as usize
}

/// Elements per row of the first dimension, and rows.
fn rows_of(shape: &[usize]) -> (usize, usize) {
    let rows = shape.first().copied().unwrap_or(1);
    (rows, shape.iter().skip(1).product())
}

fn cut_shape(shape: &[usize], sp: &Split) -> Vec<usize> {
    let mut s = shape.to_vec();
    match sp {
        Split::Replicated => {}
        Split::Rows(rs) => s[0] = rs.iter().map(|r| r.len()).sum(),
        Split::Cols(c) => s[1] = c.len(),
    }
    s
}

/// The local shape and data of one parameter under `sp`.
fn cut(shape: &[usize], src: &[f32], sp: &Split) -> (Vec<usize>, Vec<f32>) {
    let s = cut_shape(shape, sp);
    let (rows, w) = rows_of(shape);
    let data = match sp {
        Split::Replicated => src.to_vec(),
        Split::Rows(rs) => rs
            .iter()
            .flat_map(|r| src[r.start * w..r.end * w].iter().copied())
            .collect(),
        Split::Cols(c) => (0..rows)
            .flat_map(|i| src[i * w + c.start..i * w + c.end].iter().copied())
            .collect(),
    };
    (s, data)
}

/// Writes a rank's part back into the full tensor. `own[j]` is 0 where nothing was written yet,
/// else `tag` (1 + the rank) of the writer; an element written twice must agree bitwise (else `Err(j)`).
fn paste(
    shape: &[usize],
    dst: &mut [f32],
    own: &mut [u32],
    tag: u32,
    src: &[f32],
    sp: &Split,
) -> Result<(), usize> {
    let (rows, w) = rows_of(shape);
    let mut put = |j: usize, x: f32| -> Result<(), usize> {
        if own[j] != 0 {
            if dst[j].to_bits() != x.to_bits() {
                return Err(j);
            }
        } else {
            dst[j] = x;
            own[j] = tag;
        }
        Ok(())
    };
    let mut k = 0;
    match sp {
        Split::Replicated => {
            for (j, &x) in src.iter().enumerate() {
                put(j, x)?;
            }
        }
        Split::Rows(rs) => {
            for r in rs {
                for j in r.start * w..r.end * w {
                    put(j, src[k])?;
                    k += 1;
                }
            }
        }
        Split::Cols(c) => {
            for i in 0..rows {
                for j in i * w + c.start..i * w + c.end {
                    put(j, src[k])?;
                    k += 1;
                }
            }
        }
    }
    Ok(())
}
