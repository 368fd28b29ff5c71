//! What a forward keeps for backward ([`ForwardCache`] for the text decoder, [`VisionCache`]
//! for the vision tower). The training code passes `Some(&mut cache)` to a forward and reads
//! the activations back; `CacheMode` decides how much is kept (the plan's kept activation
//! layers).
//!
//! Invariant: a layer cached as `LayerInputs` fills only `LayerCache::x_in` (recompute the
//! layer from it); one cached as `Full` fills every field; unfilled fields are empty vectors.

use rollplex_kernels::cpu::AttnSeq;

/// How much a forward keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheMode {
    /// Each layer's input only (backward recomputes the layer).
    LayerInputs,
    /// Every activation backward needs.
    Full,
    /// Every activation of the first `n` text layers, the input of the others (and the final
    /// norm's output, as `Full`).
    FirstLayers(usize),
}

impl CacheMode {
    /// What layer `l` keeps: `Full` or `LayerInputs`.
    pub fn layer(self, l: usize) -> CacheMode {
        match self {
            CacheMode::FirstLayers(n) if l < n => CacheMode::Full,
            CacheMode::FirstLayers(_) => CacheMode::LayerInputs,
            m => m,
        }
    }
}

/// One transformer block's saved activations, `T` rows. Shapes use the block's widths:
/// `H` hidden, `F` MLP, `Q = heads * head_dim`, `KV = kv_heads * head_dim`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LayerCache {
    /// Block input `[T, H]`.
    pub x_in: Vec<f32>,
    /// `1 / rms` of `x_in` per row `[T]` and the normed input `[T, H]` (input of q/k/v).
    pub rstd1: Vec<f32>,
    pub xn1: Vec<f32>,
    /// q `[T, Q]`, k and v `[T, KV]`, after RoPE (k, v: this block's own rows only; a shared
    /// prefix's KV lives in its `PrefixState`).
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    /// Attention output `[T, Q]` (input of the output projection) and its log-sum-exp `[T, heads]`.
    pub attn: Vec<f32>,
    pub lse: Vec<f32>,
    /// Residual after attention `[T, H]` (input of the second norm).
    pub x_mid: Vec<f32>,
    pub rstd2: Vec<f32>,
    pub xn2: Vec<f32>,
    /// MLP gate and up projections `[T, F]` and `silu(gate) * up` `[T, F]` (input of down).
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub act: Vec<f32>,
}

/// Saved activations of a text forward (prefill, score or a full-sequence forward).
#[derive(Clone, Debug, PartialEq)]
pub struct ForwardCache {
    pub mode: CacheMode,
    /// Rows of the packed batch and its sequences (with their prefix spans, if scored over a
    /// shared prefix).
    pub tokens: usize,
    pub seqs: Vec<AttnSeq>,
    /// Input token ids `[T]` and M-RoPE tables `[T, head_dim]`.
    pub ids: Vec<u32>,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
    pub layers: Vec<LayerCache>,
    /// Input of the final norm `[T, H]`, its `1/rms` `[T]`, and the normed output `[T, H]`
    /// (input of the lm head).
    pub final_in: Vec<f32>,
    pub final_rstd: Vec<f32>,
    pub final_out: Vec<f32>,
    /// `score` only: each row's log-sum-exp of `logits / temperature` `[T]` (f64, over the whole
    /// vocabulary), what the lm head's backward reads.
    pub lse: Vec<f64>,
}

impl ForwardCache {
    pub fn new(mode: CacheMode) -> Self {
        ForwardCache {
            mode,
            tokens: 0,
            seqs: Vec::new(),
            ids: Vec::new(),
            cos: Vec::new(),
            sin: Vec::new(),
            layers: Vec::new(),
            final_in: Vec::new(),
            final_rstd: Vec::new(),
            final_out: Vec::new(),
            lse: Vec::new(),
        }
    }
}

/// Saved activations of a vision-tower forward (rows in window-permuted order).
#[derive(Clone, Debug, PartialEq)]
pub struct VisionCache {
    pub mode: CacheMode,
    /// Patches `[N, patch_dim]` in the processor's order (input of the patch embedding).
    pub pixels: Vec<f32>,
    /// `window_index[i]` = merged token at permuted position `i`.
    pub window_index: Vec<u32>,
    /// 2D RoPE tables `[N, head_dim]`, permuted.
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
    /// Sequences of the full-attention blocks (per frame) and of the window blocks.
    pub full_seqs: Vec<AttnSeq>,
    pub window_seqs: Vec<AttnSeq>,
    pub blocks: Vec<LayerCache>,
    /// Merger: input `[N, Hv]`, `1/rms` `[N]`, normed `[N, Hv]` (= `[N/m², m² Hv]` rows of fc1),
    /// fc1 output `[N/m², m² Hv]`, GELU output `[N/m², m² Hv]`.
    pub merger_in: Vec<f32>,
    pub merger_rstd: Vec<f32>,
    pub merger_xn: Vec<f32>,
    pub merger_fc1: Vec<f32>,
    pub merger_gelu: Vec<f32>,
}

impl VisionCache {
    pub fn new(mode: CacheMode) -> Self {
        VisionCache {
            mode,
            pixels: Vec::new(),
            window_index: Vec::new(),
            cos: Vec::new(),
            sin: Vec::new(),
            full_seqs: Vec::new(),
            window_seqs: Vec::new(),
            blocks: Vec::new(),
            merger_in: Vec::new(),
            merger_rstd: Vec::new(),
            merger_xn: Vec::new(),
            merger_fc1: Vec::new(),
            merger_gelu: Vec::new(),
        }
    }
}
