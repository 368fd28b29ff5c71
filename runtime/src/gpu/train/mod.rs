//! The actor's training step on CUDA: forward over a micro-batch of GRPO groups, per-token
//! log-probs, the policy loss and its gradient, backward through the lm head, every decoder
//! layer, the token embeddings and (unless the pipeline freezes them) the merger and the vision
//! tower (`vision_train/`) into fp32 gradients summed over micro-batches, then the global
//! grad-norm clip and `adamw_step_f32` on fp32 masters with the bf16 compute copy (the model's
//! own weight buffers) written by the same kernel.
//!
//! ```text
//! let mut t = GpuTrainer::new(&gpu, &stream, &cpu_model, train_cfg, adamw_spec)?;
//! // a frozen tower: the media's embeddings, shared with the rollout
//! let media = t.model().encode_media(&gpu, &stream, &items)?;
//! let m = PromptMedia::Encoded(&refs);         // refs: &[&GpuEncodedMedia] of `media`
//! // a trained tower or merger: the media themselves (the prompt forward encodes them)
//! let m = PromptMedia::Raw(&items);
//! // with kept prompt forwards (the executor: ActorPrefix{Train} tasks, maybe in decode windows)
//! let mut store = TrainPrefixes::new(&gpu, &stream, t.model(), &[(prompt_len, copies), ..])?;
//! t.prefix_forward(&gpu, &stream, &mut store, group, prompt_ids, m)?;
//! t.micro_batch_prefixed(&gpu, &stream, 0, &[PrefixedGroup { group, responses }], norm, &store)?;
//! // or queued, the host going on while the device runs it (results before the optimizer step)
//! t.queue_micro_batch_prefixed(&gpu, &stream, 1, &groups, norm, &store)?;
//! let outs = t.finish_queued()?;                                // plan order
//! // or, self-contained: each group's prompt runs inside the call
//! t.micro_batch(&gpu, &stream, 2, &groups, norm)?;              // plan order 0, 1, ...
//! let report = t.optimizer_step(&gpu, &stream)?;                // clip, AdamW, bf16 copy
//! ```
//!
//! Layout (`train_pack`): a group's prompt runs once per copy (one with prefix dedup: every
//! sample of the group shares it, as on the CPU backend; one per sample without), its layers'
//! inputs and K/V kept in a [`TrainPrefixes`] store; a micro-batch packs each response's suffix
//! `tokens[..n-1]` (positions `P + j + rope_delta`, as `score` gives them, so a response token
//! that happens to be a media placeholder id is still text), attending to its copy's kept K/V.
//! Token `j >= 1` is scored from suffix row `j - 1`, token 0 from the copy's kept last row.
//! Backward, per layer top-down: the suffix rows (their attention backward adds the prefix keys'
//! gradients in fp32), then each group's prompt rows, recomputed from their kept inputs, with
//! those gradients added to their own K/V gradients; the prompt's top row starts from token 0's
//! gradients (summed over the copy's responses in response order). Every GRPO group is whole in
//! one micro-batch (the executor refuses other splits), so a prompt's backward runs once. With
//! the tower or merger trained, the prompt forward encodes the group's media once with
//! `encode_media_train` (bitwise `encode_media`'s embeddings; the copies share them) and keeps
//! its state; after the token embeddings' backward, each group's media rows' gradients, summed
//! over its copies (`gather_sum_rows`, fp32, copy order), go through `vision_backward` into
//! the same fp32 sums (group order).
//!
//! Activations: each layer's input (bf16 residual stream) is kept, the prompt's in the store, the
//! suffix's per micro-batch. The first [`TrainConfig::kept_layers`] layers (the plan's kept
//! activation layers) keep the suffix's activations from the forward; backward recomputes the
//! others from their input, and the lm head's logits from the final rows unless every layer is
//! kept (then the logits are kept too). The forward ops are deterministic, so the recomputed
//! activations are bitwise the forward's and every split gives the same bits. The prompt rows
//! are recomputed from their kept inputs whatever the split: they are
//! kept across tasks (the prompt forward may run in a decode window long before), where a whole
//! iteration's prompt activations would not fit (~68 GB at 3B and 16 video prompts: 97 KB a row a layer).
//!
//! Where things run: everything on the device on the caller's stream, the policy loss and its
//! gradient w.r.t. the log-probs too (`gpu::loss`: one call over the micro-batch's groups, each
//! token's `dlogp` with the CPU loss's f64 math in its order, so bitwise the CPU's up to the last
//! bit of `exp`; the metrics as order-fixed f64 sums). A micro-batch's host tables (the loss's
//! per-token inputs, row tables, RoPE tables) go up through page-locked staging before its first
//! launch, and its log-probs, entropies and metrics come down into page-locked memory behind its
//! backward: the executor queues micro-batch after micro-batch (`queue_micro_batch_prefixed`)
//! while the device runs them and takes their results (`finish_queued`) before the optimizer
//! step, which downloads the grad-norm partials (1024 doubles per tensor) and so synchronises
//! once a mini-batch. The token-0 and media-row gathers' tables are staged with the others
//! (`gather_sum_rows_dev`), so with the tower and merger frozen the host waits for nothing inside
//! a micro-batch (a trained tower's backward still uploads a column of ones from pageable
//! memory). One difference from the CPU's group-by-group loss: the reference log-probs go to the device for
//! all groups or none, so at `kl_coef = 0` the KL metric is 0 unless every group carries them.
//!
//! Numerics: GEMMs are cuBLASLt bf16 with fp32 accumulation; a weight gradient's GEMM writes
//! fp32 and adds its product into the fp32 sum in its epilogue (`matmul_bf16_f32`: never rounded
//! to bf16, as on the CPU); bias gradients are the same GEMM with a row of ones; norm and
//! embedding gradients are fp32 directly.
//!
//! Checkpoints: [`GpuTrainer::export_state`] brings the fp32 masters and AdamW moments down,
//! each fused tensor split into the CPU model's tensors (`cpu_parts`: q|k|v and gate|up by rows),
//! with the CPU backend's names; [`GpuTrainer::import_state`] is the inverse and re-derives the
//! bf16 compute copy from the masters (round to nearest even, bitwise what `adamw_step_f32`
//! wrote). Weights, moments and the step count are the trainer's whole state between
//! mini-batches.
//!
//! Invariants: every launch and copy runs on the caller's stream; the weights change only in
//! [`GpuTrainer::optimizer_step`] and [`GpuTrainer::import_state`]; micro-batches are accepted
//! in plan order only; a kept prompt forward trains only with the weights it ran with (it
//! records the optimizer step; a micro-batch after another step refuses it).

