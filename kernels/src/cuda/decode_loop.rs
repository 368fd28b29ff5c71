//! The device side of a decode loop the host does not drive step by step (kernels in
//! `cuda/decode_loop.cu`): [`decode_advance`] turns a step's drawn tokens into the output tables,
//! the stop decisions and the next forward's inputs; [`decode_gather_rows`] compacts the row
//! table. [`decode_advance_ref`] is the CPU twin of [`decode_advance`], field for field.
//!
//! A row's state ([`DecodeRow`]) lives on the device for the whole loop, so a step needs nothing
//! from the host: it can be a CUDA graph replayed as is, and the host learns of stops later from
//! `done_step` (each entry written once, with the step the sample stopped at).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};

use super::attention::AttnSeqGpu;
use super::launch::{launch, need, ptr, ptr_mut, u32_of, Grid};
use super::nvrtc::DECODE_LOOP;
use super::{shape, Gpu, Result};

/// One row of the decode batch (`struct DecodeRow` in decode_loop.cu: same fields and order).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeRow {
    /// The sample this row decodes: its row of the output tables.
    pub sample: u32,
    /// The sample id its draws are keyed by (sampling's (seed, iteration, sample, step)).
    pub key: u32,
    /// The group's prefix rows in the KV arena.
    pub prefix_offset: u32,
    pub prefix_len: u32,
    /// The sample's own rows in the KV arena and how many it has written.
    pub suffix_offset: u32,
    pub suffix_len: u32,
    /// The RoPE table row of the sample's first response token.
    pub rope_row: u32,
    /// 1: the sample stops after `stop_len` tokens, whatever it draws (forced lengths).
    pub forced: u32,
    pub stop_len: u32,
    /// 1 once the sample stopped (and for rows that only pad a batch).
    pub done: u32,
    /// The step whose token this row draws next.
    pub step: u32,
}

// SAFETY: plain `repr(C)` struct of u32, the same layout as the kernel's.
unsafe impl DeviceRepr for DecodeRow {}

/// Value of `write_rows` for a row that writes no KV (the append kernel skips it).
pub const NO_WRITE: u32 = u32::MAX;

/// The buffers of one [`decode_advance`] over `n_rows` rows.
pub struct DecodeAdvance<'a> {
    pub rows: &'a mut CudaSlice<DecodeRow>,
    pub n_rows: usize,
    /// The tokens drawn this step and their log-probs, one per row.
    pub tokens: &'a CudaSlice<u32>,
    pub logprobs: &'a CudaSlice<f32>,
    pub stop_ids: &'a CudaSlice<u32>,
    pub n_stop: usize,
    pub max_new: usize,
    /// Stopped rows attend their group's whole prefix (what group-shared attention needs).
    pub keep_prefix: bool,
    /// `[samples, max_new]` tokens and log-probs; `[samples]` stop steps.
    pub out_tokens: &'a mut CudaSlice<u32>,
    pub out_logprobs: &'a mut CudaSlice<f32>,
    pub done_step: &'a mut CudaSlice<u32>,
    pub samples: usize,
    /// `[table_rows, head_dim]` RoPE cos / sin by position row.
    pub cos_table: &'a CudaSlice<f32>,
    pub sin_table: &'a CudaSlice<f32>,
    pub head_dim: usize,
    /// The next forward's inputs, one per row: token, cos / sin rows, attention descriptor, KV
    /// row; and the next draw's key (sample, step).
    pub feed: &'a mut CudaSlice<u32>,
    pub cos: &'a mut CudaSlice<f32>,
    pub sin: &'a mut CudaSlice<f32>,
    pub seqs: &'a mut CudaSlice<AttnSeqGpu>,
    pub write_rows: &'a mut CudaSlice<u32>,
    pub sample_ids: &'a mut CudaSlice<u32>,
    pub steps: &'a mut CudaSlice<u32>,
}

