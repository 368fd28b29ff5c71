//! Parameters: one f32 buffer carved by a table of (Hugging Face name, shape).
//!
//! [`ParamTable`] lists every parameter of a Qwen2.5-VL model in a fixed order (vision tower,
//! merger, text decoder, lm head) with its transformers 5 name and shape, and assigns each an
//! offset in one buffer. [`Layout`] holds the [`ParamId`] of every tensor the forward reads, per
//! block/layer. Gradients and optimizer state reuse the same table: `ParamTable::total()`
//! elements, the same offsets.
//!
//! Invariants: offsets are dense and in table order; a tied lm head has no entry of its own
//! (`Layout::lm_head == Layout::embed`); names are canonical transformers 5 names
//! (`model.visual.*`, `model.language_model.*`, `lm_head.weight`).

use std::collections::HashMap;
use std::fmt;

use super::config::ModelConfig;
use rollplex_kernels::cpu::{philox4x32_10, uniform_open01};

/// Index of a parameter in its [`ParamTable`] (prints as `param17`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ParamId(pub u32);

impl fmt::Display for ParamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "param{}", self.0)
    }
}

/// How a parameter is initialised randomly (as Hugging Face's `_init_weights`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Init {
    /// Normal(0, initializer_range): linear, conv and embedding weights.
    Normal,
    /// Ones: RMSNorm weights.
    Ones,
    /// Zeros: biases.
    Zeros,
}

/// A width of the model that tensor parallelism splits over the ranks of a group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TpDim {
    /// Text query heads (rows of `head_dim` each).
    Heads,
    /// Text kv heads (split, or one per rank when fewer than the ranks).
    KvHeads,
    /// Text MLP intermediate rows.
    Ffn,
    /// Vocabulary rows (embeddings and lm head).
    Vocab,
    /// Vision query heads.
    VisionHeads,
    /// Vision MLP intermediate rows.
    VisionFfn,
    /// Merger hidden rows (`mlp.0` outputs).
    Merger,
}

/// How tensor parallelism splits a parameter (Megatron's rules), the same at every degree:
/// `tp::TpPlan` turns it into each rank's part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShardRule {
    /// Every rank holds all of it: norms, the patch embedding, a row-parallel linear's bias.
    Replicated,
    /// Column-parallel: the rank's range of `dim` in the rows, in each of `parts` equal blocks
    /// of rows (3 for the vision tower's fused qkv, 1 otherwise).
    Rows { dim: TpDim, parts: usize },
    /// Row-parallel: the rank's range of `dim` in the columns of an `[out, in]` matrix.
    Cols(TpDim),
}

/// One parameter: its name, shape, place in the buffer, initialisation and tensor-parallel
/// split. The CPU model, the TP shards and the CUDA trainer's fused tensors all read it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamEntry {
    pub name: String,
    pub shape: Vec<usize>,
    pub offset: usize,
    pub len: usize,
    pub init: Init,
    pub shard: ShardRule,
}

/// The spec table: every parameter's name, shape and offset in the one buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamTable {
    pub(crate) entries: Vec<ParamEntry>,
    pub(crate) by_name: HashMap<String, ParamId>,
    pub(crate) total: usize,
}

impl ParamTable {
    pub(crate) fn push(
        &mut self,
        name: String,
        shape: Vec<usize>,
        init: Init,
        shard: ShardRule,
    ) -> ParamId {
        let len = shape.iter().product();
        let id = ParamId(self.entries.len() as u32);
        self.by_name.insert(name.clone(), id);
        self.entries.push(ParamEntry {
            name,
            shape,
            offset: self.total,
            len,
            init,
            shard,
        });
        self.total += len;
        id
    }
    pub fn entries(&self) -> &[ParamEntry] {
        &self.entries
    }
    pub fn entry(&self, id: ParamId) -> &ParamEntry {
        &self.entries[id.0 as usize]
    }
    /// Looks a name up, accepting older layouts (`visual.*`, `model.layers.*`, ...).
    pub fn find(&self, name: &str) -> Option<ParamId> {
        self.by_name.get(&canonical_name(name)).copied()
    }
    /// Elements of the whole buffer.
    pub fn total(&self) -> usize {
        self.total
    }
}

