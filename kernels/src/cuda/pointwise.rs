//! Pointwise launchers (kernels in `cuda/pointwise.cu`): the CUDA twins of
//! [`crate::cpu::rope_fwd`], [`crate::cpu::swiglu_fwd`], [`crate::cpu::gelu_fwd`],
//! [`crate::cpu::add_fwd`], [`crate::cpu::embedding_fwd`], and the KV-cache append.
//! Each rounds to bf16 where Hugging Face's bf16 code rounds (see the kernel comments).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use super::launch::{grid_for, launch, need, ptr, ptr_mut, u32_of, Grid};
use super::nvrtc::POINTWISE;
use super::{shape, Gpu, Result};

fn cfg(grid: (u32, u32), threads: u32) -> Grid {
    Grid {
        grid: (grid.0, grid.1, 1),
        block: (threads, 1, 1),
        smem: 0,
    }
}

/// Rotary embedding in place on `x` rows of `row_stride` elements: heads `0..heads` (each
/// `head_dim` wide, from the start of the row) of token `t` use `cos[t, :]`, `sin[t, :]`
/// (`[tokens, head_dim]` f32, as [`crate::cpu::rope_fwd`]). A fused qkv row rotates q and k in
/// one call (`heads = n_heads + n_kv_heads`). `hf_text_rounding` rounds as the HF text decoder
/// (bf16 tables and products); false computes in f32 (the vision tower).
#[allow(clippy::too_many_arguments)]
pub fn rope_fwd_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    x: &mut impl DevicePtrMut<bf16>,
    cos: &impl DevicePtr<f32>,
    sin: &impl DevicePtr<f32>,
    tokens: usize,
    row_stride: usize,
    heads: usize,
    head_dim: usize,
    hf_text_rounding: bool,
) -> Result<()> {
    const OP: &str = "rope_fwd_bf16";
    if !head_dim.is_multiple_of(2) || heads * head_dim > row_stride {
        return Err(shape(
            OP,
            format!(
                "head_dim {head_dim} must be even and {heads} heads fit in a row of {row_stride}"
            ),
        ));
    }
    if tokens == 0 || heads == 0 {
        return Ok(());
    }
    need(OP, "x", x, (tokens - 1) * row_stride + heads * head_dim)?;
    need(OP, "cos", cos, tokens * head_dim)?;
    need(OP, "sin", sin, tokens * head_dim)?;
    let (xp, cp, sp) = (ptr_mut(x, stream), ptr(cos, stream), ptr(sin, stream));
    let (t, rs, h, hd) = (
        u32_of(OP, "tokens", tokens)?,
        u32_of(OP, "row_stride", row_stride)?,
        heads as u32,
        head_dim as u32,
    );
    let mode = hf_text_rounding as u32;
    // SAFETY: x covers every rotated element of every token row, cos/sin hold tokens*head_dim;
    // arguments match (x, cos, sin, tokens, row_stride, n_heads, head_dim, hf_text_rounding).
    unsafe {
        launch(
            gpu,
            stream,
            &POINTWISE,
            &[],
            "rope_fwd_bf16",
            cfg((t, 1), 128),
            &[&xp, &cp, &sp, &t, &rs, &h, &hd, &mode],
        )
    }?;
    Ok(())
}