/// Records each live row's drawn token, applies the stop test and writes the next step's
/// inputs (see the kernel's header and [`decode_advance_ref`]). Stream-ordered, no host
/// involvement: capturable in a CUDA graph.
pub fn decode_advance(gpu: &Gpu, stream: &Arc<CudaStream>, a: DecodeAdvance<'_>) -> Result<()> {
    const OP: &str = "decode_advance";
    let n = a.n_rows;
    if n == 0 {
        return Ok(());
    }
    let table_rows = a.cos_table.len() / a.head_dim.max(1);
    if table_rows == 0 || a.head_dim == 0 || a.max_new == 0 {
        return Err(shape(OP, "empty RoPE table, head_dim or max_new"));
    }
    need(OP, "rows", a.rows, n)?;
    need(OP, "tokens", a.tokens, n)?;
    need(OP, "logprobs", a.logprobs, n)?;
    need(OP, "stop_ids", a.stop_ids, a.n_stop)?;
    need(OP, "out_tokens", a.out_tokens, a.samples * a.max_new)?;
    need(OP, "out_logprobs", a.out_logprobs, a.samples * a.max_new)?;
    need(OP, "done_step", a.done_step, a.samples)?;
    need(OP, "sin_table", a.sin_table, table_rows * a.head_dim)?;
    for (name, len) in [
        ("feed", a.feed.len()),
        ("write_rows", a.write_rows.len()),
        ("seqs", a.seqs.len()),
        ("sample_ids", a.sample_ids.len()),
        ("steps", a.steps.len()),
    ] {
        if len < n {
            return Err(shape(OP, format!("{name} holds {len} rows, needs {n}")));
        }
    }
    need(OP, "cos", a.cos, n * a.head_dim)?;
    need(OP, "sin", a.sin, n * a.head_dim)?;
    let stop = if a.n_stop == 0 {
        0
    } else {
        ptr(a.stop_ids, stream)
    };
    let (rp, tp, lp) = (
        ptr_mut(a.rows, stream),
        ptr(a.tokens, stream),
        ptr(a.logprobs, stream),
    );
    let (otp, olp, dp) = (
        ptr_mut(a.out_tokens, stream),
        ptr_mut(a.out_logprobs, stream),
        ptr_mut(a.done_step, stream),
    );
    let (ctp, stp) = (ptr(a.cos_table, stream), ptr(a.sin_table, stream));
    let (fp, cp, sp, qp, wp, sip, step_p) = (
        ptr_mut(a.feed, stream),
        ptr_mut(a.cos, stream),
        ptr_mut(a.sin, stream),
        ptr_mut(a.seqs, stream),
        ptr_mut(a.write_rows, stream),
        ptr_mut(a.sample_ids, stream),
        ptr_mut(a.steps, stream),
    );
    let keep = u32::from(a.keep_prefix);
    let (n32, ns, mn, tr, hd) = (
        u32_of(OP, "n_rows", n)?,
        u32_of(OP, "n_stop", a.n_stop)?,
        u32_of(OP, "max_new", a.max_new)?,
        u32_of(OP, "table_rows", table_rows)?,
        u32_of(OP, "head_dim", a.head_dim)?,
    );
    // SAFETY: every buffer holds what the kernel touches for `n` rows (checked above; the
    // output tables cover every (sample, step < max_new) a row can name, since a row's step
    // never reaches max_new while it is live); arguments in the kernel's order.
    unsafe {
        launch(
            gpu,
            stream,
            &DECODE_LOOP,
            &[],
            "decode_advance",
            Grid::new((n32, 1, 1), 64),
            &[
                &rp, &n32, &tp, &lp, &stop, &ns, &mn, &keep, &otp, &olp, &dp, &ctp, &stp, &tr, &hd,
                &fp, &cp, &sp, &qp, &wp, &sip, &step_p,
            ],
        )
    }?;
    Ok(())
}