/// The transformers 5 name of a parameter given in any supported layout:
/// `visual.X` -> `model.visual.X`; `model.X` (old text layout) -> `model.language_model.X`.
pub fn canonical_name(name: &str) -> String {
    if let Some(rest) = name.strip_prefix("visual.") {
        format!("model.visual.{rest}")
    } else if name.starts_with("model.visual.") || name.starts_with("model.language_model.") {
        name.to_string()
    } else if let Some(rest) = name.strip_prefix("model.") {
        format!("model.language_model.{rest}")
    } else {
        name.to_string()
    }
}

/// A linear layer: weight `[out, in]`, optional bias `[out]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Linear {
    pub w: ParamId,
    pub b: Option<ParamId>,
    pub out: usize,
    pub inp: usize,
    /// Row offset into `w` (and element offset into `b`): the vision tower's fused qkv is read
    /// as three linears that share one weight, rows `[0, d)`, `[d, 2d)`, `[2d, 3d)`.
    pub row0: usize,
}

/// One transformer block (vision block or text decoder layer): the same structure in both.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockParams {
    pub norm1: ParamId,
    pub norm2: ParamId,
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

/// The four linears of a block as a device engine fuses them (rows stacked in the order
/// [`BlockParams::fused`] lists).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lin {
    /// q | k | v.
    Qkv,
    O,
    /// gate | up.
    GateUp,
    Down,
}

impl Lin {
    pub const ALL: [Lin; 4] = [Lin::Qkv, Lin::O, Lin::GateUp, Lin::Down];
}