mod backward;
mod layer;
mod optim;
mod params;
mod prefixes;
mod state;
mod step;
mod stream;

use std::sync::Arc;

use rollplex_kernels::cuda::{CudaError, CudaStream, Gpu};
use rollplex_plan::spec::AdamWSpec;

use crate::model::weights::{Layout, ParamTable};
use crate::model::{MediaInput, Qwen25VL};
use crate::train::adamw::{default_decay, validate_spec};
use crate::train::loss::LossMetrics;
use crate::train::{ResponseBatch, TrainConfig, TrainError};

use super::arena::{upload_in, zeros_in, Region};
use super::readback::Readbacks;
use super::vision::GpuEncodedMedia;
use super::{alloc, GpuError, GpuModel};
use params::{host_values, train_slots, weight_mut, Grads, TrainTensor};

pub use params::{Lin, Slot};
pub use prefixes::TrainPrefixes;
pub use state::{GpuTrainState, ParamState};

/// What can go wrong in a GPU training step.
#[derive(Debug, thiserror::Error)]
pub enum GpuTrainError {
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error(transparent)]
    Train(#[from] TrainError),
}

impl From<CudaError> for GpuTrainError {
    fn from(e: CudaError) -> Self {
        GpuTrainError::Gpu(e.into())
    }
}

impl From<cudarc::driver::DriverError> for GpuTrainError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        GpuTrainError::Gpu(e.into())
    }
}

