//! One decode step of the text decoder: the forward of one token per sample over the KV arena,
//! from inputs that already lie on the device ([`GpuModel::decode_forward`], what the RL loop's
//! device-resident decode replays as a CUDA graph), and the host-facing [`GpuModel::decode_step`]
//! that builds those inputs from [`DecodeSlot`]s and runs the same forward.

use std::sync::Arc;

use half::bf16;
use rollplex_kernels::cuda::{embedding_fwd_bf16, AttnSeqGpu, CudaSlice, CudaStream, Gpu};

use crate::model::DecodeSlot;

use super::super::block::{run_blocks_keeping, BlockBufs};
use super::super::plan::{check_decode_slots, check_ids, decode_kernel_for, flat_rope_tables};
use super::super::{alloc, upload, GpuError, GpuModel, Result};
use super::attn::{decode_workspace_len, DecodeAttn};
use super::GpuKvArena;

/// The device buffers a decode forward works in, for batches of up to `rows` rows whose
/// sequences reach at most `max_kv` keys, in groups as [`DecodeIo::grouped`] says. A loop of
/// many steps allocates them once, so that a step allocates nothing.
pub struct DecodeBufs {
    rows: usize,
    max_kv: usize,
    x: CudaSlice<bf16>,
    xn: CudaSlice<bf16>,
    blocks: BlockBufs,
    /// The decode attention's split-K scratch, sized for every batch up to `rows`.
    attn_ws: Option<CudaSlice<f32>>,
}

impl DecodeBufs {
    /// Buffers for `model`'s decode of up to `rows` rows of at most `max_kv` keys, attended
    /// per sample or, with `grouped = Some((group, max_prefix))`, by groups of at most `group`
    /// rows however many groups a batch has ([`DecodeIo::grouped`] of the forwards to come).
    pub fn new(
        model: &GpuModel,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        rows: usize,
        max_kv: usize,
        grouped: Option<(usize, usize)>,
    ) -> Result<Self> {
        let (h, dims) = (model.hidden(), model.text_dims());
        let ws = (1..=rows)
            .flat_map(|b| match grouped {
                Some((group, max_prefix)) => (b.div_ceil(group.max(1))..=b)
                    .map(|groups| {
                        let g = Some((group, groups, max_prefix));
                        decode_workspace_len(b, dims, max_kv, g)
                    })
                    .max(),
                None => Some(decode_workspace_len(b, dims, max_kv, None)),
            })
            .max()
            .unwrap_or(0);
        Ok(DecodeBufs {
            rows,
            max_kv,
            x: alloc::<bf16>(gpu, stream, rows * h)?,
            xn: alloc::<bf16>(gpu, stream, rows * h)?,
            blocks: BlockBufs::new(gpu, stream, &model.weights.text, rows, h, dims)?,
            attn_ws: if ws > 0 {
                Some(alloc::<f32>(gpu, stream, ws)?)
            } else {
                None
            },
        })
    }

    /// The most rows a forward may run in these buffers.
    pub fn rows(&self) -> usize {
        self.rows
    }
}

/// A decode forward's inputs on the device, one per row for `batch` rows: the token fed, its
/// RoPE cos / sin rows (`[batch, head_dim]`), its attention sequence over the arena and the
/// arena row its K/V go to (rows past the arena are not written). `max_kv` bounds every
/// sequence's keys and fixes the attention's split (so the same `max_kv` gives the same bits).
/// With `grouped`, rows come in GRPO groups (group-major) that share a prefix of at most
/// `max_prefix` keys, and the tensor-core attention reads each group's prefix once (split by
/// `max_prefix` and `max_kv - max_prefix`, which then fix the bits).
pub struct DecodeIo<'a> {
    pub tokens: &'a CudaSlice<u32>,
    pub cos: &'a CudaSlice<f32>,
    pub sin: &'a CudaSlice<f32>,
    pub seqs: &'a CudaSlice<AttnSeqGpu>,
    pub write_rows: &'a CudaSlice<u32>,
    pub batch: usize,
    pub max_kv: usize,
    /// Rows in GRPO groups sharing a prefix (see above).
    pub grouped: Option<Grouping<'a>>,
}

/// How a decode batch's rows form GRPO groups ([`DecodeIo::grouped`]).
#[derive(Clone, Copy)]
pub struct Grouping<'a> {
    /// The most rows a group holds.
    pub group: usize,
    /// The longest shared prefix, in keys.
    pub max_prefix: usize,
    /// `None`: rows `i * group .. (i + 1) * group` form group `i`. `Some((starts, groups))`:
    /// group `i` is rows `starts[i] .. starts[i + 1]` for `i < groups` (a batch compacted row
    /// by row; groups may be empty, `groups` is fixed for the batch size and bakes the
    /// attention's cut).
    pub table: Option<(&'a CudaSlice<u32>, usize)>,
}

impl Grouping<'_> {
    /// The groups a batch of `batch` rows is cut into.
    pub fn groups(&self, batch: usize) -> usize {
        self.table
            .map_or(batch.div_ceil(self.group.max(1)), |(_, g)| g)
    }
}

