//! The actor's training step on CUDA: forward over a micro-batch of GRPO groups, per-token
//! log-probs, the policy loss and its gradient, backward through the lm head, every decoder
//! layer, the token embeddings and (unless the pipeline freezes them) the merger and the vision
//! tower (`vision_train.rs`) into fp32 gradients summed over micro-batches, then the global
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
//! // or, self-contained: each group's prompt runs inside the call
//! t.micro_batch(&gpu, &stream, 1, &groups, norm)?;              // plan order 0, 1, ...
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
//! suffix's per micro-batch. With `Recompute::Full` backward recomputes each layer from it, and
//! the lm head's logits from the final rows; with `Recompute::None` the suffix's activations of
//! every layer and the logits are kept from the forward instead. The forward ops are
//! deterministic, so the recomputed activations are bitwise the forward's and both policies give
//! the same bits. The prompt rows are recomputed from their kept inputs under both: they are
//! kept across tasks (the prompt forward may run in a decode window long before), where a whole
//! iteration's prompt activations would not fit (~68 GB at 3B and 16 video prompts: 97 KB a row a layer).
//!
//! Where things run: everything on the device on the caller's stream, the policy loss and its
//! gradient w.r.t. the log-probs too (`gpu::loss`: one call over the micro-batch's groups, each
//! token's `dlogp` with the CPU loss's f64 math in its order, so bitwise the CPU's up to the last
//! bit of `exp`; the metrics as order-fixed f64 sums). A micro-batch synchronises once, after its
//! whole backward is queued (its log-probs, entropies and metrics come down); the optimizer step
//! downloads the grad-norm partials (1024 doubles per tensor). The loss's per-token inputs are
//! uploaded before the first launch. One difference from the CPU's group-by-group loss: the
//! reference log-probs go to the device for all groups or none, so at `kl_coef = 0` the KL
//! metric is 0 unless every group carries them.
//!
//! Numerics: GEMMs are cuBLASLt bf16 with fp32 accumulation; a weight gradient is produced in
//! bf16 by its GEMM and added into its fp32 accumulator (`grad_accumulate_f32`); bias gradients
//! are the same GEMM with a row of ones; norm and embedding gradients are fp32 directly.
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

use std::sync::Arc;

use cudarc::driver::{CudaView, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use half::bf16;
use rollplex_kernels::cpu::{AttnDims, AttnMask, Gemm};
use rollplex_kernels::cuda::attention::RowStrides;
use rollplex_kernels::cuda::nvrtc::KernelModule;
use rollplex_kernels::cuda::{
    adamw_step_f32, add_fwd_bf16_inplace, add_rmsnorm_fwd_bf16, attention_bwd_bf16,
    attention_fwd_bf16, embedding_bwd_f32, embedding_fwd_bf16, grad_accumulate_f32, kv_append_bf16,
    linear_fwd_bf16, logprobs_bwd_bf16, logprobs_fwd_bf16, matmul_bf16, rmsnorm_bwd_bf16,
    rmsnorm_fwd_bf16, rope_bwd_bf16, rope_fwd_bf16, swiglu_fwd_bf16, AdamWScalars, AttnSeqGpu,
    CudaError, CudaSlice, CudaStream, Gpu, PolicyLossAcc, PolicyLossInputs,
};
use rollplex_plan::spec::{AdamWSpec, Recompute};

use crate::model::weights::{Layout, ParamTable};
use crate::model::{MediaInput, Qwen25VL};
use crate::train::adamw::{default_decay, lr_at, validate_spec, StepReport};
use crate::train::loss::{LossMetrics, Normaliser};
use crate::train::{MicroBatchOutput, ResponseBatch, TrainConfig, TrainError, TrainStepReport};

use super::arena::{alloc_in, upload_in, zeros_in, DevBuf, Region};
use super::block_bwd::{BlockBwd, BlockTensor, GradSink, MlpSaved};
use super::loss::{loss_metrics, policy_loss_device, LossTables};
use super::plan::{check_ids, media_slot, PackedPrompts, PromptSpec};
use super::staging::staged_bytes;
use super::train_pack::{layout_prefixes, PackGroup, PrefixLayout, SuffixPack};
use super::vision::GpuEncodedMedia;
use super::vision_train::{
    vision_backward, vision_cpu_parts, vision_host_values, vision_slot_meta, vision_slots,
    vision_weight_mut, VisionSink, VisionSlot, VisionTrainState,
};
use super::weights::{fuse_linears, GpuBlock, GpuLinear, GpuWeights};
use super::{alloc, download, upload, GpuError, GpuModel};

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

/// Rows of the lm head per chunk (bounds the logits buffer to `CHUNK x vocab`).
const LM_CHUNK: usize = 1024;
/// Blocks of the grad-norm partial-sum kernel (fixed: the sum's order depends on nothing else).
/// 1024 blocks of 256 threads with four loads in flight each keep enough bytes in flight to
/// stream a gradient at near the copy rate: at 619M parameters on the H200 the optimizer step
/// went from 13.1 ms (128 blocks, one load in flight) to 6.5 ms, its AdamW alone being 5.2 ms
/// (docs/perf.md, "Training step speed").
const NORM_BLOCKS: usize = 1024;

/// The small kernels of this module: the grad-norm partial sums (f64, fixed order: four
/// strided accumulators per thread, added in a fixed order, then a fixed tree over the block),
/// the clip's scaling (`g *= c`, one rounding, as the CPU's `*g *= coef`), the fixed-order sum
/// of the token-0 row gradients into a kept prompt's last row, and the add of the suffixes'
/// fp32 prefix K/V gradients into the prefix rows' own (bf16).
const TRAIN_KERNELS: KernelModule = KernelModule {
    name: "gpu_train",
    source: r#"
extern "C" __global__ void sumsq_partial_f32(const float* __restrict__ g, u64 n,
                                             double* __restrict__ out) {
    __shared__ double s[256];
    const u64 stride = (u64)gridDim.x * blockDim.x;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
    for (; i + 3 * stride < n; i += 4 * stride) {
        const double x0 = (double)g[i], x1 = (double)g[i + stride];
        const double x2 = (double)g[i + 2 * stride], x3 = (double)g[i + 3 * stride];
        a0 = __dadd_rn(a0, __dmul_rn(x0, x0));
        a1 = __dadd_rn(a1, __dmul_rn(x1, x1));
        a2 = __dadd_rn(a2, __dmul_rn(x2, x2));
        a3 = __dadd_rn(a3, __dmul_rn(x3, x3));
    }
    for (; i < n; i += stride) {
        const double x = (double)g[i];
        a0 = __dadd_rn(a0, __dmul_rn(x, x));
    }
    s[threadIdx.x] = __dadd_rn(__dadd_rn(a0, a1), __dadd_rn(a2, a3));
    __syncthreads();
    for (u32 w = 128; w > 0; w >>= 1) {
        if (threadIdx.x < w) s[threadIdx.x] = __dadd_rn(s[threadIdx.x], s[threadIdx.x + w]);
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = s[0];
}

extern "C" __global__ void scale_f32(float* __restrict__ g, u64 n, float c) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        g[i] = __fmul_rn(g[i], c);
    }
}

// dst row dst_rows[d] = the fp32 sum of src rows idx[off[d] .. off[d + 1]] in list order, rounded
// once to bf16. One block per destination row.
extern "C" __global__ void gather_sum_rows_bf16(bf16* __restrict__ dst,
                                                const u32* __restrict__ dst_rows,
                                                const bf16* __restrict__ src,
                                                const u32* __restrict__ off,
                                                const u32* __restrict__ idx, u32 width) {
    const u32 d = blockIdx.x, a = off[d], b = off[d + 1];
    for (u32 c = threadIdx.x; c < width; c += blockDim.x) {
        float acc = 0.0f;
        for (u32 i = a; i < b; i++) acc = __fadd_rn(acc, bf2f(src[(u64)idx[i] * width + c]));
        dst[(u64)dst_rows[d] * width + c] = f2bf(acc);
    }
}

// x = bf16(x + y), one rounding (a bf16 gradient plus an fp32 one).
extern "C" __global__ void add_f32_into_bf16(bf16* __restrict__ x, const float* __restrict__ y,
                                             u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        x[i] = f2bf(__fadd_rn(bf2f(x[i]), y[i]));
    }
}
"#,
};

/// `x = bf16(x + y)` over `n` elements (`add_f32_into_bf16`).
fn add_f32_into_bf16(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    x: &mut CudaSlice<bf16>,
    y: &CudaView<'_, f32>,
    n: usize,
) -> Result<()> {
    if x.len() < n || y.len() < n {
        return Err(GpuError::Input(format!(
            "add_f32_into_bf16: {n} elements but buffers of {} and {}",
            x.len(),
            y.len()
        ))
        .into());
    }
    if n == 0 {
        return Ok(());
    }
    let f = gpu.function(&TRAIN_KERNELS, &[], "add_f32_into_bf16")?;
    let (xp, _x) = x.device_ptr_mut(s);
    let (yp, _y) = y.device_ptr(s);
    let n64 = n as u64;
    let mut b = s.launch_builder(&f);
    b.arg(&xp).arg(&yp).arg(&n64);
    // SAFETY: x and y hold at least n elements (checked); arguments match (x, y, n).
    unsafe {
        b.launch(LaunchConfig {
            grid_dim: (n.div_ceil(256).clamp(1, 4096) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        })
    }?;
    Ok(())
}

/// Row `dst_rows[d]` of `dst` (`[_, width]`) = the fp32 sum, in list order, of the rows
/// `lists[d]` of `src` (`gather_sum_rows_bf16`). Rows of `dst` not named are left as they are.
fn gather_sum_rows(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    dst: &mut CudaSlice<bf16>,
    dst_rows: &[u32],
    src: &CudaSlice<bf16>,
    lists: &[Vec<u32>],
    width: usize,
) -> Result<()> {
    if dst_rows.len() != lists.len() {
        return Err(GpuError::Input("gather_sum_rows: one list per destination row".into()).into());
    }
    let (dst_n, src_n) = (dst.len() / width.max(1), src.len() / width.max(1));
    if dst_rows.iter().any(|&r| r as usize >= dst_n)
        || lists.iter().flatten().any(|&r| r as usize >= src_n)
    {
        return Err(GpuError::Input(format!(
            "gather_sum_rows: a row outside {dst_n} destination or {src_n} source rows"
        ))
        .into());
    }
    if dst_rows.is_empty() {
        return Ok(());
    }
    let mut off = vec![0u32];
    let mut idx = Vec::new();
    for l in lists {
        idx.extend_from_slice(l);
        off.push(idx.len() as u32);
    }
    let (dr, offd, idxd) = (upload(s, dst_rows)?, upload(s, &off)?, upload(s, &idx)?);
    let f = gpu.function(&TRAIN_KERNELS, &[], "gather_sum_rows_bf16")?;
    let (dp, _d) = dst.device_ptr_mut(s);
    let (rp, _r) = dr.device_ptr(s);
    let (sp, _s) = src.device_ptr(s);
    let (op, _o) = offd.device_ptr(s);
    let (ip, _i) = idxd.device_ptr(s);
    let w = width as u32;
    let mut b = s.launch_builder(&f);
    b.arg(&dp).arg(&rp).arg(&sp).arg(&op).arg(&ip).arg(&w);
    // SAFETY: every named row lies inside dst and src (checked); off has one entry more than
    // the grid's blocks; arguments match (dst, dst_rows, src, off, idx, width).
    unsafe {
        b.launch(LaunchConfig {
            grid_dim: (dst_rows.len() as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        })
    }?;
    // the index buffers are freed at the end of this scope, stream-ordered after the kernel
    Ok(())
}

/// The four linears of a decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lin {
    Qkv,
    O,
    GateUp,
    Down,
}

/// A trained tensor of the text decoder, as the device holds it (q|k|v and gate|up fused).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    Embed,
    /// Only when not tied to the embeddings.
    LmHead,
    FinalNorm,
    Norm1(usize),
    Norm2(usize),
    Weight(usize, Lin),
    Bias(usize, Lin),
    /// A tensor of the vision tower or merger (trained unless the pipeline freezes it).
    Vision(VisionSlot),
}