/// `out[r, i] = bf16(bf16(silu(gate[r, i])) * up[r, i])` for `rows x cols`; rows of each buffer
/// are `*_stride` elements apart (a fused `[rows, 2F]` gate|up output: `up` is a view starting at
/// F, both strides 2F).
#[allow(clippy::too_many_arguments)]
pub fn swiglu_fwd_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    out: &mut impl DevicePtrMut<bf16>,
    gate: &impl DevicePtr<bf16>,
    up: &impl DevicePtr<bf16>,
    rows: usize,
    cols: usize,
    out_stride: usize,
    gate_stride: usize,
    up_stride: usize,
) -> Result<()> {
    const OP: &str = "swiglu_fwd_bf16";
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    if cols > out_stride.min(gate_stride).min(up_stride) {
        return Err(shape(OP, format!("cols {cols} exceeds a row stride")));
    }
    need(OP, "out", out, (rows - 1) * out_stride + cols)?;
    need(OP, "gate", gate, (rows - 1) * gate_stride + cols)?;
    need(OP, "up", up, (rows - 1) * up_stride + cols)?;
    let (op_, gp, upp) = (ptr_mut(out, stream), ptr(gate, stream), ptr(up, stream));
    let r = u32_of(OP, "rows", rows)?;
    let c = u32_of(OP, "cols", cols)?;
    let (gs, us, os) = (gate_stride as u32, up_stride as u32, out_stride as u32);
    let bx = grid_for(cols / 8 + 1, 256, 64);
    // SAFETY: each buffer covers (rows-1)*stride + cols elements (checked); arguments match
    // (gate, up, out, rows, cols, gate_stride, up_stride, out_stride).
    unsafe {
        launch(
            gpu,
            stream,
            &POINTWISE,
            &[],
            "swiglu_fwd_bf16",
            cfg((bx, r), 256),
            &[&gp, &upp, &op_, &r, &c, &gs, &us, &os],
        )
    }?;
    Ok(())
}

/// [`swiglu_fwd_bf16`] over a fused gate|up buffer `gu [rows, 2f]` (gate columns, then up):
/// `act [rows, f]`.
pub fn swiglu_gate_up_fwd_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    act: &mut impl DevicePtrMut<bf16>,
    gu: &CudaSlice<bf16>,
    rows: usize,
    f: usize,
) -> Result<()> {
    let up = gu.slice(f.min(gu.len())..);
    swiglu_fwd_bf16(gpu, stream, act, gu, &up, rows, f, f, 2 * f, 2 * f)
}

/// `y = gelu(x)` over `n` elements: exact erf form, or the tanh approximation.
pub fn gelu_fwd_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    y: &mut impl DevicePtrMut<bf16>,
    x: &impl DevicePtr<bf16>,
    n: usize,
    tanh_approx: bool,
) -> Result<()> {
    const OP: &str = "gelu_fwd_bf16";
    need(OP, "x", x, n)?;
    need(OP, "y", y, n)?;
    if n == 0 {
        return Ok(());
    }
    let (xp, yp) = (ptr(x, stream), ptr_mut(y, stream));
    let (n64, t) = (n as u64, tanh_approx as u32);
    // SAFETY: x and y hold n elements; arguments match (x, y, n, tanh_approx).
    unsafe {
        launch(
            gpu,
            stream,
            &POINTWISE,
            &[],
            "gelu_fwd_bf16",
            cfg((grid_for(n, 256, 4096), 1), 256),
            &[&xp, &yp, &n64, &t],
        )
    }?;
    Ok(())
}

/// `out = bf16(a + b)` over `n` elements (the residual add). For in place, use
/// [`add_fwd_bf16_inplace`].
pub fn add_fwd_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    out: &mut impl DevicePtrMut<bf16>,
    a: &impl DevicePtr<bf16>,
    b: &impl DevicePtr<bf16>,
    n: usize,
) -> Result<()> {
    const OP: &str = "add_fwd_bf16";
    need(OP, "a", a, n)?;
    need(OP, "b", b, n)?;
    need(OP, "out", out, n)?;
    let (ap, bp, op_) = (ptr(a, stream), ptr(b, stream), ptr_mut(out, stream));
    launch_add(gpu, stream, op_, ap, bp, n)
}

/// `y = bf16(y + x)` in place over `n` elements, as [`crate::cpu::add_fwd`].
pub fn add_fwd_bf16_inplace(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    y: &mut impl DevicePtrMut<bf16>,
    x: &impl DevicePtr<bf16>,
    n: usize,
) -> Result<()> {
    const OP: &str = "add_fwd_bf16";
    need(OP, "x", x, n)?;
    need(OP, "y", y, n)?;
    let (yp, xp) = (ptr_mut(y, stream), ptr(x, stream));
    launch_add(gpu, stream, yp, yp, xp, n)
}

