//! The streamed optimizer step (a plan's `OptimizerStream`): the fp32 masters and AdamW moments
//! live in pinned host memory (one flat image each, the trained tensors in the trainer's
//! order), and each step moves them through `slots` device staging chunks.
//!
//! Order, fixed (compute stream `s`, the trainer's own copy stream `c`):
//! 1. on `s`: the gradient norm and the clip over every gradient, exactly as the in-HBM step;
//!    `c` waits for that point;
//! 2. on `c`: copy chunk 0 in; then for each chunk `k`: copy chunk `k + 1` in (event `in[k+1]`);
//!    `s` waits `in[k]` and runs chunk `k`'s AdamW kernels in its slot (each tensor piece of
//!    the chunk, writing the bf16 compute copy of that piece), event `upd[k]`; `c` waits
//!    `upd[k]` and writes chunk `k` back;
//! 3. `s` waits for the last write-back.
//!
//! On `c` the copies run in the order in 0, in 1, out 0, in 2, out 1, ...: the copy of chunk
//! `k + 1` and the write-back of chunk `k - 1` overlap the update of chunk `k`, and the copy
//! into a slot follows (in stream order) the write-back of the chunk that used it before, so
//! three slots hold the chunk coming in, the one updated and the one going back (with two the
//! order is the same, the copy in waiting for that write-back). The kernels and their inputs
//! are the in-HBM step's, element for element, so the result is bitwise the same.

use std::sync::Arc;

use cudarc::driver::{sys, CudaEvent, CudaSlice, CudaStream, DevicePtrMut};
use half::bf16;
use rollplex_kernels::cuda::{adamw_step_f32, AdamWScalars, Gpu};
use rollplex_plan::OptimizerStream;

use super::super::arena::HostImage;
use super::super::{alloc, GpuError};
use super::params::{weight_mut, Grads};
use super::{GpuTrainer, Result};

/// The trainer's optimizer state on the host, and the device staging it goes through.
pub(super) struct StreamedState {
    /// The plan's chunking (its `chunk_elems` and `slots`; the chunks follow from `total`).
    plan: OptimizerStream,
    total: usize,
    /// Masters, first moments, second moments: `total` f32 each, pinned.
    host: [HostImage; 3],
    /// Per slot, one chunk of masters, first moments, second moments on the device (an
    /// allocation each, so that the runtime's per-allocation ordering of streams never ties
    /// one slot's copy to another slot's update).
    staging: Vec<[CudaSlice<f32>; 3]>,
    copy: Arc<CudaStream>,
}

impl StreamedState {
    /// Host images for `total` parameters (contents undefined) and the plan's device staging
    /// slots.
    pub(super) fn new(
        gpu: &Gpu,
        s: &Arc<CudaStream>,
        total: usize,
        plan: &OptimizerStream,
    ) -> Result<Self> {
        let (chunk, slots) = (plan.chunk_elems as usize, plan.slots as usize);
        if chunk == 0 || !(2..=3).contains(&slots) {
            return Err(GpuError::Input(format!(
                "a streamed optimizer state of chunks of {chunk} parameters through {slots} slots"
            ))
            .into());
        }
        let image = || -> Result<HostImage> { Ok(HostImage::new(gpu, total * 4)?) };
        Ok(StreamedState {
            plan: plan.clone(),
            total,
            host: [image()?, image()?, image()?],
            staging: (0..slots)
                .map(|_| -> Result<[CudaSlice<f32>; 3]> {
                    Ok([
                        alloc::<f32>(gpu, s, chunk)?,
                        alloc::<f32>(gpu, s, chunk)?,
                        alloc::<f32>(gpu, s, chunk)?,
                    ])
                })
                .collect::<Result<_>>()?,
            copy: gpu.stream(0).map_err(GpuError::from)?,
        })
    }

    /// Chunk `k`'s parameter range.
    fn range(&self, k: usize) -> std::ops::Range<usize> {
        let r = self.plan.chunk(k as u32, self.total as u64);
        r.start as usize..r.end as usize
    }

    fn chunks(&self) -> usize {
        self.total.div_ceil(self.plan.chunk_elems as usize)
    }

    /// Queues on the copy stream chunk `k`'s copy between its host range and its slot.
    fn copy(&mut self, k: usize, to_device: bool) -> Result<()> {
        let r = self.range(k);
        let bytes = r.len() * 4;
        if bytes == 0 {
            return Ok(());
        }
        let slot = k % self.plan.slots as usize;
        for (img, dev) in self.host.iter().zip(self.staging[slot].iter_mut()) {
            let mut view = dev.slice_mut(0..r.len());
            let (dp, _record) = view.device_ptr_mut(&self.copy);
            // SAFETY: the slot range holds r.len() f32 (sliced above); the host range lies in
            // the image of `total` f32; both outlive the copy (the state is dropped only after
            // the copy stream is synchronised); the order of the streams keeps every other
            // reader and writer of both ranges before or after it (module docs).
            unsafe {
                let h = img.as_ptr().add(r.start * 4).cast::<std::ffi::c_void>();
                if to_device {
                    sys::cuMemcpyHtoDAsync_v2(dp, h, bytes, self.copy.cu_stream())
                } else {
                    sys::cuMemcpyDtoHAsync_v2(h, dp, bytes, self.copy.cu_stream())
                }
            }
            .result()
            .map_err(GpuError::from)?;
        }
        Ok(())
    }