struct TrainTensor {
    slot: Slot,
    name: String,
    numel: usize,
    decay: bool,
    master: DevBuf<f32>,
    m: DevBuf<f32>,
    v: DevBuf<f32>,
    /// The fp32 gradient sum of the running mini-batch: made (zeroed) by its first micro-batch,
    /// freed by the optimizer step, as the plan's `grads.sS` lives (see [`Grads`]).
    grad: Option<DevBuf<f32>>,
}

fn lin_of_mut(b: &mut GpuBlock, l: Lin) -> &mut GpuLinear {
    match l {
        Lin::Qkv => &mut b.qkv,
        Lin::O => &mut b.o,
        Lin::GateUp => &mut b.gate_up,
        Lin::Down => &mut b.down,
    }
}

/// The bf16 compute copy of a slot (the buffer the forward reads).
fn weight_mut(w: &mut GpuWeights, s: Slot) -> Option<&mut DevBuf<bf16>> {
    match s {
        Slot::Embed => Some(&mut w.embed),
        Slot::LmHead => w.lm_head.as_mut(),
        Slot::FinalNorm => Some(&mut w.final_norm),
        Slot::Norm1(l) => Some(&mut w.text[l].norm1),
        Slot::Norm2(l) => Some(&mut w.text[l].norm2),
        Slot::Weight(l, k) => Some(&mut lin_of_mut(&mut w.text[l], k).w),
        Slot::Bias(l, k) => lin_of_mut(&mut w.text[l], k).b.as_mut(),
        Slot::Vision(v) => vision_weight_mut(w, v),
    }
}

/// The fp32 gradient accumulators, one per trained tensor, in a fixed order. They exist only
/// from a mini-batch's first micro-batch to its optimizer step (the plan's `grads.sS` lifetime),
/// so that rollout and scoring do not hold them (11.5 GiB at 3B): [`Grads::ensure`] makes them
/// zeroed on the micro-batch's stream, [`Grads::release`] frees them after the step.
struct Grads {
    t: Vec<TrainTensor>,
    /// Where the next mini-batch's sums go: the plan's `grads.sS` region of the running step
    /// (set by the executor), or the memory pool.
    region: Option<Arc<Region>>,
}

impl GradSink<BlockTensor> for Grads {
    fn grad(&mut self, t: BlockTensor) -> std::result::Result<&mut CudaSlice<f32>, GpuError> {
        self.get(match t {
            BlockTensor::Weight(l, k) => Slot::Weight(l, k),
            BlockTensor::Bias(l, k) => Slot::Bias(l, k),
            BlockTensor::Norm1(l) => Slot::Norm1(l),
            BlockTensor::Norm2(l) => Slot::Norm2(l),
        })
    }
}

impl Grads {
    fn get(&mut self, s: Slot) -> std::result::Result<&mut CudaSlice<f32>, GpuError> {
        let t = self
            .t
            .iter_mut()
            .find(|t| t.slot == s)
            .ok_or_else(|| GpuError::Input(format!("no trained tensor {s:?}")))?;
        Grads::of_mut(t)
    }

    /// The error of a tensor without a gradient sum (no micro-batch of this mini-batch ran).
    fn no_sum(name: &str) -> GpuError {
        GpuError::Input(format!("no gradient sum for {name}: no micro-batch began"))
    }

    /// A tensor's sum, or [`Grads::no_sum`].
    fn of(t: &TrainTensor) -> std::result::Result<&CudaSlice<f32>, GpuError> {
        t.grad.as_deref().ok_or_else(|| Grads::no_sum(&t.name))
    }

    fn of_mut(t: &mut TrainTensor) -> std::result::Result<&mut CudaSlice<f32>, GpuError> {
        match t.grad.as_deref_mut() {
            Some(g) => Ok(g),
            None => Err(Grads::no_sum(&t.name)),
        }
    }

    /// Zeroed sums on `s` for the tensors that have none (a mini-batch's first micro-batch):
    /// a new lifetime of the step's region when none has one.
    fn ensure(&mut self, gpu: &Gpu, s: &Arc<CudaStream>) -> Result<()> {
        let region = self.region.as_deref();
        if let Some(r) = region.filter(|_| self.t.iter().all(|t| t.grad.is_none())) {
            r.reset();
        }
        for t in self.t.iter_mut().filter(|t| t.grad.is_none()) {
            t.grad = Some(zeros_in::<f32>(gpu, s, t.numel, region)?);
        }
        Ok(())
    }

    /// Frees the sums once the work queued on `s` so far (the optimizer step) is done: the
    /// stream each was made on, where its drop queues the free, waits for that first.
    fn release(&mut self, gpu: &Gpu, s: &Arc<CudaStream>) -> Result<()> {
        let done = gpu.event()?;
        done.record(s)?;
        let sums: Vec<DevBuf<f32>> = self.t.iter_mut().filter_map(|t| t.grad.take()).collect();
        super::wait_before_free(sums.iter().map(|g| g.stream()), s, &done)?;
        drop(sums);
        Ok(())
    }
}

/// The trainer's gradient sums seen by the vision backward: a block's tensors are the vision
/// tower's (`Slot::Vision`), not the decoder's.
struct VisionView<'a>(&'a mut Grads);

impl GradSink<VisionSlot> for VisionView<'_> {
    fn grad(&mut self, v: VisionSlot) -> std::result::Result<&mut CudaSlice<f32>, GpuError> {
        self.0.get(Slot::Vision(v))
    }
}

impl GradSink<BlockTensor> for VisionView<'_> {
    fn grad(&mut self, t: BlockTensor) -> std::result::Result<&mut CudaSlice<f32>, GpuError> {
        self.0.get(Slot::Vision(match t {
            BlockTensor::Weight(l, k) => VisionSlot::Weight(l, k),
            BlockTensor::Bias(l, k) => VisionSlot::Bias(l, k),
            BlockTensor::Norm1(l) => VisionSlot::Norm1(l),
            BlockTensor::Norm2(l) => VisionSlot::Norm2(l),
        }))
    }
}

impl VisionSink for VisionView<'_> {
    fn holds_tower(&self) -> bool {
        self.0
            .t
            .iter()
            .any(|t| matches!(t.slot, Slot::Vision(v) if v.in_tower()))
    }
    fn holds_merger(&self) -> bool {
        self.0
            .t
            .iter()
            .any(|t| matches!(t.slot, Slot::Vision(v) if !v.in_tower()))
    }
    fn max_numel(&self) -> usize {
        self.0
            .t
            .iter()
            .filter(|t| matches!(t.slot, Slot::Vision(_)))
            .map(|t| t.numel)
            .max()
            .unwrap_or(1)
    }
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
    /// bf16 scratch for one weight gradient (the largest linear or the lm head).
    dw: CudaSlice<bf16>,
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
}

/// The actor's kept prompt forwards for training: per GRPO group, `copies` forwards of its
/// prompt (one with prefix dedup, one per sample without), every layer's input (bf16 residual
/// stream, for the recompute in backward) and K/V after RoPE (what the suffixes attend to) in
/// one store per iteration, rows laid out by [`layout_prefixes`]: `inputs [layers, rows, H]`,
/// `k`, `v` `[layers, rows, kv_width]`; `last [units, H]` holds each copy's last prompt row
/// after the final layer (token 0 of every response is scored from it).
///
/// Filled by [`GpuTrainer::prefix_forward`] (the plan's `ActorPrefix{Train}` tasks, which may
/// run inside decode windows), read by [`GpuTrainer::micro_batch_prefixed`]. A kept prefix is
/// valid only for the weights it was computed with: it records the optimizer step, and a
/// micro-batch of another step refuses it.
pub struct TrainPrefixes {
    rows: usize,
    layouts: Vec<PrefixLayout>,
    kept: Vec<Option<KeptPrefix>>,
    inputs: DevBuf<bf16>,
    k: DevBuf<bf16>,
    v: DevBuf<bf16>,
    last: CudaSlice<bf16>,
    /// The plan's region the store lies in: each group's kept vision state goes there too.
    region: Option<Arc<Region>>,
}

/// What a group's prefix forward leaves besides the store rows: the tables its backward
/// recomputes the layers with.
struct KeptPrefix {
    /// Optimizer steps the trainer had taken when the prefix ran (its weight version).
    version: u64,
    rope_delta: i64,
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
    /// One causal sequence per copy, rows from 0.
    seqs: CudaSlice<AttnSeqGpu>,
    /// Prompt ids with media rows set to `vocab` (the embedding backward skips them: their
    /// gradient goes to the vision backward, or nowhere when the tower and merger are frozen).
    bwd_ids: CudaSlice<u32>,
    /// The media's training forward when the tower or merger trains.
    vision: Option<KeptVision>,
}

/// A prompt's media encoding kept for the vision backward.
struct KeptVision {
    state: VisionTrainState,
    /// Per media token (the items' tokens in item order), its row in each copy of the prompt
    /// (copy order), rows of the group's prompt store rows.
    rows: Vec<Vec<u32>>,
}

impl TrainPrefixes {
    /// A store for groups given as `(prompt tokens, copies)`, in group order, for `model`'s text
    /// decoder (contents undefined until each group's prefix forward).
    pub fn new(
        gpu: &Gpu,
        s: &Arc<CudaStream>,
        model: &GpuModel,
        groups: &[(usize, u32)],
    ) -> Result<Self> {
        Self::new_in(gpu, s, model, groups, None)
    }