pub type Result<T> = std::result::Result<T, GpuTrainError>;

/// A prompt's media as the trainer takes them.
#[derive(Clone, Copy)]
pub enum PromptMedia<'a> {
    /// Embeddings of the frozen tower and merger (`GpuModel::encode_media`, shared with the
    /// rollout): no gradient flows into them. Refused when the trainer trains either.
    Encoded(&'a [&'a GpuEncodedMedia]),
    /// The media themselves: the prompt forward encodes them with the trainer's current
    /// weights, once per prompt (its copies share the encoding), keeping what the vision
    /// backward needs when the tower or merger trains; the micro-batch's backward then sums the
    /// copies' media-row gradients and runs the merger's and tower's backward.
    Raw(&'a [MediaInput<'a>]),
}

/// A GRPO group for the GPU step: a prompt, its media and its responses with their training
/// inputs.
#[derive(Clone, Copy)]
pub struct GpuGroupBatch<'a> {
    pub prompt_ids: &'a [u32],
    pub media: PromptMedia<'a>,
    pub responses: &'a [ResponseBatch<'a>],
}

/// A GRPO group of a micro-batch whose prompt forward is kept in a [`TrainPrefixes`]: its group
/// index there and its responses (with one copy per response, response `r` reads copy `r`).
#[derive(Clone, Copy)]
pub struct PrefixedGroup<'a> {
    pub group: usize,
    pub responses: &'a [ResponseBatch<'a>],
}

/// The actor on one GPU with its optimizer state and the gradient sum of the current mini-batch.
pub struct GpuTrainer {
    model: GpuModel,
    cfg: TrainConfig,
    spec: AdamWSpec,
    layout: Layout,
    table: ParamTable,
    grads: Grads,
    steps: u64,
    micro: u32,
    metrics: LossMetrics,
    /// The optimizer state on the host, streamed by each step (a plan's `OptimizerStream`).
    streamed: Option<stream::StreamedState>,
    /// Micro-batches queued whose results the host has not taken yet, in plan order.
    queued: std::collections::VecDeque<step::Queued>,
    /// Page-locked buffers the queued results land in.
    readbacks: Readbacks,
}

/// Regions of the plan's arena for the trainer's loop-carried state ([`GpuTrainer::new_in`]);
/// `None`: the memory pool.
#[derive(Clone, Default)]
pub struct TrainerPlacement {
    /// The bf16 compute copy (`actor_weights`).
    pub weights: Option<Arc<Region>>,
    /// fp32 master weights (`master_weights`).
    pub masters: Option<Arc<Region>>,
    /// AdamW's moments (`adam_moments`).
    pub moments: Option<Arc<Region>>,
    /// The masters and moments kept in pinned host memory and streamed through the device by
    /// each optimizer step, chunked as the plan's `OptimizerStream` says. They are built on the
    /// host, so the device never holds them whole. `None`: on the device.
    pub stream: Option<rollplex_plan::OptimizerStream>,
}

impl GpuTrainer {
    /// Uploads `model` (bf16 compute copy; fp32 masters from its f32 weights) and zeroed
    /// moments and gradients, for every tensor the configuration trains (the text decoder, and
    /// the vision tower and merger unless `freeze_vision` / `freeze_merger`).
    pub fn new(
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        model: &Qwen25VL,
        cfg: TrainConfig,
        spec: AdamWSpec,
    ) -> Result<Self> {
        Self::new_in(gpu, stream, model, cfg, spec, &TrainerPlacement::default())
    }