    /// The f32 values of `range` of image `which` (0 masters, 1 first, 2 second moments).
    fn read(&self, which: usize, range: std::ops::Range<usize>) -> Vec<f32> {
        self.host[which].as_slice()[range.start * 4..range.end * 4]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    pub(super) fn total(&self) -> usize {
        self.total
    }

    /// Sets both moment images to zero (a fresh optimizer).
    pub(super) fn zero_moments(&mut self) {
        self.host[1].as_mut_slice().fill(0);
        self.host[2].as_mut_slice().fill(0);
    }

    pub(super) fn write(&mut self, which: usize, at: usize, values: &[f32]) {
        let dst = &mut self.host[which].as_mut_slice()[at * 4..(at + values.len()) * 4];
        for (d, v) in dst.chunks_exact_mut(4).zip(values) {
            d.copy_from_slice(&v.to_le_bytes());
        }
    }
}

fn event(s: &CudaStream) -> Result<CudaEvent> {
    Ok(s.record_event(None).map_err(GpuError::from)?)
}

impl GpuTrainer {
    /// Whether the optimizer state is streamed ([`super::TrainerPlacement::stream`]).
    pub fn is_streamed(&self) -> bool {
        self.streamed.is_some()
    }

    /// Tensor `i`'s masters and moments from the host state (streamed), once every queued copy
    /// is done. Synchronises the copy stream.
    pub(super) fn streamed_tensor(&self, i: usize) -> Result<Option<[Vec<f32>; 3]>> {
        let Some(st) = &self.streamed else {
            return Ok(None);
        };
        st.copy.synchronize().map_err(GpuError::from)?;
        let at: usize = self.grads.t[..i].iter().map(|t| t.numel).sum();
        let r = at..at + self.grads.t[i].numel;
        Ok(Some([
            st.read(0, r.clone()),
            st.read(1, r.clone()),
            st.read(2, r),
        ]))
    }

    /// Writes tensor `i`'s masters and moments into the host state (streamed); `false` when
    /// the state is on the device. Synchronises the copy stream first.
    pub(super) fn set_streamed_tensor(&mut self, i: usize, values: [&[f32]; 3]) -> Result<bool> {
        let at: usize = self.grads.t[..i].iter().map(|t| t.numel).sum();
        let Some(st) = &mut self.streamed else {
            return Ok(false);
        };
        st.copy.synchronize().map_err(GpuError::from)?;
        for (which, x) in values.into_iter().enumerate() {
            st.write(which, at, x);
        }
        Ok(true)
    }

    /// The AdamW update of every trained tensor through the staging chunks (the gradient is
    /// already clipped on `s`), in the module docs' order.
    pub(super) fn streamed_update(
        &mut self,
        gpu: &Gpu,
        s: &Arc<CudaStream>,
        sc: AdamWScalars,
    ) -> Result<()> {
        let Some(mut st) = self.streamed.take() else {
            return Ok(());
        };
        let r = self.streamed_chunks(gpu, s, sc, &mut st);
        self.streamed = Some(st);
        r
    }

    fn streamed_chunks(
        &mut self,
        gpu: &Gpu,
        s: &Arc<CudaStream>,
        sc: AdamWScalars,
        st: &mut StreamedState,
    ) -> Result<()> {
        let n = st.chunks();
        if n == 0 {
            return Ok(());
        }
        let wd = self.spec.weight_decay != 0.0;
        // the clip is done on `s`: the copies start after it
        st.copy.wait(&event(s)?).map_err(GpuError::from)?;
        st.copy(0, true)?;
        let mut in_ev = vec![event(&st.copy)?];
        for k in 0..n {
            if k + 1 < n {
                st.copy(k + 1, true)?;
                in_ev.push(event(&st.copy)?);
            }
            s.wait(&in_ev[k]).map_err(GpuError::from)?;
            let r = st.range(k);
            let slot = k % st.plan.slots as usize;
            let mut at = 0usize; // the tensor's first parameter in the flat state
            for t in self.grads.t.iter_mut() {
                let (a, b) = (at.max(r.start), (at + t.numel).min(r.end));
                let first = at;
                at += t.numel;
                if a >= b {
                    continue;
                }
                let (lo, len) = (a - first, b - a);
                let x = a - r.start;
                let out = weight_mut(&mut self.model.weights, t.slot).ok_or_else(|| {
                    GpuError::Input(format!("no device weight for trained tensor {}", t.name))
                })?;
                let mut out = out.slice_mut(lo..lo + len);
                let grad = t.grad.as_ref().ok_or_else(|| Grads::no_sum(&t.name))?;
                let grad = grad.slice(lo..lo + len);
                let [p, m, v] = &mut st.staging[slot];
                adamw_step_f32(
                    gpu,
                    s,
                    &mut p.slice_mut(x..x + len),
                    &mut m.slice_mut(x..x + len),
                    &mut v.slice_mut(x..x + len),
                    Some(&mut out as &mut dyn DevicePtrMut<bf16>),
                    &grad,
                    len,
                    t.decay && wd,
                    sc,
                )?;
            }
            st.copy.wait(&event(s)?).map_err(GpuError::from)?;
            st.copy(k, false)?;
        }
        // what follows on `s` comes after the last write-back
        s.wait(&event(&st.copy)?).map_err(GpuError::from)?;
        Ok(())
    }
}