fn launch_add(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    out: u64,
    a: u64,
    b: u64,
    n: usize,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let n64 = n as u64;
    // SAFETY: all three buffers hold n elements (checked by the callers); each element is read
    // and written by the same thread, so out may alias a or b; arguments match (a, b, out, n).
    unsafe {
        launch(
            gpu,
            stream,
            &POINTWISE,
            &[],
            "add_fwd_bf16",
            cfg((grid_for(n / 8 + 1, 256, 4096), 1), 256),
            &[&a, &b, &out, &n64],
        )
    }?;
    Ok(())
}

/// `out[t, :] = table[ids[t], :]` for `tokens` ids; `table` is `[vocab, d]`, `out` rows are
/// `out_stride` apart. An id >= vocab yields a row of NaN (it cannot be reported from the device
/// without a sync; [`crate::cpu::embedding_fwd`] returns an error instead).
#[allow(clippy::too_many_arguments)]
pub fn embedding_fwd_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    out: &mut impl DevicePtrMut<bf16>,
    table: &impl DevicePtr<bf16>,
    ids: &impl DevicePtr<u32>,
    tokens: usize,
    d: usize,
    out_stride: usize,
) -> Result<()> {
    const OP: &str = "embedding_fwd_bf16";
    if tokens == 0 || d == 0 {
        return Ok(());
    }
    if d > out_stride {
        return Err(shape(
            OP,
            format!("row width {d} exceeds out_stride {out_stride}"),
        ));
    }
    need(OP, "ids", ids, tokens)?;
    need(OP, "out", out, (tokens - 1) * out_stride + d)?;
    let vocab = table.len() / d;
    if vocab == 0 {
        return Err(shape(
            OP,
            format!(
                "table holds {} elements, less than one row of {d}",
                table.len()
            ),
        ));
    }
    let (tp, ip, op_) = (ptr(table, stream), ptr(ids, stream), ptr_mut(out, stream));
    let (t, d32, v, os) = (
        u32_of(OP, "tokens", tokens)?,
        d as u32,
        u32_of(OP, "vocab", vocab)?,
        out_stride as u32,
    );
    // SAFETY: ids holds `tokens` entries, each checked against `vocab` in the kernel before the
    // table is read; out covers every written row; arguments match
    // (table, ids, out, tokens, hidden, vocab, out_stride).
    unsafe {
        launch(
            gpu,
            stream,
            &POINTWISE,
            &[],
            "embedding_fwd_bf16",
            cfg((t, 1), 128),
            &[&tp, &ip, &op_, &t, &d32, &v, &os],
        )
    }?;
    Ok(())
}

/// KV-cache append: `cache[slots[t], :] = src[t, :]` for `tokens` rows of `width` elements;
/// `src` rows are `src_stride` apart (read the K or V part of a fused qkv output in place),
/// `cache` rows `cache_stride` apart. Slots past the cache's rows are skipped by the kernel.
#[allow(clippy::too_many_arguments)]
pub fn kv_append_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    cache: &mut impl DevicePtrMut<bf16>,
    src: &impl DevicePtr<bf16>,
    slots: &impl DevicePtr<u32>,
    tokens: usize,
    width: usize,
    src_stride: usize,
    cache_stride: usize,
) -> Result<()> {
    const OP: &str = "kv_append_bf16";
    if tokens == 0 || width == 0 {
        return Ok(());
    }
    if width > src_stride || width > cache_stride {
        return Err(shape(OP, format!("width {width} exceeds a row stride")));
    }
    need(OP, "slots", slots, tokens)?;
    need(OP, "src", src, (tokens - 1) * src_stride + width)?;
    let n_slots = if cache.len() < width {
        0
    } else {
        (cache.len() - width) / cache_stride + 1
    };
    let (sp, slp, cp) = (ptr(src, stream), ptr(slots, stream), ptr_mut(cache, stream));
    let (t, w, ss, cs, ns) = (
        u32_of(OP, "tokens", tokens)?,
        width as u32,
        src_stride as u32,
        cache_stride as u32,
        u32_of(OP, "slots", n_slots)?,
    );
    // SAFETY: src covers `tokens` rows; the kernel writes only slots < n_slots, each of whose
    // rows lies inside `cache`; arguments match
    // (src, slots, cache, tokens, width, src_stride, cache_stride, n_slots).
    unsafe {
        launch(
            gpu,
            stream,
            &POINTWISE,
            &[],
            "kv_append_bf16",
            cfg((t, 1), 128),
            &[&sp, &slp, &cp, &t, &w, &ss, &cs, &ns],
        )
    }?;
    Ok(())
}