    /// [`TrainPrefixes::new`] with the kept layer inputs, keys and values in `region` of the
    /// plan's arena (`train_prefix.sS`), and later each group's kept vision state.
    pub fn new_in(
        gpu: &Gpu,
        s: &Arc<CudaStream>,
        model: &GpuModel,
        groups: &[(usize, u32)],
        region: Option<Arc<Region>>,
    ) -> Result<Self> {
        let r = region.as_deref();
        let (layouts, rows, units) = layout_prefixes(groups)?;
        let t = model.config.text();
        let (l, h) = (t.num_layers as usize, t.hidden_size as usize);
        let kvw = (t.num_kv_heads * t.head_dim()) as usize;
        Ok(TrainPrefixes {
            rows,
            kept: (0..layouts.len()).map(|_| None).collect(),
            layouts,
            inputs: alloc_in(gpu, s, l * rows * h, r)?,
            k: alloc_in(gpu, s, l * rows * kvw, r)?,
            v: alloc_in(gpu, s, l * rows * kvw, r)?,
            last: alloc(gpu, s, units * h)?,
            region,
        })
    }

    /// Groups the store was laid out for.
    pub fn groups(&self) -> usize {
        self.layouts.len()
    }

    /// Bytes of device memory the store holds.
    pub fn bytes(&self) -> usize {
        2 * (self.inputs.len() + self.k.len() + self.v.len() + self.last.len())
    }

    fn layout(&self, group: usize) -> Result<PrefixLayout> {
        self.layouts.get(group).copied().ok_or_else(|| {
            GpuError::Input(format!(
                "group {group} is not in the prefix store ({} groups)",
                self.layouts.len()
            ))
            .into()
        })
    }
}

/// One layer's activations (recomputed from its input in backward).
struct Acts {
    xn1: CudaSlice<bf16>,
    rstd1: CudaSlice<f32>,
    qkv: CudaSlice<bf16>,
    q: CudaSlice<bf16>,
    k: CudaSlice<bf16>,
    v: CudaSlice<bf16>,
    att: CudaSlice<bf16>,
    lse: CudaSlice<f32>,
    x_mid: CudaSlice<bf16>,
    xn2: CudaSlice<bf16>,
    rstd2: CudaSlice<f32>,
    gu: CudaSlice<bf16>,
    act: CudaSlice<bf16>,
    delta: CudaSlice<bf16>,
}

/// What a layer forward needs besides weights and activations.
struct LayerCtx<'a> {
    rows: usize,
    hidden: usize,
    dims: AttnDims,
    eps: f32,
    cos: &'a CudaSlice<f32>,
    sin: &'a CudaSlice<f32>,
    seqs: &'a CudaSlice<AttnSeqGpu>,
    n_seqs: usize,
    max_q: usize,
    iota: &'a CudaSlice<u32>,
    ones: &'a CudaSlice<bf16>,
}

impl Acts {
    fn new(gpu: &Gpu, s: &Arc<CudaStream>, c: &LayerCtx<'_>, b: &GpuBlock) -> Result<Self> {
        let (r, h) = (c.rows, c.hidden);
        let (qw, kvw) = (c.dims.q_width(), c.dims.kv_width());
        Ok(Acts {
            xn1: alloc(gpu, s, r * h)?,
            rstd1: alloc(gpu, s, r)?,
            qkv: alloc(gpu, s, r * b.qkv.out)?,
            q: alloc(gpu, s, r * qw)?,
            k: alloc(gpu, s, r * kvw)?,
            v: alloc(gpu, s, r * kvw)?,
            att: alloc(gpu, s, r * qw)?,
            lse: alloc(gpu, s, r * c.dims.num_heads)?,
            x_mid: alloc(gpu, s, r * h)?,
            xn2: alloc(gpu, s, r * h)?,
            rstd2: alloc(gpu, s, r)?,
            gu: alloc(gpu, s, r * 2 * b.ffn)?,
            act: alloc(gpu, s, r * b.ffn)?,
            delta: alloc(gpu, s, r * h)?,
        })
    }
}

fn linear(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    y: &mut CudaSlice<bf16>,
    x: &CudaSlice<bf16>,
    l: &GpuLinear,
    rows: usize,
) -> Result<()> {
    let b = l.b.as_ref().map(|b| b as &dyn DevicePtr<bf16>);
    linear_fwd_bf16(gpu, s, y, x, &l.w, b, rows, l.inp, l.out)?;
    Ok(())
}

/// The kept prefix K/V (this layer's store rows `lo..hi`) that suffix rows attend to; the
/// sequences' prefix spans count from `lo`.
struct PreKv<'a> {
    k: CudaView<'a, bf16>,
    v: CudaView<'a, bf16>,
}

/// Causal attention of the layer's packed rows (q, k, v after RoPE) after each sequence's
/// prefix span in `pk` / `pv` (the rows' own k / v when no sequence has a prefix), with the LSE
/// the backward reads.
#[allow(clippy::too_many_arguments)]
fn attend(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    c: &LayerCtx<'_>,
    att: &mut CudaSlice<bf16>,
    lse: &mut CudaSlice<f32>,
    (q, k, v): (&CudaSlice<bf16>, &CudaSlice<bf16>, &CudaSlice<bf16>),
    pk: &impl DevicePtr<bf16>,
    pv: &impl DevicePtr<bf16>,
) -> Result<()> {
    let d = c.dims;
    attention_fwd_bf16(
        gpu,
        s,
        att,
        Some(lse as &mut dyn DevicePtrMut<f32>),
        q,
        k,
        v,
        pk,
        pv,
        c.seqs,
        c.n_seqs,
        c.max_q,
        d,
        AttnMask::Causal,
        1.0 / (d.head_dim as f32).sqrt(),
        RowStrides::contiguous(d),
    )?;
    Ok(())
}

/// One decoder layer forward from `x_in`, filling `a`; when `x_out` is given the layer's output
/// (the next layer's input) is written there. With `pre`, each sequence attends to its prefix
/// span there before its own keys (as `score` does). Bitwise the model's `run_blocks` layer.
#[allow(clippy::too_many_arguments)]
fn layer_fwd(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    b: &GpuBlock,
    c: &LayerCtx<'_>,
    x_in: &impl DevicePtr<bf16>,
    a: &mut Acts,
    x_out: Option<&mut CudaSlice<bf16>>,
    pre: Option<&PreKv<'_>>,
) -> Result<()> {
    let (rows, h, d) = (c.rows, c.hidden, c.dims);
    let (qw, kvw) = (d.q_width(), d.kv_width());
    let row = qw + 2 * kvw;
    let ffn = b.ffn;
    rmsnorm_fwd_bf16(
        gpu,
        s,
        &mut a.xn1,
        Some(&mut a.rstd1 as &mut dyn DevicePtrMut<f32>),
        x_in,
        &b.norm1,
        rows,
        h,
        c.eps,
    )?;
    linear(gpu, s, &mut a.qkv, &a.xn1, &b.qkv, rows)?;
    rope_fwd_bf16(
        gpu,
        s,
        &mut a.qkv,
        c.cos,
        c.sin,
        rows,
        row,
        d.num_heads + d.num_kv_heads,
        d.head_dim,
        true,
    )?;
    // q, k, v into contiguous buffers (the attention backward writes dq/dk/dv at its inputs'
    // strides, and three views of one fused gradient buffer cannot be borrowed at once)
    kv_append_bf16(gpu, s, &mut a.q, &a.qkv, c.iota, rows, qw, row, qw)?;
    kv_append_bf16(
        gpu,
        s,
        &mut a.k,
        &a.qkv.slice(qw..),
        c.iota,
        rows,
        kvw,
        row,
        kvw,
    )?;
    kv_append_bf16(
        gpu,
        s,
        &mut a.v,
        &a.qkv.slice(qw + kvw..),
        c.iota,
        rows,
        kvw,
        row,
        kvw,
    )?;
    let (q, k, v) = (&a.q, &a.k, &a.v);
    match pre {
        Some(p) => attend(gpu, s, c, &mut a.att, &mut a.lse, (q, k, v), &p.k, &p.v)?,
        None => attend(gpu, s, c, &mut a.att, &mut a.lse, (q, k, v), k, v)?,
    }
    linear(gpu, s, &mut a.delta, &a.att, &b.o, rows)?;
    s.memcpy_dtod(x_in, &mut a.x_mid)?;
    add_rmsnorm_fwd_bf16(
        gpu,
        s,
        &mut a.xn2,
        Some(&mut a.rstd2 as &mut dyn DevicePtrMut<f32>),
        &mut a.x_mid,
        &a.delta,
        &b.norm2,
        rows,
        h,
        c.eps,
    )?;
    linear(gpu, s, &mut a.gu, &a.xn2, &b.gate_up, rows)?;
    let up = a.gu.slice(ffn..);
    swiglu_fwd_bf16(
        gpu,
        s,
        &mut a.act,
        &a.gu,
        &up,
        rows,
        ffn,
        ffn,
        2 * ffn,
        2 * ffn,
    )?;
    if let Some(x) = x_out {
        linear(gpu, s, &mut a.delta, &a.act, &b.down, rows)?;
        s.memcpy_dtod(&a.x_mid, x)?;
        add_fwd_bf16_inplace(gpu, s, x, &a.delta, rows * h)?;
    }
    Ok(())
}

/// How a layer's attention backward meets a kept prefix.
enum PrefixGrad<'a, 'b> {
    /// Suffix rows attending to `pre`: the prefix keys' gradients are added (fp32) into
    /// `dk`, `dv` (`[hi - lo, kv_width]`, the prefix spans' rows).
    Attend {
        pre: &'b PreKv<'a>,
        dk: &'b mut CudaSlice<f32>,
        dv: &'b mut CudaSlice<f32>,
    },
    /// Prefix rows whose K/V the suffixes also read: their gradients (fp32, these rows') are
    /// added to the rows' own before RoPE's backward.
    Extra {
        dk: CudaView<'a, f32>,
        dv: CudaView<'a, f32>,
    },
}