/// `dst[i] = src[map[i]]` for `i < n`, with each row's next draw key in `sample_ids` / `steps`.
#[allow(clippy::too_many_arguments)]
pub fn decode_gather_rows(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    dst: &mut impl DevicePtrMut<DecodeRow>,
    src: &impl DevicePtr<DecodeRow>,
    map: &impl DevicePtr<u32>,
    n: usize,
    sample_ids: &mut impl DevicePtrMut<u32>,
    steps: &mut impl DevicePtrMut<u32>,
) -> Result<()> {
    const OP: &str = "decode_gather_rows";
    if n == 0 {
        return Ok(());
    }
    need(OP, "dst", dst, n)?;
    need(OP, "map", map, n)?;
    need(OP, "sample_ids", sample_ids, n)?;
    need(OP, "steps", steps, n)?;
    let (dp, sp, mp, ip, stp) = (
        ptr_mut(dst, stream),
        ptr(src, stream),
        ptr(map, stream),
        ptr_mut(sample_ids, stream),
        ptr_mut(steps, stream),
    );
    let n32 = u32_of(OP, "n", n)?;
    // SAFETY: dst, map and the key arrays hold n entries; the caller's map indexes src (the
    // caller's invariant: a permutation of src's rows); arguments in the kernel's order.
    unsafe {
        launch(
            gpu,
            stream,
            &DECODE_LOOP,
            &[],
            "decode_gather_rows",
            Grid::new((n32.div_ceil(128), 1, 1), 128),
            &[&dp, &sp, &mp, &n32, &ip, &stp],
        )
    }?;
    Ok(())
}

/// The host-side buffers of [`decode_advance_ref`] (slices of what the device holds).
pub struct DecodeAdvanceRef<'a> {
    pub rows: &'a mut [DecodeRow],
    pub tokens: &'a [u32],
    pub logprobs: &'a [f32],
    pub stop_ids: &'a [u32],
    pub max_new: usize,
    pub keep_prefix: bool,
    pub out_tokens: &'a mut [u32],
    pub out_logprobs: &'a mut [f32],
    pub done_step: &'a mut [u32],
    pub cos_table: &'a [f32],
    pub sin_table: &'a [f32],
    pub head_dim: usize,
    pub feed: &'a mut [u32],
    pub cos: &'a mut [f32],
    pub sin: &'a mut [f32],
    pub seqs: &'a mut [AttnSeqGpu],
    pub write_rows: &'a mut [u32],
    pub sample_ids: &'a mut [u32],
    pub steps: &'a mut [u32],
}

/// The CPU twin of [`decode_advance`] over `a.rows.len()` rows.
pub fn decode_advance_ref(a: DecodeAdvanceRef<'_>) {
    let hd = a.head_dim;
    let table_rows = a.cos_table.len() / hd.max(1);
    for (r, row) in a.rows.iter_mut().enumerate() {
        let mut live = false;
        let mut pos = 0u32;
        if row.done == 0 {
            let (tok, step) = (a.tokens[r], row.step);
            let len = step + 1;
            let at = row.sample as usize * a.max_new + step as usize;
            a.out_tokens[at] = tok;
            a.out_logprobs[at] = a.logprobs[r];
            let stop = if row.forced != 0 {
                len >= row.stop_len
            } else {
                len as usize >= a.max_new || a.stop_ids.contains(&tok)
            };
            if stop {
                row.done = 1;
                a.done_step[row.sample as usize] = step;
            } else {
                live = true;
                pos = row.rope_row + row.suffix_len;
                a.feed[r] = tok;
                a.seqs[r] = AttnSeqGpu {
                    q_start: r as u32,
                    q_len: 1,
                    p_start: row.prefix_offset,
                    p_len: row.prefix_len,
                    k_start: row.suffix_offset,
                    k_len: row.suffix_len + 1,
                };
                a.write_rows[r] = row.suffix_offset + row.suffix_len;
                row.suffix_len += 1;
            }
            row.step = len;
        }
        if !live {
            a.feed[r] = 0;
            a.seqs[r] = AttnSeqGpu {
                q_start: r as u32,
                q_len: 1,
                p_start: row.prefix_offset,
                p_len: if a.keep_prefix { row.prefix_len } else { 1 },
                k_start: row.prefix_offset,
                k_len: 1,
            };
            a.write_rows[r] = NO_WRITE;
        }
        a.sample_ids[r] = row.key;
        a.steps[r] = row.step;
        let p = (pos as usize).min(table_rows.saturating_sub(1));
        a.cos[r * hd..(r + 1) * hd].copy_from_slice(&a.cos_table[p * hd..(p + 1) * hd]);
        a.sin[r * hd..(r + 1) * hd].copy_from_slice(&a.sin_table[p * hd..(p + 1) * hd]);
    }
}