/// Decode-step fusion of [`rope_fwd_bf16`] and two [`kv_append_bf16`]: on each `qkv` row
/// (`[tokens, (heads + 2 kv_heads) * head_dim]`, contiguous) rotate the q and k heads in place,
/// then copy the k and v parts to row `slots[t]` of `k_cache` / `v_cache`
/// (`[rows, kv_heads * head_dim]`). Bitwise the same as the three kernels.
#[allow(clippy::too_many_arguments)]
pub fn rope_kv_append_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    qkv: &mut (impl DevicePtrMut<bf16> + ?Sized),
    k_cache: &mut (impl DevicePtrMut<bf16> + ?Sized),
    v_cache: &mut (impl DevicePtrMut<bf16> + ?Sized),
    cos: &(impl DevicePtr<f32> + ?Sized),
    sin: &(impl DevicePtr<f32> + ?Sized),
    slots: &(impl DevicePtr<u32> + ?Sized),
    tokens: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    hf_text_rounding: bool,
) -> Result<()> {
    const OP: &str = "rope_kv_append_bf16";
    if !head_dim.is_multiple_of(2) {
        return Err(shape(OP, format!("head_dim {head_dim} must be even")));
    }
    if tokens == 0 {
        return Ok(());
    }
    let (row, kvw) = ((heads + 2 * kv_heads) * head_dim, kv_heads * head_dim);
    need(OP, "qkv", qkv, tokens * row)?;
    need(OP, "cos", cos, tokens * head_dim)?;
    need(OP, "sin", sin, tokens * head_dim)?;
    need(OP, "slots", slots, tokens)?;
    if v_cache.len() < k_cache.len() {
        return Err(shape(OP, "v_cache must hold as many elements as k_cache"));
    }
    let n_slots = u32_of(OP, "cache rows", k_cache.len() / kvw.max(1))?;
    let (xp, kp, vp) = (
        ptr_mut(qkv, stream),
        ptr_mut(k_cache, stream),
        ptr_mut(v_cache, stream),
    );
    let (cp, sp, slp) = (ptr(cos, stream), ptr(sin, stream), ptr(slots, stream));
    let (t, h, kvh, hd, mode) = (
        u32_of(OP, "tokens", tokens)?,
        heads as u32,
        kv_heads as u32,
        head_dim as u32,
        hf_text_rounding as u32,
    );
    // a thread per four pairs of the q and k heads: one pass
    let threads = ((heads + kv_heads) * head_dim / 8)
        .next_multiple_of(32)
        .clamp(32, 512) as u32;
    // SAFETY: qkv holds tokens rows, cos/sin tokens*head_dim, slots tokens (checked); the kernel
    // writes only cache rows < n_slots, inside both caches; arguments match (qkv, cos, sin,
    // k_cache, v_cache, slots, tokens, n_heads, n_kv, head_dim, hf_text_rounding, n_slots).
    unsafe {
        launch(
            gpu,
            stream,
            &POINTWISE,
            &[],
            "rope_kv_append_bf16",
            cfg((t, 1), threads),
            &[
                &xp, &cp, &sp, &kp, &vp, &slp, &t, &h, &kvh, &hd, &mode, &n_slots,
            ],
        )
    }?;
    Ok(())
}