/// Backward of one layer: `dx` holds the gradient of the layer's output and ends holding the
/// gradient of its input; parameter gradients are added into `grads` (see [`PrefixGrad`]).
#[allow(clippy::too_many_arguments)]
fn layer_bwd(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    layer: usize,
    b: &GpuBlock,
    c: &LayerCtx<'_>,
    x_in: &impl DevicePtr<bf16>,
    a: &Acts,
    dx: &mut CudaSlice<bf16>,
    grads: &mut Grads,
    scratch: &mut CudaSlice<bf16>,
    prefix: PrefixGrad<'_, '_>,
) -> Result<()> {
    let (rows, h, d) = (c.rows, c.hidden, c.dims);
    let (qw, kvw) = (d.q_width(), d.kv_width());
    let row = qw + 2 * kvw;
    let bb = BlockBwd {
        gpu,
        s,
        layer,
        b,
        rows,
        hidden: h,
        ones: c.ones,
    };
    let saved = MlpSaved {
        x_mid: &a.x_mid,
        xn2: &a.xn2,
        rstd2: &a.rstd2,
        gu: &a.gu,
        act: &a.act,
        att: &a.att,
    };
    // MLP: delta = down(swiglu(gate_up(norm2(x_mid)))); attention: delta = o(attn(...))
    let datt = bb.mlp_and_o(grads, scratch, &saved, dx)?;
    let mut dq = alloc::<bf16>(gpu, s, rows * qw)?;
    let mut dk = alloc::<bf16>(gpu, s, rows * kvw)?;
    let mut dv = alloc::<bf16>(gpu, s, rows * kvw)?;
    let scale = 1.0 / (d.head_dim as f32).sqrt();
    let strides = RowStrides::contiguous(d);
    match prefix {
        PrefixGrad::Attend {
            pre,
            dk: dpk,
            dv: dpv,
        } => attention_bwd_bf16(
            gpu,
            s,
            &mut dq,
            &mut dk,
            &mut dv,
            dpk,
            dpv,
            &datt,
            &a.q,
            &a.k,
            &a.v,
            &pre.k,
            &pre.v,
            &a.att,
            &a.lse,
            c.seqs,
            c.n_seqs,
            d,
            AttnMask::Causal,
            scale,
            strides,
        )?,
        PrefixGrad::Extra { dk: ek, dv: ev } => {
            // no sequence has a prefix: one-row fp32 stand-ins
            let mut dpk = alloc::<f32>(gpu, s, kvw)?;
            let mut dpv = alloc::<f32>(gpu, s, kvw)?;
            attention_bwd_bf16(
                gpu,
                s,
                &mut dq,
                &mut dk,
                &mut dv,
                &mut dpk,
                &mut dpv,
                &datt,
                &a.q,
                &a.k,
                &a.v,
                &a.k,
                &a.v,
                &a.att,
                &a.lse,
                c.seqs,
                c.n_seqs,
                d,
                AttnMask::Causal,
                scale,
                strides,
            )?;
            add_f32_into_bf16(gpu, s, &mut dk, &ek, rows * kvw)?;
            add_f32_into_bf16(gpu, s, &mut dv, &ev, rows * kvw)?;
        }
    }
    drop(datt);
    rope_bwd_bf16(
        gpu,
        s,
        &mut dq,
        c.cos,
        c.sin,
        rows,
        qw,
        d.num_heads,
        d.head_dim,
    )?;
    rope_bwd_bf16(
        gpu,
        s,
        &mut dk,
        c.cos,
        c.sin,
        rows,
        kvw,
        d.num_kv_heads,
        d.head_dim,
    )?;
    let mut dqkv = alloc::<bf16>(gpu, s, rows * row)?;
    kv_append_bf16(gpu, s, &mut dqkv, &dq, c.iota, rows, qw, qw, row)?;
    kv_append_bf16(
        gpu,
        s,
        &mut dqkv.slice_mut(qw..),
        &dk,
        c.iota,
        rows,
        kvw,
        kvw,
        row,
    )?;
    kv_append_bf16(
        gpu,
        s,
        &mut dqkv.slice_mut(qw + kvw..),
        &dv,
        c.iota,
        rows,
        kvw,
        kvw,
        row,
    )?;
    drop((dq, dk, dv));
    bb.qkv_and_norm1(grads, scratch, &dqkv, &a.xn1, &a.rstd1, x_in, dx)?;
    Ok(())
}

/// The host f32 values of a slot from the CPU model (fused as `GpuWeights::upload` fuses).
fn host_values(model: &Qwen25VL, s: Slot) -> Option<(Vec<f32>, String, Vec<usize>)> {
    let w = &model.weights;
    let l = &w.layout;
    let named = |id| {
        let e = w.table.entry(id);
        (w.get(id).to_vec(), e.name.clone(), e.shape.clone())
    };
    let parts = |layer: usize, k: Lin| {
        let p = &l.text_layers[layer];
        match k {
            Lin::Qkv => vec![&p.q, &p.k, &p.v],
            Lin::O => vec![&p.o],
            Lin::GateUp => vec![&p.gate, &p.up],
            Lin::Down => vec![&p.down],
        }
    };
    match s {
        Slot::Embed => Some(named(l.embed)),
        Slot::LmHead => (l.lm_head != l.embed).then(|| named(l.lm_head)),
        Slot::FinalNorm => Some(named(l.final_norm)),
        Slot::Norm1(i) => Some(named(l.text_layers[i].norm1)),
        Slot::Norm2(i) => Some(named(l.text_layers[i].norm2)),
        Slot::Weight(i, k) => {
            let ps = parts(i, k);
            let (wt, _, out) = fuse_linears(w, &ps);
            let e = w.table.entry(ps[0].w);
            Some((wt, e.name.clone(), vec![out, ps[0].inp]))
        }
        Slot::Bias(i, k) => {
            let ps = parts(i, k);
            let (_, b, out) = fuse_linears(w, &ps);
            let id = ps.iter().find_map(|p| p.b)?;
            Some((b?, w.table.entry(id).name.clone(), vec![out]))
        }
        Slot::Vision(v) => {
            let (name, shape) = vision_slot_meta(&w.table, l, v);
            Some((vision_host_values(model, v), name, shape))
        }
    }
}

/// The CPU model's parameter slots a device tensor splits into: `(param id, first row, rows)`
/// of the fused tensor, with the part's row width.
fn cpu_parts(layout: &Layout, s: Slot) -> Vec<(crate::model::ParamId, usize, usize)> {
    let parts = |layer: usize, k: Lin| {
        let p = &layout.text_layers[layer];
        match k {
            Lin::Qkv => vec![p.q, p.k, p.v],
            Lin::O => vec![p.o],
            Lin::GateUp => vec![p.gate, p.up],
            Lin::Down => vec![p.down],
        }
    };
    match s {
        Slot::Embed => vec![(layout.embed, 0, 0)],
        Slot::LmHead => vec![(layout.lm_head, 0, 0)],
        Slot::FinalNorm => vec![(layout.final_norm, 0, 0)],
        Slot::Norm1(i) => vec![(layout.text_layers[i].norm1, 0, 0)],
        Slot::Norm2(i) => vec![(layout.text_layers[i].norm2, 0, 0)],
        Slot::Weight(i, k) => {
            let mut row = 0;
            parts(i, k)
                .into_iter()
                .map(|p| {
                    let r = (p.w, row, p.out);
                    row += p.out;
                    r
                })
                .collect()
        }
        Slot::Bias(i, k) => {
            let mut row = 0;
            parts(i, k)
                .into_iter()
                .filter_map(|p| {
                    let r = p.b.map(|b| (b, row, p.out));
                    row += p.out;
                    r
                })
                .collect()
        }
        Slot::Vision(v) => vision_cpu_parts(layout, v),
    }
}

/// The trained slots of a model on the device, in the trainer's fixed order: embeddings, the
/// untied lm head, the final norm, per layer its norms and fused linears with their biases,
/// then the vision tower's and the merger's unless frozen ([`vision_slots`]' order).
fn train_slots(layout: &Layout, cfg: &TrainConfig) -> Vec<Slot> {
    let mut slots = vec![Slot::Embed];
    if layout.lm_head != layout.embed {
        slots.push(Slot::LmHead);
    }
    slots.push(Slot::FinalNorm);
    for (l, p) in layout.text_layers.iter().enumerate() {
        slots.push(Slot::Norm1(l));
        slots.push(Slot::Norm2(l));
        for (k, parts) in [
            (Lin::Qkv, vec![&p.q, &p.k, &p.v]),
            (Lin::O, vec![&p.o]),
            (Lin::GateUp, vec![&p.gate, &p.up]),
            (Lin::Down, vec![&p.down]),
        ] {
            slots.push(Slot::Weight(l, k));
            // as `fuse_linears`: a fused bias when any part has one
            if parts.iter().any(|x| x.b.is_some()) {
                slots.push(Slot::Bias(l, k));
            }
        }
    }
    let (tower, merger) = (!cfg.freeze_vision, !cfg.freeze_merger);
    slots.extend(
        vision_slots(layout, tower, merger)
            .into_iter()
            .map(Slot::Vision),
    );
    slots
}

/// Where each CPU-model tensor of a fused device tensor of `numel` values lies in it: `(param
/// id, element range)` per part of [`cpu_parts`]. Rows of a fused tensor whose CPU tensor does
/// not exist (a missing bias, zero in the fused copy) belong to no part.
fn part_ranges(
    table: &ParamTable,
    parts: &[(crate::model::ParamId, usize, usize)],
    numel: usize,
) -> Result<Vec<(crate::model::ParamId, std::ops::Range<usize>)>> {
    parts
        .iter()
        .map(|&(id, row0, rows)| {
            let e = table.entry(id);
            let r = match e.len.checked_div(rows) {
                // a part of a fused tensor: its rows
                Some(width) => row0 * width..(row0 + rows) * width,
                // a whole tensor
                None => 0..e.len,
            };
            if r.len() != e.len || r.end > numel {
                return Err(GpuError::Input(format!(
                    "tensor {} ({} values) does not fit elements {r:?} of a fused tensor of {numel}",
                    e.name, e.len
                ))
                .into());
            }
            Ok((id, r))
        })
        .collect()
}

/// The CPU-model tensors of a fused device tensor's values: `(param id, its values)` per part.
fn split_fused<'a>(
    table: &ParamTable,
    parts: &[(crate::model::ParamId, usize, usize)],
    fused: &'a [f32],
) -> Result<Vec<(crate::model::ParamId, &'a [f32])>> {
    Ok(part_ranges(table, parts, fused.len())?
        .into_iter()
        .map(|(id, r)| (id, &fused[r]))
        .collect())
}

/// The inverse of [`split_fused`]: a fused tensor of `numel` values from its parts' values
/// (`part(id)`), zero where no CPU tensor lies (a missing bias, as `fuse_linears` fills it).
fn fuse_parts<'a>(
    table: &ParamTable,
    parts: &[(crate::model::ParamId, usize, usize)],
    numel: usize,
    mut part: impl FnMut(crate::model::ParamId) -> Result<&'a [f32]>,
) -> Result<Vec<f32>> {
    let mut out = vec![0f32; numel];
    for (id, r) in part_ranges(table, parts, numel)? {
        let src = part(id)?;
        if src.len() != r.len() {
            return Err(GpuError::Input(format!(
                "tensor {} has {} values, the model's has {}",
                table.entry(id).name,
                src.len(),
                r.len()
            ))
            .into());
        }
        out[r].copy_from_slice(src);
    }
    Ok(out)
}

/// The optimizer state of one trained tensor of the CPU model (the fused device tensors split
/// into their parts), as a checkpoint stores it.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamState {
    /// The CPU model's tensor name (Hugging Face layout).
    pub name: String,
    pub shape: Vec<usize>,
    /// fp32 master weights, AdamW's first and second moments.
    pub master: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
}