impl BlockParams {
    /// The table's linears fused linear `k` is made of, in row order.
    pub fn fused(&self, k: Lin) -> Vec<Linear> {
        match k {
            Lin::Qkv => vec![self.q, self.k, self.v],
            Lin::O => vec![self.o],
            Lin::GateUp => vec![self.gate, self.up],
            Lin::Down => vec![self.down],
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// `model.visual.patch_embed.proj.weight`, read as `[vision_hidden, patch_dim]`.
    pub patch_embed: ParamId,
    pub vision_blocks: Vec<BlockParams>,
    pub merger_ln: ParamId,
    pub merger_fc1: Linear,
    pub merger_fc2: Linear,
    pub embed: ParamId,
    pub text_layers: Vec<BlockParams>,
    pub final_norm: ParamId,
    /// `lm_head.weight` `[vocab, hidden]`; equals `embed` when the embeddings are tied.
    pub lm_head: ParamId,
}

/// Builds the table and layout of a model.
pub fn build_table(cfg: &ModelConfig) -> (ParamTable, Layout) {
    let v = cfg.vision();
    let t = cfg.text();
    let mut tb = ParamTable {
        entries: Vec::new(),
        by_name: HashMap::new(),
        total: 0,
    };
    let (vh, vi) = (v.hidden_size as usize, v.intermediate_size as usize);
    use ShardRule::{Cols, Replicated, Rows};
    // a linear's weight splits by `rule`; its bias splits with the rows of a column-parallel
    // weight and is replicated beside a row-parallel one (added once after the all-reduce)
    let lin = |tb: &mut ParamTable,
               pre: &str,
               out: usize,
               inp: usize,
               bias: bool,
               rule: ShardRule|
     -> Linear {
        let w = tb.push(format!("{pre}.weight"), vec![out, inp], Init::Normal, rule);
        let brule = match rule {
            Rows { .. } => rule,
            _ => Replicated,
        };
        let b = bias.then(|| tb.push(format!("{pre}.bias"), vec![out], Init::Zeros, brule));
        Linear {
            w,
            b,
            out,
            inp,
            row0: 0,
        }
    };
    let patch_embed = tb.push(
        "model.visual.patch_embed.proj.weight".into(),
        vec![
            vh,
            v.in_channels as usize,
            v.temporal_patch_size as usize,
            v.patch_size as usize,
            v.patch_size as usize,
        ],
        Init::Normal,
        Replicated,
    );
    // a column-parallel weight: the rank's range of `dim` in its rows
    let col = |dim| Rows { dim, parts: 1 };
    let mut vision_blocks = Vec::new();
    for i in 0..v.depth as usize {
        let p = format!("model.visual.blocks.{i}");
        let norm1 = tb.push(
            format!("{p}.norm1.weight"),
            vec![vh],
            Init::Ones,
            Replicated,
        );
        let norm2 = tb.push(
            format!("{p}.norm2.weight"),
            vec![vh],
            Init::Ones,
            Replicated,
        );
        let heads3 = Rows {
            dim: TpDim::VisionHeads,
            parts: 3,
        };
        let qkv = lin(&mut tb, &format!("{p}.attn.qkv"), 3 * vh, vh, true, heads3);
        let o = lin(
            &mut tb,
            &format!("{p}.attn.proj"),
            vh,
            vh,
            true,
            Cols(TpDim::VisionHeads),
        );
        let ffn = col(TpDim::VisionFfn);
        let gate = lin(&mut tb, &format!("{p}.mlp.gate_proj"), vi, vh, true, ffn);
        let up = lin(&mut tb, &format!("{p}.mlp.up_proj"), vi, vh, true, ffn);
        let down = lin(
            &mut tb,
            &format!("{p}.mlp.down_proj"),
            vh,
            vi,
            true,
            Cols(TpDim::VisionFfn),
        );
        let part = |r: usize| Linear {
            out: vh,
            row0: r * vh,
            ..qkv
        };
        vision_blocks.push(BlockParams {
            norm1,
            norm2,
            q: part(0),
            k: part(1),
            v: part(2),
            o,
            gate,
            up,
            down,
        });
    }
    let m2 = (v.spatial_merge_size * v.spatial_merge_size) as usize;
    let mh = vh * m2;
    let merger_ln = tb.push(
        "model.visual.merger.ln_q.weight".into(),
        vec![vh],
        Init::Ones,
        Replicated,
    );
    let merger_fc1 = lin(
        &mut tb,
        "model.visual.merger.mlp.0",
        mh,
        mh,
        true,
        col(TpDim::Merger),
    );
    let merger_fc2 = lin(
        &mut tb,
        "model.visual.merger.mlp.2",
        v.out_hidden_size as usize,
        mh,
        true,
        Cols(TpDim::Merger),
    );
    let (h, f, voc) = (
        t.hidden_size as usize,
        t.intermediate_size as usize,
        t.vocab_size as usize,
    );
    let hd = t.head_dim() as usize;
    let (nq, nkv) = (t.num_heads as usize, t.num_kv_heads as usize);
    let embed = tb.push(
        "model.language_model.embed_tokens.weight".into(),
        vec![voc, h],
        Init::Normal,
        col(TpDim::Vocab),
    );
    let mut text_layers = Vec::new();
    for i in 0..t.num_layers as usize {
        let p = format!("model.language_model.layers.{i}");
        let norm = |tb: &mut ParamTable, n: &str| {
            tb.push(format!("{p}.{n}.weight"), vec![h], Init::Ones, Replicated)
        };
        let norm1 = norm(&mut tb, "input_layernorm");
        let norm2 = norm(&mut tb, "post_attention_layernorm");
        let (heads, kv, ffn) = (col(TpDim::Heads), col(TpDim::KvHeads), col(TpDim::Ffn));
        let q = lin(
            &mut tb,
            &format!("{p}.self_attn.q_proj"),
            nq * hd,
            h,
            true,
            heads,
        );
        let k = lin(
            &mut tb,
            &format!("{p}.self_attn.k_proj"),
            nkv * hd,
            h,
            true,
            kv,
        );
        let vv = lin(
            &mut tb,
            &format!("{p}.self_attn.v_proj"),
            nkv * hd,
            h,
            true,
            kv,
        );
        let o = lin(
            &mut tb,
            &format!("{p}.self_attn.o_proj"),
            h,
            nq * hd,
            false,
            Cols(TpDim::Heads),
        );
        let gate = lin(&mut tb, &format!("{p}.mlp.gate_proj"), f, h, false, ffn);
        let up = lin(&mut tb, &format!("{p}.mlp.up_proj"), f, h, false, ffn);
        let down = lin(
            &mut tb,
            &format!("{p}.mlp.down_proj"),
            h,
            f,
            false,
            Cols(TpDim::Ffn),
        );
        text_layers.push(BlockParams {
            norm1,
            norm2,
            q,
            k,
            v: vv,
            o,
            gate,
            up,
            down,
        });
    }
    let final_norm = tb.push(
        "model.language_model.norm.weight".into(),
        vec![h],
        Init::Ones,
        Replicated,
    );
    let lm_head = if t.tie_word_embeddings {
        embed
    } else {
        tb.push(
            "lm_head.weight".into(),
            vec![voc, h],
            Init::Normal,
            col(TpDim::Vocab),
        )
    };
    let layout = Layout {
        patch_embed,
        vision_blocks,
        merger_ln,
        merger_fc1,
        merger_fc2,
        embed,
        text_layers,
        final_norm,
        lm_head,
    };
    (tb, layout)
}

/// All parameters of a model in one buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct Weights {
    pub table: ParamTable,
    pub layout: Layout,
    /// `table.total()` elements; parameter `id` is `data[entry.offset..][..entry.len]`.
    pub data: Vec<f32>,
}

/// Standard deviation of Hugging Face's `initializer_range` default.
pub const INIT_STD: f32 = 0.02;

impl Weights {
    /// All zeros (then filled by a loader).
    pub fn zeros(cfg: &ModelConfig) -> Self {
        let (table, layout) = build_table(cfg);
        let data = vec![0f32; table.total()];
        Weights {
            table,
            layout,
            data,
        }
    }