    /// [`GpuTrainer::new`] with the weights, masters and moments in `place`'s regions of the
    /// plan's arena.
    pub fn new_in(
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        model: &Qwen25VL,
        cfg: TrainConfig,
        spec: AdamWSpec,
        place: &TrainerPlacement,
    ) -> Result<Self> {
        if !(cfg.temperature > 0.0 && cfg.temperature.is_finite()) {
            return Err(TrainError::Invalid(format!(
                "temperature {} must be positive and finite",
                cfg.temperature
            ))
            .into());
        }
        cfg.loss.validate()?;
        validate_spec(&spec)?;
        let mut gm = GpuModel::upload_in(gpu, stream, model, place.weights.as_deref())?;
        let (masters, moments) = (place.masters.as_deref(), place.moments.as_deref());
        let slots = train_slots(&model.weights.layout, &cfg);
        let mut streamed = match &place.stream {
            Some(plan) => {
                let total = slots
                    .iter()
                    .map(|&s| weight_mut(&mut gm.weights, s).map_or(0, |w| w.len()))
                    .sum();
                let mut st = stream::StreamedState::new(gpu, stream, total, plan)?;
                st.zero_moments();
                Some(st)
            }
            None => None,
        };
        let mut t = Vec::with_capacity(slots.len());
        let mut at = 0usize;
        for s in slots {
            let (vals, name, shape) = host_values(model, s)
                .ok_or_else(|| GpuError::Input(format!("model has no host tensor for {s:?}")))?;
            let numel = vals.len();
            let (master, m, v) = match &mut streamed {
                // on the host: one device element stands in for each
                Some(st) => {
                    if at + numel > st.total() {
                        return Err(GpuError::Input(format!(
                            "trained tensor {name} ({numel} values) overruns the streamed state"
                        ))
                        .into());
                    }
                    st.write(0, at, &vals);
                    (
                        alloc::<f32>(gpu, stream, 1)?.into(),
                        alloc::<f32>(gpu, stream, 1)?.into(),
                        alloc::<f32>(gpu, stream, 1)?.into(),
                    )
                }
                // zeroed on the device (no host copy of three model-sized zero buffers)
                None => (
                    upload_in(gpu, stream, &vals, masters)?,
                    zeros_in::<f32>(gpu, stream, numel, moments)?,
                    zeros_in::<f32>(gpu, stream, numel, moments)?,
                ),
            };
            at += numel;
            t.push(TrainTensor {
                slot: s,
                decay: default_decay(&name, &shape),
                name,
                numel,
                master,
                m,
                v,
                grad: None,
            });
        }
        if let Some(st) = &streamed {
            if at != st.total() {
                return Err(GpuError::Input(format!(
                    "the trained tensors hold {at} values but their device copies {}",
                    st.total()
                ))
                .into());
            }
        }
        Ok(GpuTrainer {
            model: gm,
            cfg,
            spec,
            layout: model.weights.layout.clone(),
            table: model.weights.table.clone(),
            grads: Grads { t, region: None },
            steps: 0,
            micro: 0,
            metrics: LossMetrics::default(),
            streamed,
            queued: Default::default(),
            readbacks: Readbacks::default(),
        })
    }

    /// Where the next mini-batch's gradient sums go (the plan's `grads.sS` of the step about to
    /// run; `None`: the memory pool). Sums in progress stay where they are.
    pub fn set_grads_region(&mut self, region: Option<Arc<Region>>) {
        self.grads.region = region;
    }

    /// The model with its current bf16 weights (to encode media, score, generate).
    pub fn model(&self) -> &GpuModel {
        &self.model
    }
    pub fn config(&self) -> &TrainConfig {
        &self.cfg
    }
    /// Trains with `plan`'s kept activation layers from now on (what a plan decides: memory
    /// and time, never the results).
    pub fn follow_plan(&mut self, plan: &rollplex_plan::Plan) {
        self.cfg = self.cfg.clone().with_plan(plan);
    }
    /// Optimizer steps taken.
    pub fn steps(&self) -> u64 {
        self.steps
    }
    /// Names of the trained tensors (fused q|k|v and gate|up are named by their first part).
    pub fn tensor_names(&self) -> Vec<String> {
        self.grads.t.iter().map(|t| t.name.clone()).collect()
    }

    /// Whether the trainer trains the vision tower or the merger.
    pub fn trains_vision(&self) -> bool {
        !self.cfg.freeze_vision || !self.cfg.freeze_merger
    }
}

#[cfg(test)]
pub(crate) mod tests;