/// The trainer's state on the host, per CPU-model tensor, in the trainer's order: what a
/// checkpoint saves and [`GpuTrainer::import_state`] restores.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuTrainState {
    pub params: Vec<ParamState>,
    /// Optimizer steps taken.
    pub steps: u64,
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
        let gm = GpuModel::upload_in(gpu, stream, model, place.weights.as_deref())?;
        let (masters, moments) = (place.masters.as_deref(), place.moments.as_deref());
        let slots = train_slots(&model.weights.layout, &cfg);
        let mut t = Vec::with_capacity(slots.len());
        let mut biggest = 0usize;
        for s in slots {
            let (vals, name, shape) = host_values(model, s)
                .ok_or_else(|| GpuError::Input(format!("model has no host tensor for {s:?}")))?;
            let numel = vals.len();
            biggest = biggest.max(numel);
            t.push(TrainTensor {
                slot: s,
                decay: default_decay(&name, &shape),
                name,
                numel,
                master: upload_in(gpu, stream, &vals, masters)?,
                // zeroed on the device (no host copy of three model-sized zero buffers)
                m: zeros_in::<f32>(gpu, stream, numel, moments)?,
                v: zeros_in::<f32>(gpu, stream, numel, moments)?,
                grad: None,
            });
        }
        let dw = alloc::<bf16>(gpu, stream, biggest.max(1))?;
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
            dw,
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
    /// Optimizer steps taken.
    pub fn steps(&self) -> u64 {
        self.steps
    }
    /// Names of the trained tensors (fused q|k|v and gate|up are named by their first part).
    pub fn tensor_names(&self) -> Vec<String> {
        self.grads.t.iter().map(|t| t.name.clone()).collect()
    }

    /// The accumulated gradient in the CPU model's layout (a `table.total()` buffer, the fused
    /// tensors split into their parts; frozen tensors are zero). Synchronises.
    pub fn grads_host(&self, stream: &Arc<CudaStream>) -> Result<Vec<f32>> {
        let mut out = vec![0f32; self.table.total()];
        for t in &self.grads.t {
            let Some(grad) = &t.grad else { continue };
            let g = download(stream, grad)?;
            let parts = cpu_parts(&self.layout, t.slot);
            for (id, x) in split_fused(&self.table, &parts, &g[..t.numel])? {
                let e = self.table.entry(id);
                out[e.offset..e.offset + e.len].copy_from_slice(x);
            }
        }
        Ok(out)
    }

    /// The trainer's state on the host (synchronises): the fp32 masters written into `into`'s
    /// trained tensors (its frozen tensors are left as they are, so `into`
    /// should hold the weights the trainer was built from), and per trained CPU-model tensor
    /// its master and AdamW moments, with the optimizer step. The device's bf16 compute copy
    /// is the round-to-nearest-even of the masters (`adamw_step_f32`, `GpuWeights::upload`),
    /// so the state determines it.
    pub fn export_state(
        &self,
        stream: &Arc<CudaStream>,
        into: &mut Qwen25VL,
    ) -> Result<GpuTrainState> {
        if into.weights.table.total() != self.table.total() || into.weights.layout != self.layout {
            return Err(GpuError::Input(
                "export_state: the host model has another layout than the trained one".into(),
            )
            .into());
        }
        let mut params = Vec::new();
        for t in &self.grads.t {
            let parts = cpu_parts(&self.layout, t.slot);
            let master = download(stream, &t.master)?;
            let m = download(stream, &t.m)?;
            let v = download(stream, &t.v)?;
            let (master, m, v) = (&master[..t.numel], &m[..t.numel], &v[..t.numel]);
            let pieces = [
                split_fused(&self.table, &parts, master)?,
                split_fused(&self.table, &parts, m)?,
                split_fused(&self.table, &parts, v)?,
            ];
            for (i, &(id, x)) in pieces[0].iter().enumerate() {
                into.weights.get_mut(id).copy_from_slice(x);
                let e = self.table.entry(id);
                params.push(ParamState {
                    name: e.name.clone(),
                    shape: e.shape.clone(),
                    master: x.to_vec(),
                    m: pieces[1][i].1.to_vec(),
                    v: pieces[2][i].1.to_vec(),
                });
            }
        }
        Ok(GpuTrainState {
            params,
            steps: self.steps,
        })
    }

    /// Restores a state [`GpuTrainer::export_state`] produced (or a CPU-backend checkpoint's
    /// optimizer, same names): the fp32 masters, the moments, the optimizer step, and the bf16
    /// compute copy re-derived from the masters (round to nearest even, as the optimizer step
    /// writes it: bitwise what the run that saved the state computed with). Frozen tensors keep
    /// the weights the trainer was built from. Every trained tensor must be present with its
    /// shape, and nothing else; the accumulated gradient is dropped. Synchronises.
    pub fn import_state(&mut self, stream: &Arc<CudaStream>, state: &GpuTrainState) -> Result<()> {
        let by_name: std::collections::HashMap<&str, &ParamState> =
            state.params.iter().map(|p| (p.name.as_str(), p)).collect();
        if by_name.len() != state.params.len() {
            return Err(GpuError::Input("import_state: a tensor is listed twice".into()).into());
        }
        let mut used = 0usize;
        for t in self.grads.t.iter_mut() {
            let parts = cpu_parts(&self.layout, t.slot);
            let table = &self.table;
            let find = |id: crate::model::ParamId| -> Result<&ParamState> {
                let e = table.entry(id);
                let p = by_name.get(e.name.as_str()).ok_or_else(|| {
                    GpuError::Input(format!(
                        "the state has no tensor {} (it trains other tensors than this model)",
                        e.name
                    ))
                })?;
                if p.shape != e.shape || [&p.master, &p.m, &p.v].iter().any(|x| x.len() != e.len) {
                    return Err(GpuError::Input(format!(
                        "tensor {} has shape {:?} ({}, {}, {} values), this model's is {:?}",
                        e.name,
                        p.shape,
                        p.master.len(),
                        p.m.len(),
                        p.v.len(),
                        e.shape
                    ))
                    .into());
                }
                Ok(p)
            };
            let master = fuse_parts(table, &parts, t.numel, |id| Ok(&find(id)?.master[..]))?;
            let m = fuse_parts(table, &parts, t.numel, |id| Ok(&find(id)?.m[..]))?;
            let v = fuse_parts(table, &parts, t.numel, |id| Ok(&find(id)?.v[..]))?;
            used += parts.len();
            let out = weight_mut(&mut self.model.weights, t.slot).ok_or_else(|| {
                GpuError::Input(format!("no device weight for trained tensor {}", t.name))
            })?;
            let copy: Vec<bf16> = master.iter().map(|&x| bf16::from_f32(x)).collect();
            stream.memcpy_htod(&copy[..], &mut out.slice_mut(..t.numel))?;
            stream.memcpy_htod(&master[..], &mut t.master.slice_mut(..t.numel))?;
            stream.memcpy_htod(&m[..], &mut t.m.slice_mut(..t.numel))?;
            stream.memcpy_htod(&v[..], &mut t.v.slice_mut(..t.numel))?;
            // the host buffers must outlive the copies
            stream.synchronize()?;
            // a gradient sum of a mini-batch in progress does not survive the load (the
            // device is idle here: the drop's free has nothing to wait for)
            if let Some(g) = t.grad.take() {
                g.stream().synchronize()?;
            }
        }
        if used != state.params.len() {
            return Err(GpuError::Input(format!(
                "the state holds {} tensors, this model trains {used}",
                state.params.len()
            ))
            .into());
        }
        self.steps = state.steps;
        self.micro = 0;
        self.metrics = LossMetrics::default();
        Ok(())
    }

    /// Forward, loss and backward of micro-batch `index` (0-based, plan order) of the current
    /// mini-batch whose normaliser is `norm`, for groups given with their prompts: each group's
    /// prompt runs once ([`GpuTrainer::prefix_forward`] into a store made for this call), then
    /// [`GpuTrainer::micro_batch_prefixed`]. Gradients are added into the fp32 sums.
    /// Synchronises once (the log-probs come down for the loss).
    pub fn micro_batch(
        &mut self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        index: u32,
        groups: &[GpuGroupBatch<'_>],
        norm: Normaliser,
    ) -> Result<MicroBatchOutput> {
        self.check_next(index)?;
        let lens: Vec<(usize, u32)> = groups.iter().map(|g| (g.prompt_ids.len(), 1)).collect();
        let mut store = TrainPrefixes::new(gpu, stream, &self.model, &lens)?;
        for (i, g) in groups.iter().enumerate() {
            self.prefix_forward(gpu, stream, &mut store, i, g.prompt_ids, g.media)?;
        }
        let kept: Vec<PrefixedGroup<'_>> = groups
            .iter()
            .enumerate()
            .map(|(i, g)| PrefixedGroup {
                group: i,
                responses: g.responses,
            })
            .collect();
        self.micro_batch_prefixed(gpu, stream, index, &kept, norm, &store)
    }

    fn check_next(&self, index: u32) -> Result<()> {
        if index != self.micro {
            return Err(TrainError::Invalid(format!(
                "micro-batch {index} given, but micro-batch {} is next in plan order",
                self.micro
            ))
            .into());
        }
        Ok(())
    }

    fn text_dims(&self) -> Result<AttnDims> {
        let t = self.model.config.text();
        let dims = AttnDims {
            num_heads: t.num_heads as usize,
            num_kv_heads: t.num_kv_heads as usize,
            head_dim: t.head_dim() as usize,
        };
        if !dims.head_dim.is_multiple_of(16) {
            return Err(GpuError::Unsupported(format!(
                "text head_dim {}: the CUDA attention kernels need a multiple of 16",
                dims.head_dim
            ))
            .into());
        }
        Ok(dims)
    }

    /// The prompt forward of `group` of `store` with the current weights (the plan's
    /// `ActorPrefix{Train}`): the store's `copies` of the prompt packed in one call, every
    /// layer's input and K/V kept in the group's store rows, each copy's last row after the
    /// final layer kept for token 0. One call per group, so a group's bits never depend on the
    /// others. Nothing synchronises.
    pub fn prefix_forward(
        &self,
        gpu: &Gpu,
        s: &Arc<CudaStream>,
        store: &mut TrainPrefixes,
        group: usize,
        prompt_ids: &[u32],
        media: PromptMedia<'_>,
    ) -> Result<()> {
        let lay = store.layout(group)?;
        if prompt_ids.len() != lay.len {
            return Err(GpuError::Input(format!(
                "group {group}: a prompt of {} tokens for store rows laid out for {}",
                prompt_ids.len(),
                lay.len
            ))
            .into());
        }
        let owned;
        let mut vision_state = None;
        let media: Vec<&GpuEncodedMedia> = match media {
            PromptMedia::Encoded(m) => {
                if self.trains_vision() && !m.is_empty() {
                    return Err(TrainError::Invalid(
                        "this trainer trains the vision tower or merger: give the prompt's \
                         media as PromptMedia::Raw (embeddings of a frozen tower carry no \
                         gradient)"
                            .into(),
                    )
                    .into());
                }
                m.to_vec()
            }
            PromptMedia::Raw(items) => {
                owned = if self.trains_vision() && !items.is_empty() {
                    let (e, st) = self.model.encode_media_train_in(
                        gpu,
                        s,
                        items,
                        !self.cfg.freeze_vision,
                        store.region.as_deref(),
                    )?;
                    vision_state = Some(st);
                    e
                } else {
                    self.model.encode_media(gpu, s, items)?
                };
                owned.iter().collect()
            }
        };
        let cfg = &self.model.config;
        let t = cfg.text();
        let (h, vocab) = (t.hidden_size as usize, t.vocab_size as usize);
        let dims = self.text_dims()?;
        let spec = PromptSpec {
            ids: prompt_ids,
            media: media.iter().map(|m| media_slot(m.kind, m.grid)).collect(),
        };
        let p = PackedPrompts::new(cfg, &vec![spec; lay.copies])?;
        check_ids("train prefix", &p.ids, vocab)?;
        let rows = p.ids.len();
        let per_copy: usize = media.iter().map(|m| m.tokens).sum();
        let media_tokens = per_copy * lay.copies;
        if media_tokens != p.media_rows.len() {
            return Err(GpuError::Input(format!(
                "{} media placeholder tokens but the media carry {media_tokens} embeddings",
                p.media_rows.len()
            ))
            .into());
        }
        for m in &media {
            if m.embeds.len() < m.tokens * h {
                return Err(GpuError::Input(format!(
                    "a media item holds {} embedding values, expected {} x {h}",
                    m.embeds.len(),
                    m.tokens
                ))
                .into());
            }
        }
        let mut bwd_ids = p.ids.clone();
        for &r in &p.media_rows {
            bwd_ids[r as usize] = vocab as u32;
        }
        let gseqs: Vec<AttnSeqGpu> = p.seqs.iter().map(AttnSeqGpu::from_fwd).collect();
        let ones_v = vec![bf16::ONE; rows];
        // every table goes up through page-locked staging before the first launch: a pageable
        // upload would wait for the stream's earlier work, and this task may be one of several
        // queued on a decode window's side stream that the host must not wait for
        let bytes = staged_bytes(&p.ids)
            + staged_bytes(&p.cos)
            + staged_bytes(&p.sin)
            + staged_bytes(&gseqs)
            + staged_bytes(&bwd_ids)
            + staged_bytes(&ones_v)
            + staged_bytes(&p.media_rows);
        let (ids_d, cos, sin, seqs, bwd_ids, ones, slots) = {
            let mut up = self.model.stage(s, bytes)?;
            (
                up.put(gpu, &p.ids)?,
                up.put(gpu, &p.cos)?,
                up.put(gpu, &p.sin)?,
                up.put(gpu, &gseqs)?,
                up.put(gpu, &bwd_ids)?,
                up.put(gpu, &ones_v)?,
                up.put(gpu, &p.media_rows)?,
            )
        };
        let iota = self.model.iota(s, rows)?;
        let w = &self.model.weights;
        let mut x = alloc::<bf16>(gpu, s, rows * h)?;
        embedding_fwd_bf16(gpu, s, &mut x, &w.embed, &ids_d, rows, h, h)?;
        if media_tokens > 0 {
            let mut cat = alloc::<bf16>(gpu, s, media_tokens * h)?;
            let mut off = 0;
            for _ in 0..lay.copies {
                for m in &media {
                    let n = m.tokens * h;
                    s.memcpy_dtod(&m.embeds.slice(..n), &mut cat.slice_mut(off..off + n))?;
                    off += n;
                }
            }
            kv_append_bf16(gpu, s, &mut x, &cat, &slots, media_tokens, h, h, h)?;
        }
        let ctx = LayerCtx {
            rows,
            hidden: h,
            dims,
            eps: t.rms_norm_eps as f32,
            cos: &cos,
            sin: &sin,
            seqs: &seqs,
            n_seqs: lay.copies,
            max_q: lay.len,
            iota: &iota,
            ones: &ones,
        };
        let layers = w.text.len();
        if layers == 0 {
            return Err(GpuError::Input("the model has no text layers to train".into()).into());
        }
        let mut acts = Acts::new(gpu, s, &ctx, &w.text[0])?;
        let (all, kvw) = (store.rows, dims.kv_width());
        for (l, b) in w.text.iter().enumerate() {
            let first = l * all + lay.row0;
            let r = first * h..(first + rows) * h;
            s.memcpy_dtod(&x, &mut store.inputs.slice_mut(r.clone()))?;
            layer_fwd(
                gpu,
                s,
                b,
                &ctx,
                &store.inputs.slice(r),
                &mut acts,
                Some(&mut x),
                None,
            )?;
            let kr = first * kvw..(first + rows) * kvw;
            s.memcpy_dtod(&acts.k, &mut store.k.slice_mut(kr.clone()))?;
            s.memcpy_dtod(&acts.v, &mut store.v.slice_mut(kr))?;
        }
        for c in 0..lay.copies {
            let (row, u) = (c * lay.len + lay.len - 1, lay.unit0 + c);
            s.memcpy_dtod(
                &x.slice(row * h..(row + 1) * h),
                &mut store.last.slice_mut(u * h..(u + 1) * h),
            )?;
        }
        // the media rows are copy-major (each copy's items in order): token i of copy c is
        // media row c * per_copy + i
        let vision = vision_state.map(|state| KeptVision {
            state,
            rows: (0..per_copy)
                .map(|i| {
                    (0..lay.copies)
                        .map(|c| p.media_rows[c * per_copy + i])
                        .collect()
                })
                .collect(),
        });
        store.kept[group] = Some(KeptPrefix {
            version: self.steps,
            rope_delta: p.deltas[0],
            cos,
            sin,
            seqs,
            bwd_ids,
            vision,
        });
        Ok(())
    }

    /// Forward, loss and backward of micro-batch `index` (plan order) over groups whose
    /// prompts' forwards are kept in `store` ([`GpuTrainer::prefix_forward`] with the current
    /// weights): the response suffixes run as one packed batch attending to their copy's kept
    /// K/V; backward runs the layers top-down, each layer's suffix rows first (their attention
    /// adds the prefix keys' gradients, fp32) and then each group's prompt rows (recomputed from
    /// their kept inputs, the suffixes' K/V gradients added to their own), and ends in the token
    /// embeddings. Token 0 of a response is scored from its copy's kept last row; its gradient
    /// reaches that row (summed over the copy's responses in order). Every group is whole in
    /// its micro-batch, so each prompt's backward runs once, here. Synchronises once.
    pub fn micro_batch_prefixed(
        &mut self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        index: u32,
        groups: &[PrefixedGroup<'_>],
        norm: Normaliser,
        store: &TrainPrefixes,
    ) -> Result<MicroBatchOutput> {
        self.check_next(index)?;
        self.grads.ensure(gpu, stream)?;
        let out = self.forward_backward(gpu, stream, groups, norm, store)?;
        self.micro += 1;
        self.metrics.add(&out.metrics);
        Ok(out)
    }

    fn forward_backward(
        &mut self,
        gpu: &Gpu,
        s: &Arc<CudaStream>,
        groups: &[PrefixedGroup<'_>],
        norm: Normaliser,
        store: &TrainPrefixes,
    ) -> Result<MicroBatchOutput> {
        let cfg = self.model.config.clone();
        let t = cfg.text();
        let (h, vocab) = (t.hidden_size as usize, t.vocab_size as usize);
        let eps = t.rms_norm_eps as f32;
        let dims = self.text_dims()?;
        let temp = self.cfg.temperature;
        // ---- inputs ----
        for (gi, g) in groups.iter().enumerate() {
            for (r, resp) in g.responses.iter().enumerate() {
                let n = resp.tokens.len();
                let what = |x: &str| format!("group {gi} response {r} {x}");
                crate::train::check_len(&what("old_logp"), n, resp.old_logp.len())?;
                crate::train::check_len(&what("advantages"), n, resp.advantages.len())?;
                crate::train::check_len(&what("mask"), n, resp.mask.len())?;
                if let Some(rl) = resp.ref_logp {
                    crate::train::check_len(&what("ref_logp"), n, rl.len())?;
                }
            }
            if self.cfg.loss.kl_coef > 0.0 && g.responses.iter().any(|r| r.ref_logp.is_none()) {
                return Err(TrainError::Invalid(format!(
                    "group {gi}: kl_coef = {} needs reference log-probs for every response",
                    self.cfg.loss.kl_coef
                ))
                .into());
            }
        }
        let mut out = MicroBatchOutput::default();
        let trains: Vec<bool> = groups
            .iter()
            .map(|g| g.responses.iter().any(|r| !r.tokens.is_empty()))
            .collect();
        if !trains.iter().any(|&x| x) {
            for g in groups {
                for _ in g.responses {
                    out.logp.push(Vec::new());
                    out.entropy.push(Vec::new());
                }
            }
            return Ok(out);
        }
        let mut packs = Vec::with_capacity(groups.len());
        let mut kept = Vec::with_capacity(groups.len());
        for (gi, g) in groups.iter().enumerate() {
            let layout = store.layout(g.group)?;
            let k = store.kept[g.group].as_ref().ok_or_else(|| {
                TrainError::Invalid(format!(
                    "micro-batch group {gi} (prefix store group {}) trains before its prompt's \
                     forward (ActorPrefix) ran",
                    g.group
                ))
            })?;
            if k.version != self.steps {
                return Err(TrainError::Invalid(format!(
                    "the kept prompt forward of store group {} ran with the weights after {} \
                     optimizer steps, but {} steps have been taken: a kept prefix is valid only \
                     for the weights it ran with (recompute it after the optimizer step)",
                    g.group, k.version, self.steps
                ))
                .into());
            }
            kept.push(k);
            packs.push(PackGroup {
                layout,
                rope_delta: k.rope_delta,
                responses: g.responses.iter().map(|r| r.tokens).collect(),
            });
        }
        let pk = SuffixPack::new(&cfg, &packs)?;
        let (srows, frows) = (pk.rows(), pk.rows() + pk.first.len());
        // ---- the loss's per-token inputs in head-row order, uploaded before the first launch
        // (a pageable upload waits for the stream's earlier work) ----
        let n_head = pk.head_rows.len();
        let all_ref = groups
            .iter()
            .all(|g| g.responses.iter().all(|r| r.ref_logp.is_some()));
        let mut old_h = vec![0f32; n_head];
        let mut adv_h = vec![0f32; n_head];
        let mut ref_h = vec![0f32; if all_ref { n_head } else { 0 }];
        let mut loss_seqs: Vec<(usize, &[bool])> = Vec::new();
        for (gi, g) in groups.iter().enumerate() {
            for (r, resp) in g.responses.iter().enumerate() {
                let Some(a) = pk.starts[gi][r] else {
                    loss_seqs.push((0, &[]));
                    continue;
                };
                let rows = a..a + resp.tokens.len();
                old_h[rows.clone()].copy_from_slice(resp.old_logp);
                adv_h[rows.clone()].copy_from_slice(resp.advantages);
                if let (true, Some(rl)) = (all_ref, resp.ref_logp) {
                    ref_h[rows].copy_from_slice(rl);
                }
                loss_seqs.push((a, resp.mask));
            }
        }
        let tables = LossTables::new(n_head, &loss_seqs)?;
        let old_d = upload(s, &old_h)?;
        let adv_d = upload(s, &adv_h)?;
        let ref_d = upload(s, &ref_h)?;
        let seq_d = upload(s, &tables.seq)?;
        let mask_d = upload(s, &tables.mask)?;
        let seq_tokens_d = upload(s, &tables.seq_tokens)?;
        let head_rows = upload(s, &pk.head_rows)?;
        let targets = upload(s, &pk.targets)?;
        let w = &self.model.weights;
        let layers = w.text.len();
        let (all, kvw, lo, hi) = (store.rows, dims.kv_width(), pk.lo, pk.hi);
        let pre_of = |l: usize| PreKv {
            k: store.k.slice((l * all + lo) * kvw..(l * all + hi) * kvw),
            v: store.v.slice((l * all + lo) * kvw..(l * all + hi) * kvw),
        };
        let max_rows = packs
            .iter()
            .map(|p| p.layout.rows())
            .chain([srows])
            .max()
            .unwrap_or(1)
            .max(1);
        let iota_v: Vec<u32> = (0..max_rows as u32).collect();
        let iota = upload(s, &iota_v)?;
        let ones = upload(s, &vec![bf16::ONE; max_rows])?;
        let ids_d = upload(s, &pk.ids)?;
        let cos = upload(s, &pk.cos)?;
        let sin = upload(s, &pk.sin)?;
        let gseqs: Vec<AttnSeqGpu> = pk.seqs.iter().map(AttnSeqGpu::from_fwd).collect();
        let seqs_d = upload(s, &gseqs)?;
        let sctx = LayerCtx {
            rows: srows,
            hidden: h,
            dims,
            eps,
            cos: &cos,
            sin: &sin,
            seqs: &seqs_d,
            n_seqs: gseqs.len(),
            max_q: pk.seqs.iter().map(|q| q.len as usize).max().unwrap_or(0),
            iota: &iota,
            ones: &ones,
        };
        // ---- suffix forward: keep each layer's input; final rows then the token-0 rows ----
        let mut fin = alloc::<bf16>(gpu, s, frows * h)?;
        // `Recompute::None` keeps every layer's activations of the suffix rows and the lm head's
        // logits for the backward; `Full` keeps the layer inputs only and recomputes (the same
        // launches on the same inputs: bitwise the same activations, so the same gradient)
        let keep = self.cfg.recompute == Recompute::None;
        let mut suffix = None;
        if srows > 0 {
            let mut x = alloc::<bf16>(gpu, s, srows * h)?;
            embedding_fwd_bf16(gpu, s, &mut x, &w.embed, &ids_d, srows, h, h)?;
            let mut inputs = alloc::<bf16>(gpu, s, layers * srows * h)?;
            // one buffer reused by every layer (`Full`), or one per layer, kept (`None`)
            let mut acts = match keep {
                true => None,
                false => Some(Acts::new(gpu, s, &sctx, &w.text[0])?),
            };
            let mut kept_acts: Vec<Option<Acts>> = Vec::new();
            for (l, b) in w.text.iter().enumerate() {
                let r = l * srows * h..(l + 1) * srows * h;
                s.memcpy_dtod(&x, &mut inputs.slice_mut(r.clone()))?;
                let a = match acts.as_mut() {
                    Some(a) => a,
                    None => {
                        kept_acts.push(Some(Acts::new(gpu, s, &sctx, b)?));
                        kept_acts[l].as_mut().expect("pushed above")
                    }
                };
                layer_fwd(
                    gpu,
                    s,
                    b,
                    &sctx,
                    &inputs.slice(r),
                    a,
                    Some(&mut x),
                    Some(&pre_of(l)),
                )?;
            }
            s.memcpy_dtod(&x, &mut fin.slice_mut(..srows * h))?;
            suffix = Some((inputs, acts, kept_acts));
        }
        for (i, f) in pk.first.iter().enumerate() {
            let r = srows + i;
            s.memcpy_dtod(
                &store.last.slice(f.unit * h..(f.unit + 1) * h),
                &mut fin.slice_mut(r * h..(r + 1) * h),
            )?;
        }
        // ---- head forward: log-probs of every response token ----
        let mut lp_d = alloc::<f32>(gpu, s, n_head)?;
        let mut ent_d = alloc::<f32>(gpu, s, n_head)?;
        // per chunk (with `keep`): the head's input rows, their norm and rstd, and the logits
        let mut kept_head = Vec::new();
        for c0 in (0..n_head).step_by(LM_CHUNK) {
            let n = LM_CHUNK.min(n_head - c0);
            let (g, xn, rstd) =
                self.head_rows(gpu, s, &fin, frows, &head_rows.slice(c0..c0 + n), n)?;
            let mut logits = alloc::<bf16>(gpu, s, n * vocab)?;
            linear_fwd_bf16(
                gpu,
                s,
                &mut logits,
                &xn,
                self.model.weights.lm_head(),
                None,
                n,
                h,
                vocab,
            )?;
            let mut e = ent_d.slice_mut(c0..c0 + n);
            logprobs_fwd_bf16(
                gpu,
                s,
                &mut lp_d.slice_mut(c0..c0 + n),
                Some(&mut e as &mut dyn DevicePtrMut<f32>),
                None,
                &logits,
                &targets.slice(c0..c0 + n),
                n,
                vocab,
                vocab,
                temp,
            )?;
            if keep {
                kept_head.push((g, xn, rstd, logits));
            }
        }
        // ---- loss on the device (one call over the groups; the CPU's per-token math) ----
        let mut dlogp_d = alloc::<f32>(gpu, s, n_head.max(1))?;
        let mut acc = PolicyLossAcc::new(gpu, s)?;
        let x = PolicyLossInputs {
            tokens: n_head,
            logp: &lp_d,
            old_logp: &old_d,
            ref_logp: all_ref.then_some(&ref_d as &dyn DevicePtr<f32>),
            advantages: &adv_d,
            mask: &mask_d,
            entropy: Some(&ent_d),
            seq: &seq_d,
            seqs: tables.seq_tokens.len(),
            seq_tokens: &seq_tokens_d,
        };
        policy_loss_device(gpu, s, &self.cfg.loss, norm, &x, &mut dlogp_d, &mut acc)?;
        // ---- backward: log-softmax, lm head, final norm ----
        let head_slot = if self.model.weights.lm_head.is_some() {
            Slot::LmHead
        } else {
            Slot::Embed
        };
        let mut dfin = alloc::<bf16>(gpu, s, frows * h)?;
        s.memset_zeros(&mut dfin)?;
        let mut kept_head = kept_head.into_iter();
        for c0 in (0..n_head).step_by(LM_CHUNK) {
            let n = LM_CHUNK.min(n_head - c0);
            let idx = head_rows.slice(c0..c0 + n);
            let head = self.model.weights.lm_head();
            let (g, xn, rstd, logits) = match kept_head.next() {
                Some(k) => k,
                None => {
                    let (g, xn, rstd) = self.head_rows(gpu, s, &fin, frows, &idx, n)?;
                    let mut logits = alloc::<bf16>(gpu, s, n * vocab)?;
                    linear_fwd_bf16(gpu, s, &mut logits, &xn, head, None, n, h, vocab)?;
                    (g, xn, rstd, logits)
                }
            };
            let mut dlogits = alloc::<bf16>(gpu, s, n * vocab)?;
            logprobs_bwd_bf16(
                gpu,
                s,
                &mut dlogits,
                &dlogp_d.slice(c0..c0 + n),
                None,
                &logits,
                &targets.slice(c0..c0 + n),
                n,
                vocab,
                vocab,
                vocab,
                temp,
            )?;
            drop(logits);
            let mut dxn = alloc::<bf16>(gpu, s, n * h)?;
            matmul_bf16(gpu, s, &mut dxn, &dlogits, head, Gemm::nn(n, vocab, h))?;
            matmul_bf16(gpu, s, &mut self.dw, &dlogits, &xn, Gemm::tn(vocab, n, h))?;
            grad_accumulate_f32(gpu, s, self.grads.get(head_slot)?, &self.dw, vocab * h)?;
            let mut dg = alloc::<bf16>(gpu, s, n * h)?;
            rmsnorm_bwd_bf16(
                gpu,
                s,
                &mut dg,
                Some(self.grads.get(Slot::FinalNorm)? as &mut dyn DevicePtrMut<f32>),
                &dxn,
                &g,
                &self.model.weights.final_norm,
                &rstd,
                n,
                h,
                false,
            )?;
            // rows are distinct (one token-0 row per response): a scatter
            kv_append_bf16(gpu, s, &mut dfin, &dg, &idx, n, h, h, h)?;
        }
        // ---- token 0: each copy's last prompt row gets its responses' gradients ----
        let mut dprompt = Vec::with_capacity(groups.len());
        for (gi, p) in packs.iter().enumerate() {
            let l = p.layout;
            let mut d = alloc::<bf16>(gpu, s, l.rows() * h)?;
            s.memset_zeros(&mut d)?;
            if trains[gi] {
                let lists = pk.first_rows_of(gi, l.copies);
                let dst: Vec<u32> = (0..l.copies)
                    .map(|c| (c * l.len + l.len - 1) as u32)
                    .collect();
                gather_sum_rows(gpu, s, &mut d, &dst, &dfin, &lists, h)?;
            }
            dprompt.push(d);
        }
        let mut dsuffix = alloc::<bf16>(gpu, s, srows.max(1) * h)?;
        if srows > 0 {
            s.memcpy_dtod(
                &dfin.slice(..srows * h),
                &mut dsuffix.slice_mut(..srows * h),
            )?;
        }
        drop((dfin, fin));
        // ---- backward: layers top-down, suffix rows then each group's prompt rows ----
        let w = &self.model.weights;
        let span = (hi - lo).max(1) * kvw;
        let mut dpk = alloc::<f32>(gpu, s, span)?;
        let mut dpv = alloc::<f32>(gpu, s, span)?;
        for l in (0..layers).rev() {
            let b = &w.text[l];
            s.memset_zeros(&mut dpk)?;
            s.memset_zeros(&mut dpv)?;
            if let Some((inputs, acts, kept_acts)) = suffix.as_mut() {
                let xin = inputs.slice(l * srows * h..(l + 1) * srows * h);
                let pre = pre_of(l);
                // a kept layer's activations are used once, then freed
                let kept_l = kept_acts.get_mut(l).and_then(Option::take);
                let a = match (&kept_l, acts.as_mut()) {
                    (Some(k), _) => k,
                    (None, Some(a)) => {
                        layer_fwd(gpu, s, b, &sctx, &xin, a, None, Some(&pre))?;
                        &*a
                    }
                    (None, None) => {
                        return Err(GpuError::Input(format!(
                            "layer {l}: neither kept nor recomputable activations"
                        ))
                        .into())
                    }
                };
                layer_bwd(
                    gpu,
                    s,
                    l,
                    b,
                    &sctx,
                    &xin,
                    a,
                    &mut dsuffix,
                    &mut self.grads,
                    &mut self.dw,
                    PrefixGrad::Attend {
                        pre: &pre,
                        dk: &mut dpk,
                        dv: &mut dpv,
                    },
                )?;
            }
            for (gi, p) in packs.iter().enumerate() {
                if !trains[gi] {
                    continue;
                }
                let (lay, k) = (p.layout, kept[gi]);
                let rows = lay.rows();
                let pctx = LayerCtx {
                    rows,
                    hidden: h,
                    dims,
                    eps,
                    cos: &k.cos,
                    sin: &k.sin,
                    seqs: &k.seqs,
                    n_seqs: lay.copies,
                    max_q: lay.len,
                    iota: &iota,
                    ones: &ones,
                };
                let first = l * all + lay.row0;
                let xin = store.inputs.slice(first * h..(first + rows) * h);
                let mut acts = Acts::new(gpu, s, &pctx, b)?;
                layer_fwd(gpu, s, b, &pctx, &xin, &mut acts, None, None)?;
                let r0 = lay.row0 - lo;
                layer_bwd(
                    gpu,
                    s,
                    l,
                    b,
                    &pctx,
                    &xin,
                    &acts,
                    &mut dprompt[gi],
                    &mut self.grads,
                    &mut self.dw,
                    PrefixGrad::Extra {
                        dk: dpk.slice(r0 * kvw..(r0 + rows) * kvw),
                        dv: dpv.slice(r0 * kvw..(r0 + rows) * kvw),
                    },
                )?;
            }
        }
        // ---- backward: token embeddings (media rows skipped: their gradient goes to the vision backward below) ----
        let embed = self.grads.get(Slot::Embed)?;
        if srows > 0 {
            embedding_bwd_f32(gpu, s, embed, &dsuffix, &ids_d, srows, h, vocab, h)?;
        }
        for (gi, p) in packs.iter().enumerate() {
            if trains[gi] {
                let rows = p.layout.rows();
                embedding_bwd_f32(
                    gpu,
                    s,
                    embed,
                    &dprompt[gi],
                    &kept[gi].bwd_ids,
                    rows,
                    h,
                    vocab,
                    h,
                )?;
            }
        }
        // ---- backward: each group's media rows (summed over its copies) into the merger and
        // the tower, group by group ----
        let train_tower = !self.cfg.freeze_vision;
        for (gi, k) in kept.iter().enumerate() {
            let Some(kv) = k.vision.as_ref().filter(|_| trains[gi]) else {
                continue;
            };
            let mt = kv.rows.len();
            let mut d = alloc::<bf16>(gpu, s, mt.max(1) * h)?;
            let dst: Vec<u32> = (0..mt as u32).collect();
            gather_sum_rows(gpu, s, &mut d, &dst, &dprompt[gi], &kv.rows, h)?;
            let mut sink = VisionView(&mut self.grads);
            vision_backward(gpu, s, &self.model, &kv.state, &d, train_tower, &mut sink)?;
        }
        // ---- what the call returns: one synchronisation, after the whole backward is queued
        let lp = download(s, &lp_d)?;
        let ent = download(s, &ent_d)?;
        for (gi, g) in groups.iter().enumerate() {
            for (r, resp) in g.responses.iter().enumerate() {
                let rows = pk.starts[gi][r].map(|a| a..a + resp.tokens.len());
                out.logp
                    .push(rows.clone().map_or_else(Vec::new, |x| lp[x].to_vec()));
                out.entropy
                    .push(rows.map_or_else(Vec::new, |x| ent[x].to_vec()));
            }
        }
        out.metrics = loss_metrics(&acc.read(s)?);
        Ok(out)
    }

    /// Whether the trainer trains the vision tower or the merger.
    pub fn trains_vision(&self) -> bool {
        !self.cfg.freeze_vision || !self.cfg.freeze_merger
    }

    /// Gathers rows `idx` of the final-norm input `x`: `(rows, rmsnorm(rows), rstd)`.
    fn head_rows(
        &self,
        gpu: &Gpu,
        s: &Arc<CudaStream>,
        x: &CudaSlice<bf16>,
        total_rows: usize,
        idx: &impl DevicePtr<u32>,
        n: usize,
    ) -> Result<(CudaSlice<bf16>, CudaSlice<bf16>, CudaSlice<f32>)> {
        let t = self.model.config.text();
        let h = t.hidden_size as usize;
        let mut g = alloc::<bf16>(gpu, s, n * h)?;
        embedding_fwd_bf16(gpu, s, &mut g, &x.slice(..total_rows * h), idx, n, h, h)?;
        let mut xn = alloc::<bf16>(gpu, s, n * h)?;
        let mut rstd = alloc::<f32>(gpu, s, n)?;
        rmsnorm_fwd_bf16(
            gpu,
            s,
            &mut xn,
            Some(&mut rstd as &mut dyn DevicePtrMut<f32>),
            &g,
            &self.model.weights.final_norm,
            n,
            h,
            t.rms_norm_eps as f32,
        )?;
        Ok((g, xn, rstd))
    }

    /// The global L2 norm of the accumulated gradient (f64 partial sums on the device, summed
    /// on the host in tensor order). Synchronises.
    pub fn grad_norm(&self, gpu: &Gpu, s: &Arc<CudaStream>) -> Result<f64> {
        let nt = self.grads.t.len();
        let mut partial = alloc::<f64>(gpu, s, nt * NORM_BLOCKS)?;
        let f = gpu.function(&TRAIN_KERNELS, &[], "sumsq_partial_f32")?;
        for (i, t) in self.grads.t.iter().enumerate() {
            let (gp, _g) = Grads::of(t)?.device_ptr(s);
            let mut view = partial.slice_mut(i * NORM_BLOCKS..(i + 1) * NORM_BLOCKS);
            let (op, _o) = view.device_ptr_mut(s);
            let n = t.numel as u64;
            let mut b = s.launch_builder(&f);
            b.arg(&gp).arg(&n).arg(&op);
            // SAFETY: g holds numel floats, out NORM_BLOCKS doubles; 256 threads match the
            // kernel's shared array; arguments match (g, n, out).
            unsafe {
                b.launch(LaunchConfig {
                    grid_dim: (NORM_BLOCKS as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                })
            }?;
        }
        let p = download(s, &partial)?;
        let mut sq = 0f64;
        let mut culprit = None;
        for (i, t) in self.grads.t.iter().enumerate() {
            let part: f64 = p[i * NORM_BLOCKS..(i + 1) * NORM_BLOCKS].iter().sum();
            if !part.is_finite() && culprit.is_none() {
                culprit = Some(t.name.clone());
            }
            sq += part;
        }
        let norm = sq.sqrt();
        if !norm.is_finite() {
            return Err(TrainError::Invalid(format!(
                "gradient norm is not finite (first non-finite tensor: {}); the optimizer step \
                 was not taken",
                culprit.unwrap_or_else(|| "(overflow of the sum)".into())
            ))
            .into());
        }
        Ok(norm)
    }

    /// Clips the accumulated gradient (torch's `min(1, max_norm / (norm + 1e-6))`), takes one
    /// AdamW step on the fp32 masters writing the bf16 compute copy, frees the gradient sums and
    /// starts the next mini-batch. On error the weights are unchanged and the gradient is kept.
    pub fn optimizer_step(&mut self, gpu: &Gpu, s: &Arc<CudaStream>) -> Result<TrainStepReport> {
        let micro_batches = self.micro;
        if micro_batches == 0 {
            return Err(TrainError::Invalid(
                "optimizer_step before any micro-batch: nothing to apply".into(),
            )
            .into());
        }
        let grad_norm = self.grad_norm(gpu, s)?;
        if self.spec.grad_clip > 0.0 {
            let coef = (self.spec.grad_clip / (grad_norm + 1e-6)).min(1.0) as f32;
            if coef != 1.0 {
                let f = gpu.function(&TRAIN_KERNELS, &[], "scale_f32")?;
                for t in self.grads.t.iter_mut() {
                    let numel = t.numel;
                    let (gp, _g) = Grads::of_mut(t)?.device_ptr_mut(s);
                    let n = numel as u64;
                    let mut b = s.launch_builder(&f);
                    b.arg(&gp).arg(&n).arg(&coef);
                    // SAFETY: g holds numel floats; arguments match (g, n, c).
                    unsafe {
                        b.launch(LaunchConfig {
                            grid_dim: (numel.div_ceil(256).clamp(1, 4096) as u32, 1, 1),
                            block_dim: (256, 1, 1),
                            shared_mem_bytes: 0,
                        })
                    }?;
                }
            }
        }
        let lr = lr_at(&self.spec, self.steps);
        let step = self.steps + 1;
        let sc = AdamWScalars::new(
            lr,
            self.spec.beta1,
            self.spec.beta2,
            self.spec.eps,
            self.spec.weight_decay,
            step,
        );
        for t in self.grads.t.iter_mut() {
            let decay = t.decay && self.spec.weight_decay != 0.0;
            let out = weight_mut(&mut self.model.weights, t.slot).ok_or_else(|| {
                GpuError::Input(format!("no device weight for trained tensor {}", t.name))
            })?;
            let grad = t.grad.as_ref().ok_or_else(|| Grads::no_sum(&t.name))?;
            adamw_step_f32(
                gpu,
                s,
                &mut t.master,
                &mut t.m,
                &mut t.v,
                Some(out as &mut dyn DevicePtrMut<bf16>),
                grad,
                t.numel,
                decay,
                sc,
            )?;
        }
        self.grads.release(gpu, s)?;
        self.steps = step;
        self.micro = 0;
        let metrics = std::mem::take(&mut self.metrics);
        Ok(TrainStepReport {
            step: StepReport {
                step,
                lr,
                grad_norm,
            },
            metrics,
            micro_batches,
        })
    }

    /// Drops the accumulated gradient and metrics without stepping.
    pub fn discard(&mut self, gpu: &Gpu, s: &Arc<CudaStream>) -> Result<()> {
        self.grads.release(gpu, s)?;
        self.micro = 0;
        self.metrics = LossMetrics::default();
        Ok(())
    }
}

#[cfg(test)]
#[path = "train_tests.rs"]
pub(crate) mod tests;