    /// Random initialisation as Hugging Face does it (normal(0, 0.02) weights, zero biases,
    /// unit norms), deterministic in `seed`: element `j` of parameter `i` is a Box-Muller normal
    /// from Philox4x32-10 keyed by `seed` at counter `(j, i, 0x1417)`, independent of order and
    /// thread count.
    pub fn random(cfg: &ModelConfig, seed: u64) -> Self {
        use rayon::prelude::*;
        let mut w = Self::zeros(cfg);
        let key = [seed as u32, (seed >> 32) as u32];
        for (i, e) in w.table.entries.iter().enumerate() {
            let dst = &mut w.data[e.offset..e.offset + e.len];
            match e.init {
                Init::Ones => dst.fill(1.0),
                Init::Zeros => dst.fill(0.0),
                Init::Normal => dst.par_iter_mut().enumerate().for_each(|(j, x)| {
                    let r = philox4x32_10([j as u32, (j >> 32) as u32, i as u32, 0x1417], key);
                    let u1 = uniform_open01(r[0], r[1]);
                    let u2 = uniform_open01(r[2], r[3]);
                    let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
                    *x = (z * INIT_STD as f64) as f32;
                }),
            }
        }
        w
    }

    pub fn get(&self, id: ParamId) -> &[f32] {
        let e = self.table.entry(id);
        &self.data[e.offset..e.offset + e.len]
    }
    pub fn get_mut(&mut self, id: ParamId) -> &mut [f32] {
        let e = self.table.entry(id).clone();
        &mut self.data[e.offset..e.offset + e.len]
    }
    /// The weight rows `[l.row0, l.row0 + l.out)` of a linear, `[out, in]`.
    pub fn lin_w(&self, l: &Linear) -> &[f32] {
        &self.get(l.w)[l.row0 * l.inp..(l.row0 + l.out) * l.inp]
    }
    pub fn lin_b(&self, l: &Linear) -> Option<&[f32]> {
        l.b.map(|b| &self.get(b)[l.row0..l.row0 + l.out])
    }
}