impl GpuModel {
    /// One decode forward from device-side inputs: embeds `io.tokens`, runs every layer (RoPE,
    /// K/V append at `io.write_rows`, attention over `io.seqs`) and writes the next-token logits
    /// of each row into `logits [batch, vocab]`. Allocates nothing, synchronises nothing and
    /// reads nothing from the host: a CUDA graph can capture it.
    pub fn decode_forward(
        &self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        arena: &mut GpuKvArena,
        io: &DecodeIo<'_>,
        bufs: &mut DecodeBufs,
        logits: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        self.check_text_dims()?;
        let b = io.batch;
        if b > bufs.rows || io.max_kv > bufs.max_kv {
            return Err(GpuError::Input(format!(
                "decode_forward: batch {b} of up to {} keys in buffers for {} rows of {}",
                io.max_kv, bufs.rows, bufs.max_kv
            )));
        }
        let t = self.config.text();
        if arena.layers != t.num_layers as usize
            || arena.kv_width != (t.num_kv_heads * t.head_dim()) as usize
        {
            return Err(GpuError::Input(
                "decode_forward: the KV arena was made for another model".into(),
            ));
        }
        if b == 0 {
            return Ok(());
        }
        let (h, dims) = (self.hidden(), self.text_dims());
        let kernel = decode_kernel_for(dims.head_dim)?;
        embedding_fwd_bf16(
            gpu,
            stream,
            &mut bufs.x,
            &self.weights.embed,
            io.tokens,
            b,
            h,
            h,
        )?;
        {
            let mut step = DecodeAttn {
                cos: io.cos,
                sin: io.sin,
                slots: io.write_rows,
                seqs: io.seqs,
                dims,
                batch: b,
                max_kv: io.max_kv,
                kernel,
                grouped: io.grouped,
                workspace: &mut bufs.attn_ws,
                arena,
            };
            run_blocks_keeping(
                gpu,
                stream,
                &self.weights.text,
                &mut bufs.x,
                b,
                h,
                dims,
                self.eps(),
                &mut step,
                None,
                Some(&mut bufs.blocks),
            )?;
        }
        self.head_into(gpu, stream, &bufs.x, b, &mut bufs.xn, logits)
    }

    /// One decode step: `tokens[b]` is appended to sample `b`'s suffix (its K/V written to the
    /// arena at `suffix_offset + suffix_len`), attends `[prefix | suffix]`, and its next-token
    /// logits land in the returned `[B, vocab]` buffer. Advances each slot's `suffix_len`.
    /// Nothing synchronises. The inputs are built on the host and uploaded; the forward is
    /// [`GpuModel::decode_forward`] with `max_kv` the batch's longest sequence.
    pub fn decode_step(
        &self,
        gpu: &Gpu,
        stream: &Arc<CudaStream>,
        arena: &mut GpuKvArena,
        slots: &mut [DecodeSlot],
        tokens: &[u32],
    ) -> Result<CudaSlice<bf16>> {
        self.check_text_dims()?;
        let b = slots.len();
        if tokens.len() != b {
            return Err(GpuError::Input(format!(
                "decode_step: {b} slots but {} tokens",
                tokens.len()
            )));
        }
        check_decode_slots(arena.capacity, slots)?;
        check_ids("decode_step", tokens, self.vocab())?;
        if b == 0 {
            return alloc::<bf16>(gpu, stream, 0);
        }
        let positions: Vec<i64> = slots.iter().map(DecodeSlot::next_position).collect();
        let (cos, sin) = flat_rope_tables(&self.config, &positions);
        let seqs: Vec<AttnSeqGpu> = slots
            .iter()
            .enumerate()
            .map(|(i, s)| AttnSeqGpu::from_decode(i as u32, &s.decode_seq()))
            .collect();
        let max_kv = slots
            .iter()
            .map(|s| (s.prefix.len + s.suffix_len + 1) as usize)
            .max()
            .unwrap_or(1);
        let write: Vec<u32> = slots.iter().map(DecodeSlot::write_row).collect();
        let tokens = upload(stream, tokens)?;
        let cos = upload(stream, &cos)?;
        let sin = upload(stream, &sin)?;
        let seqs = upload(stream, &seqs)?;
        let write_rows = upload(stream, &write)?;
        let mut bufs = DecodeBufs::new(self, gpu, stream, b, max_kv, None)?;
        let mut logits = alloc::<bf16>(gpu, stream, b * self.vocab())?;
        let io = DecodeIo {
            tokens: &tokens,
            cos: &cos,
            sin: &sin,
            seqs: &seqs,
            write_rows: &write_rows,
            batch: b,
            max_kv,
            grouped: None,
        };
        self.decode_forward(gpu, stream, arena, &io, &mut bufs, &mut logits)?;
        for s in slots.iter_mut() {
            s.suffix_len += 1;
        }
        Ok(logits)
    }
}
