//! The skinny GEMM for decode-sized products (our own tensor-core kernel, `kernels/cuda/gemv.cu`):
//! its cut ([`SkinnyPlan`], a function of the shape), its launch, the fused gate|up + SwiGLU and
//! the decode step's q|k|v projection with the rotary embedding and the KV append fused.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};
use half::bf16;

use super::super::launch::{aligned16, launch, need, ptr, ptr_mut, tma_map_bf16, u32_of, Grid};
use super::super::nvrtc::KernelModule;
use super::super::{shape, Gpu, Result};

/// The skinny-GEMM kernel source (compiled per [`SkinnyPlan`] shape class by NVRTC).
pub const GEMV: KernelModule = KernelModule {
    name: "gemv",
    source: include_str!("../../../cuda/gemv.cu"),
};

/// The most rows of `x` the skinny kernel takes (16 m-tiles of 8, the `wgmma` form).
pub const SKINNY_MAX_M: usize = 128;

/// The most dynamic shared memory a block may have (sm_90: 227 KiB).
const SKINNY_SMEM_MAX: usize = 227 << 10;

/// The rows of `x` up to which [`skinny_plan`] takes the `mma.sync` form.
pub const SKINNY_SYNC_MAX_M: usize = 8;

/// How [`skinny_linear_fwd_bf16`] cuts a GEMM: `m_tiles` tiles of 8 rows of x, blocks of
/// `64 * row_tiles * warpgroups` weight rows (output features; half gate, half up in the SwiGLU
/// form), and k cut into `splits` slices of `kslice` (a multiple of 64) summed in a cluster of
/// `splits` blocks; `wgmma`: the products on warpgroup MMAs fed by the tensor memory accelerator
/// (Hopper; `8 * m_tiles` is then 16, 32, 64 or 128, and `warpgroups` 1 or 2 consumer
/// warpgroups share each x tile) rather than `mma.sync` (one warpgroup); `stages`: the
/// pipeline's depth (64 k each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SkinnyPlan {
    pub m_tiles: usize,
    pub row_tiles: usize,
    pub warpgroups: usize,
    pub splits: usize,
    pub kslice: usize,
    pub wgmma: bool,
    pub stages: usize,
}

impl SkinnyPlan {
    /// Weight rows one block covers.
    pub fn block_rows(&self) -> usize {
        64 * self.row_tiles * self.warpgroups
    }
    /// Threads of a block: the warpgroups, and the producer warp of the `wgmma` form.
    fn threads(&self) -> usize {
        128 * self.warpgroups + if self.wgmma { 32 } else { 0 }
    }
    /// Bytes of one pipeline stage (64 k of the block's weight rows and of x's padded rows).
    fn stage_bytes(&self) -> usize {
        (self.block_rows() + 8 * self.m_tiles) * 64 * 2
    }
    /// Dynamic shared memory one block uses (the stages; for `wgmma` + 1 KiB to align them and
    /// 16 bytes a stage for its two barriers).
    pub fn smem_bytes(&self) -> usize {
        self.stages * self.stage_bytes()
            + if self.wgmma {
                1024 + 16 * self.stages
            } else {
                0
            }
    }
    /// This plan with a `stages`-deep pipeline (`None` where the partial-sum tile would not fit
    /// in the stages, the stages not in a block's shared memory, or `stages` is outside 2..=8).
    pub fn with_stages(self, stages: usize) -> Option<SkinnyPlan> {
        let p = SkinnyPlan { stages, ..self };
        let red = p.block_rows() * (8 * p.m_tiles + 4) * 4;
        ((2..=8).contains(&stages)
            && stages * p.stage_bytes() >= red
            && p.smem_bytes() <= SKINNY_SMEM_MAX)
            .then_some(p)
    }
    /// This plan at the deepest pipeline of at most `stages` that fits (`None` where none does).
    pub fn with_stages_at_most(self, stages: usize) -> Option<SkinnyPlan> {
        (2..=stages).rev().find_map(|st| self.with_stages(st))
    }
    /// This plan with `warpgroups` consumer warpgroups (`wgmma` form: 1 or 2), each keeping its
    /// row tiles, at the deepest pipeline up to the plan's own that fits (`None` where none does).
    pub fn with_warpgroups(self, warpgroups: usize) -> Option<SkinnyPlan> {
        SkinnyPlan { warpgroups, ..self }.with_stages_at_most(self.stages)
    }
    /// This plan in the `wgmma` form (`true`) or the `mma.sync` one, for `m` rows of x: the m
    /// tiles and the pipeline depth (6 stages for `wgmma`, 4 for `mma.sync`, one warpgroup)
    /// follow the form; the cut of the weights and of k stays.
    pub fn with_form(self, m: usize, wgmma: bool) -> SkinnyPlan {
        SkinnyPlan {
            m_tiles: skinny_m_tiles(m, wgmma),
            wgmma,
            warpgroups: 1,
            stages: if wgmma { 6 } else { 4 },
            ..self
        }
    }
}

/// m tiles of 8 rows the kernel pads `m` to: `wgmma`'s N is 16, 32, 64 or 128.
fn skinny_m_tiles(m: usize, wgmma: bool) -> usize {
    let m = m.clamp(1, SKINNY_MAX_M);
    if wgmma {
        [16, 32, 64, 128]
            .into_iter()
            .find(|&n| n >= m)
            .unwrap_or(128)
            / 8
    } else {
        m.div_ceil(8)
    }
}

/// The plan [`skinny_linear_fwd_bf16`] uses for `y[m, n] = x[m, k] w[n, k]^T` (`n` output
/// features; for the SwiGLU form the `2f` gate|up rows): a function of the shape only. The
/// `mma.sync` form at m <= 8 (4 stages), `wgmma` above; blocks of 64 weight rows, k cut into
/// the fewest slices (1, 2, 4 or 8, each at least 256 k) that give at least 220 blocks (120
/// above m = 16, where each slice's partial tile costs more to sum); 6 stages up to m = 16,
/// above 3 where the grid has at least 264 blocks and 6 (or the deepest that fits) where it
/// has fewer. Measured (docs/perf.md, "Decode GEMMs"): on the H200 at m = 8 the fastest or
/// within 3% of the fastest of 1/2 row tiles x 1/2/4/8 slices on every 3B / 7B decode GEMM,
/// at m = 16 within 5% of the fastest of 1/2 row tiles x 1/2/4/8 slices x 3/4/6/8 stages (and
/// of cuBLASLt) on every 3B decode GEMM; on the H100 at m = 32 and 64 the stage counts of the
/// fastest cuts of the lopsided 3B / 7B GEMMs (gate|up, down, lm head).
pub fn skinny_plan(m: usize, k: usize, n: usize) -> SkinnyPlan {
    let blocks = n.max(1).div_ceil(64);
    let least = if m <= 16 { 220 } else { 120 };
    let mut plan = skinny_plan_with(m, k, n, 1, 1);
    for splits in [2, 4, 8] {
        if blocks * plan.splits >= least {
            break;
        }
        let p = skinny_plan_with(m, k, n, 1, splits);
        if p.kslice < 256 {
            break;
        }
        plan = p;
    }
    if m > 16 {
        // a grid of two blocks an SM or more hides the loads' latency with blocks (shallow
        // stages, small blocks); a smaller one with a deeper pipeline
        let stages = if blocks * plan.splits >= 264 { 3 } else { 6 };
        plan = plan.with_stages_at_most(stages).unwrap_or(plan);
    }
    plan
}

/// The plan with `row_tiles` (1 or 2) and k cut into at most `splits` (1..=8) slices of a
/// multiple of 64 (the plan's `splits` may come out smaller when k is short), in the form
/// [`skinny_plan`] takes for `m` (`wgmma` above [`SKINNY_SYNC_MAX_M`]).
pub fn skinny_plan_with(
    m: usize,
    k: usize,
    _n: usize,
    row_tiles: usize,
    splits: usize,
) -> SkinnyPlan {
    let kslice = k.max(1).div_ceil(splits.clamp(1, 8)).div_ceil(64) * 64;
    SkinnyPlan {
        m_tiles: 1,
        row_tiles: row_tiles.clamp(1, 2),
        warpgroups: 1,
        splits: k.max(1).div_ceil(kslice),
        kslice,
        wgmma: false,
        stages: 4,
    }
    .with_form(m, m > SKINNY_SYNC_MAX_M)
}

/// Whether the skinny kernel can run this GEMM (else use [`super::linear_fwd_bf16`]): `1 <= m <= 128`,
/// `k` a multiple of 8 (rows are read in 16-byte units); above [`SKINNY_SYNC_MAX_M`] rows only
/// on a device with warpgroup MMAs ([`Gpu::has_wgmma`]).
pub fn skinny_fits(m: usize, k: usize) -> bool {
    (1..=SKINNY_MAX_M).contains(&m) && k.is_multiple_of(8) && k > 0
}

/// The rotary form's tables and caches as the kernel takes them (`GvRope` in gemv.cu; zeros for
/// the other forms).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct GvRope {
    cos: u64,
    sin: u64,
    k_cache: u64,
    v_cache: u64,
    slots: u64,
    n_heads: u32,
    n_kv: u32,
    n_slots: u32,
    pad: u32,
}

// SAFETY: plain integers laid out as the kernel's `GvRope` (repr(C), 56 bytes).
unsafe impl DeviceRepr for GvRope {}

/// What the kernel's epilogue writes: the product (+ bias), SwiGLU of its gate and up halves, or
/// the rotated q|k|v rows with k and v appended to the caches.
#[derive(Clone, Copy)]
enum Epilogue {
    Plain,
    SwiGlu,
    Rope(GvRope),
}

impl Epilogue {
    /// Whether a block takes its weight rows in pairs (a row and the one `up_off` after it).
    fn paired(&self) -> bool {
        !matches!(self, Epilogue::Plain)
    }
    /// The weight rows the kernel may read for `n` outputs (pairs in the paired forms): `n`,
    /// the up rows' end in the SwiGLU form, both rows of every pair in the rotary form.
    fn weight_rows(&self, n: usize, up_off: usize) -> usize {
        match self {
            Epilogue::Plain => n,
            Epilogue::SwiGlu => up_off + n,
            Epilogue::Rope(_) => 2 * n,
        }
    }
}

/// One launch's operands (device addresses, `bias` 0 for none) and shape: `n` outputs (pairs in
/// the paired epilogues, a pair's second weight row `up_off` rows after its first) of depth `k`
/// for `m` rows of x (row stride `ldx`) into y (row stride `ldy`).
struct SkinnyCall {
    y: u64,
    x: u64,
    w: u64,
    bias: u64,
    m: usize,
    k: usize,
    n: usize,
    ldx: usize,
    ldy: usize,
    up_off: usize,
    epi: Epilogue,
}

fn skinny_launch(
    op: &'static str,
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    call: SkinnyCall,
    plan: SkinnyPlan,
) -> Result<()> {
    let SkinnyCall {
        y,
        x,
        w,
        bias,
        m,
        k,
        n,
        ldx,
        ldy,
        up_off,
        epi,
    } = call;
    let tiles_ok = if plan.wgmma {
        [2, 4, 8, 16].contains(&plan.m_tiles)
    } else {
        plan.m_tiles <= 8
    };
    if plan.m_tiles * 8 < m
        || !tiles_ok
        || !(1..=2).contains(&plan.row_tiles)
        || !(1..=if plan.wgmma { 2 } else { 1 }).contains(&plan.warpgroups)
        || !(1..=8).contains(&plan.splits)
        || plan.with_stages(plan.stages) != Some(plan)
        || !plan.kslice.is_multiple_of(64)
        || plan.splits * plan.kslice < k
    {
        return Err(shape(
            op,
            format!("plan {plan:?} does not cover m={m} k={k} (m_tiles*8 >= m with m_tiles 2, 4, 8 or 16 for wgmma and at most 8 else, 1..=2 row tiles, 1..=2 warpgroups for wgmma and 1 else, 1..=8 splits, 2..=8 stages whose bytes hold the partial tile and fit a block, kslice a multiple of 64, splits*kslice >= k)"),
        ));
    }
    if plan.wgmma && !gpu.has_wgmma() {
        return Err(shape(
            op,
            format!("plan {plan:?} uses warpgroup MMAs, which {} ({}) lacks: take the mma.sync form (SkinnyPlan::with_form) or linear_fwd_bf16", gpu.name(), gpu.arch()),
        ));
    }
    aligned16(op, "x", x)?;
    aligned16(op, "w", w)?;
    let defines: Vec<(&'static str, u32)> = vec![
        ("GEMV_MT", plan.m_tiles as u32),
        ("GEMV_RT", plan.row_tiles as u32),
        ("GEMV_WGS", plan.warpgroups as u32),
        ("GEMV_S", plan.splits as u32),
        ("GEMV_SWIGLU", matches!(epi, Epilogue::SwiGlu) as u32),
        ("GEMV_ROPE", matches!(epi, Epilogue::Rope(_)) as u32),
        ("GEMV_WG", plan.wgmma as u32),
        ("GEMV_STAGES", plan.stages as u32),
    ];
    let smem = plan.smem_bytes() as u32;
    let rows_per_block = if epi.paired() {
        plan.block_rows() / 2
    } else {
        plan.block_rows()
    };
    let rp = match epi {
        Epilogue::Rope(r) => r,
        _ => GvRope::default(),
    };
    if matches!(epi, Epilogue::Rope(_)) && (up_off == 0 || !up_off.is_multiple_of(rows_per_block)) {
        return Err(shape(
            op,
            format!("plan {plan:?}: a block's {rows_per_block} pairs must divide half a head ({up_off} rows)"),
        ));
    }
    let gy = u32_of(op, "row blocks", n.div_ceil(rows_per_block))?;
    let cfg = Grid {
        grid: (plan.splits as u32, gy, 1),
        block: (plan.threads() as u32, 1, 1),
        smem,
    };
    let (mm, nn, kk) = (m as u32, u32_of(op, "n", n)?, u32_of(op, "k", k)?);
    let (lx, ly) = (u32_of(op, "ldx", ldx)?, u32_of(op, "ldy", ldy)?);
    let (ks, uo) = (plan.kslice as u32, u32_of(op, "up_off", up_off)?);
    if plan.wgmma {
        // the weight rows the boxes may name
        let w_rows = epi.weight_rows(n, up_off);
        let box_rows = u32_of(op, "box rows", rows_per_block)?;
        let wmap = tma_map_bf16(op, w, w_rows, k, k, 64, box_rows)?;
        let xmap = tma_map_bf16(op, x, m, k, ldx, 64, (8 * plan.m_tiles) as u32)?;
        // SAFETY: as below; the descriptors cover exactly the w rows and the m rows of x the
        // caller checked, and the kernel reads nothing else of them (boxes past the ends read
        // zeros).
        return unsafe {
            launch(
                gpu,
                stream,
                &GEMV,
                &defines,
                "gemv_tma_bf16",
                cfg,
                &[&y, &bias, &wmap, &xmap, &mm, &nn, &kk, &ly, &ks, &uo, &rp],
            )
        };
    }
    // SAFETY: the callers checked that y holds (m-1)*ldy + n elements, x (m-1)*ldx + k, w every
    // weight row the kernel reads (n rows of k, or up_off + n rows in the SwiGLU form) and bias
    // n (up_off + n) elements; the kernel reads x rows < m and weight rows < n (+ up_off) only,
    // k < min(k, slice end), and writes y rows < m, columns < n (both rows of n pairs in the
    // rotary form, whose caller checked its tables and caches); x and w are 16-byte aligned,
    // k % 8 == 0 and ldx % 8 == 0 (checked); grid.x == splits == the compiled cluster size;
    // arguments match (y, x, w, bias, m, n, k, ldx, ldy, kslice, up_off, rp).
    unsafe {
        launch(
            gpu,
            stream,
            &GEMV,
            &defines,
            "gemv_bf16",
            cfg,
            &[&y, &x, &w, &bias, &mm, &nn, &kk, &lx, &ly, &ks, &uo, &rp],
        )
    }?;
    Ok(())
}

fn skinny_checks(
    op: &'static str,
    m: usize,
    k: usize,
    ldx: usize,
    ldy: usize,
    n: usize,
) -> Result<()> {
    if !skinny_fits(m, k) {
        return Err(shape(
            op,
            format!("m={m} k={k}: the skinny kernel takes 1 <= m <= {SKINNY_MAX_M} and k a positive multiple of 8 (use linear_fwd_bf16)"),
        ));
    }
    if ldx < k || !ldx.is_multiple_of(8) || ldy < n || n == 0 {
        return Err(shape(
            op,
            format!(
                "row strides ldx={ldx} (>= k={k}, multiple of 8), ldy={ldy} (>= n={n}) do not fit"
            ),
        ));
    }
    Ok(())
}

/// `y[m, n] = x[m, k] w[n, k]^T + bias[n]` for decode-sized `m <= 128` with our tensor-core
/// split-k kernel ([`skinny_plan`]); the same contract and CPU twin ([`crate::cpu::linear_fwd`])
/// as [`super::linear_fwd_bf16`], contiguous rows.
#[allow(clippy::too_many_arguments)]
pub fn skinny_linear_fwd_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    y: &mut impl DevicePtrMut<bf16>,
    x: &impl DevicePtr<bf16>,
    w: &impl DevicePtr<bf16>,
    bias: Option<&dyn DevicePtr<bf16>>,
    m: usize,
    k: usize,
    n: usize,
) -> Result<()> {
    let plan = skinny_plan(m, k, n);
    skinny_linear_fwd_bf16_with(gpu, stream, y, x, w, bias, m, k, n, k, n, plan)
}

/// [`skinny_linear_fwd_bf16`] with row strides (`ldx` elements between rows of x, `ldy` of y)
/// and an explicit plan.
#[allow(clippy::too_many_arguments)]
pub fn skinny_linear_fwd_bf16_with(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    y: &mut impl DevicePtrMut<bf16>,
    x: &impl DevicePtr<bf16>,
    w: &impl DevicePtr<bf16>,
    bias: Option<&dyn DevicePtr<bf16>>,
    m: usize,
    k: usize,
    n: usize,
    ldx: usize,
    ldy: usize,
    plan: SkinnyPlan,
) -> Result<()> {
    const OP: &str = "skinny_linear_fwd_bf16";
    skinny_checks(OP, m, k, ldx, ldy, n)?;
    for (name, have, want) in [
        ("y", y.len(), (m - 1) * ldy + n),
        ("x", x.len(), (m - 1) * ldx + k),
        ("w", w.len(), n * k),
    ] {
        if have < want {
            return Err(shape(
                OP,
                format!("{name} holds {have} elements, needs {want}"),
            ));
        }
    }
    let bp = match bias {
        Some(b) => {
            if b.len() < n {
                return Err(shape(
                    OP,
                    format!("bias holds {} elements, needs {n}", b.len()),
                ));
            }
            ptr(b, stream)
        }
        None => 0,
    };
    let (yp, xp, wp) = (ptr_mut(y, stream), ptr(x, stream), ptr(w, stream));
    let call = SkinnyCall {
        y: yp,
        x: xp,
        w: wp,
        bias: bp,
        m,
        k,
        n,
        ldx,
        ldy,
        up_off: 0,
        epi: Epilogue::Plain,
    };
    skinny_launch(OP, gpu, stream, call, plan)
}

/// The MLP's first half in one launch: `act[m, f] = silu(x Wg^T) * (x Wu^T)` where
/// `w_gate_up` is `[2f, k]`, gate rows then up rows (the fused gate|up weight), with the
/// roundings of [`super::linear_fwd_bf16`] into a `[m, 2f]` buffer followed by
/// [`crate::cuda::swiglu_fwd_bf16`]. `plan`: `None` takes [`skinny_plan`]`(m, k, 2 f)`, the plan of
/// the unfused `[m, 2f]` GEMM: same k slices, so the result is bitwise that GEMM through
/// [`skinny_linear_fwd_bf16`] followed by `swiglu_fwd_bf16`.
#[allow(clippy::too_many_arguments)]
pub fn skinny_gate_up_swiglu_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    act: &mut impl DevicePtrMut<bf16>,
    x: &impl DevicePtr<bf16>,
    w_gate_up: &impl DevicePtr<bf16>,
    m: usize,
    k: usize,
    f: usize,
    plan: Option<SkinnyPlan>,
) -> Result<()> {
    const OP: &str = "skinny_gate_up_swiglu_bf16";
    skinny_checks(OP, m, k, k, f, f)?;
    for (name, have, want) in [
        ("act", act.len(), m * f),
        ("x", x.len(), m * k),
        ("w_gate_up", w_gate_up.len(), 2 * f * k),
    ] {
        if have < want {
            return Err(shape(
                OP,
                format!("{name} holds {have} elements, needs {want}"),
            ));
        }
    }
    let plan = plan.unwrap_or_else(|| skinny_plan(m, k, 2 * f));
    let (yp, xp, wp) = (ptr_mut(act, stream), ptr(x, stream), ptr(w_gate_up, stream));
    // f outputs, each a gate row and the up row f rows after it
    let call = SkinnyCall {
        y: yp,
        x: xp,
        w: wp,
        bias: 0,
        m,
        k,
        n: f,
        ldx: k,
        ldy: f,
        up_off: f,
        epi: Epilogue::SwiGlu,
    };
    skinny_launch(OP, gpu, stream, call, plan)
}

/// Where the decode step's q|k|v projection puts its rotated keys and values: `k_cache` and
/// `v_cache` (`[rows, kv_heads * head_dim]`, one layer's), row `slots[i]` for row `i` of x (a
/// slot at or past the caches' rows writes nothing there), rotated with `cos` / `sin`
/// (`[m, head_dim]` each) in HF's text rounding.
pub struct QkvRope<'a> {
    pub k_cache: &'a mut dyn DevicePtrMut<bf16>,
    pub v_cache: &'a mut dyn DevicePtrMut<bf16>,
    pub cos: &'a dyn DevicePtr<f32>,
    pub sin: &'a dyn DevicePtr<f32>,
    pub slots: &'a dyn DevicePtr<u32>,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl QkvRope<'_> {
    /// The q|k|v row's width, `(heads + 2 kv_heads) * head_dim` (the projection's outputs).
    pub fn width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }
}

/// The plan [`skinny_qkv_rope_bf16`] takes for `m` rows, depth `k`, `n` q|k|v rows of heads of
/// `head_dim`: [`skinny_plan`]`(m, k, n)`, whose k slices (and so bits) are the plain GEMM's,
/// where its block's pairs divide half a head (`None` elsewhere: the fused form does not run).
pub fn skinny_qkv_rope_plan(m: usize, k: usize, n: usize, head_dim: usize) -> Option<SkinnyPlan> {
    let p = skinny_plan(m, k, n);
    let pairs = p.block_rows() / 2;
    (head_dim.is_multiple_of(2) && head_dim > 0 && (head_dim / 2).is_multiple_of(pairs))
        .then_some(p)
}

/// Decode's q|k|v projection `qkv[m, n] = x[m, k] w[n, k]^T + bias` (`n = (heads + 2 kv_heads)
/// * head_dim`) with the rotary embedding of the q and k heads and the append of k and v to the
/// caches in its epilogue: one launch, bitwise [`skinny_linear_fwd_bf16_with`] under the same
/// plan followed by [`crate::cuda::rope_kv_append_bf16`] (HF text rounding). `plan`: `None`
/// takes [`skinny_qkv_rope_plan`].
#[allow(clippy::too_many_arguments)]
pub fn skinny_qkv_rope_bf16(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    qkv: &mut impl DevicePtrMut<bf16>,
    x: &impl DevicePtr<bf16>,
    w: &impl DevicePtr<bf16>,
    bias: Option<&dyn DevicePtr<bf16>>,
    m: usize,
    k: usize,
    rope: QkvRope<'_>,
    plan: Option<SkinnyPlan>,
) -> Result<()> {
    const OP: &str = "skinny_qkv_rope_bf16";
    let (hd, n) = (rope.head_dim, rope.width());
    if rope.heads == 0 || rope.kv_heads == 0 || !rope.heads.is_multiple_of(rope.kv_heads) {
        return Err(shape(
            OP,
            format!(
                "{} heads over {} kv heads: both positive, the first a multiple of the second",
                rope.heads, rope.kv_heads
            ),
        ));
    }
    let plan = match plan.or_else(|| skinny_qkv_rope_plan(m, k, n, hd)) {
        Some(p) => p,
        None => {
            return Err(shape(
                OP,
                format!("head_dim {hd}: no plan whose block's pairs divide half a head (take linear_fwd_bf16 and rope_kv_append_bf16)"),
            ))
        }
    };
    skinny_checks(OP, m, k, k, n, n)?;
    let kvw = rope.kv_heads * hd;
    need(OP, "qkv", qkv, m * n)?;
    need(OP, "x", x, m * k)?;
    need(OP, "w", w, n * k)?;
    need(OP, "cos", rope.cos, m * hd)?;
    need(OP, "sin", rope.sin, m * hd)?;
    need(OP, "slots", rope.slots, m)?;
    if let Some(b) = bias {
        need(OP, "bias", b, n)?;
    }
    if rope.v_cache.len() < rope.k_cache.len() {
        return Err(shape(OP, "v_cache must hold as many elements as k_cache"));
    }
    let rp = GvRope {
        cos: ptr(rope.cos, stream),
        sin: ptr(rope.sin, stream),
        k_cache: ptr_mut(rope.k_cache, stream),
        v_cache: ptr_mut(rope.v_cache, stream),
        slots: ptr(rope.slots, stream),
        n_heads: u32_of(OP, "heads", rope.heads)?,
        n_kv: u32_of(OP, "kv heads", rope.kv_heads)?,
        n_slots: u32_of(OP, "cache rows", rope.k_cache.len() / kvw)?,
        pad: 0,
    };
    let bp = bias.map_or(0, |b| ptr(b, stream));
    let (yp, xp, wp) = (ptr_mut(qkv, stream), ptr(x, stream), ptr(w, stream));
    // n / 2 rotation pairs (i, i + head_dim / 2), each writing both of its outputs
    let call = SkinnyCall {
        y: yp,
        x: xp,
        w: wp,
        bias: bp,
        m,
        k,
        n: n / 2,
        ldx: k,
        ldy: n,
        up_off: hd / 2,
        epi: Epilogue::Rope(rp),
    };
    skinny_launch(OP, gpu, stream, call, plan)
}

#[cfg(test)]
mod skinny_tests {
    use super::*;
    use crate::cuda::nvrtc::{compile_uncached, nvrtc_or_skip, options, COMMON};

    #[test]
    fn plans_cover_k_and_fill_the_grid() {
        for &(m, k, n) in &[
            (64, 2048, 2560),
            (8, 11008, 2048),
            (64, 2048, 151_936),
            (3, 200, 48),
            (128, 11008, 2048),
            (17, 520, 300),
        ] {
            let p = skinny_plan(m, k, n);
            assert!(
                p.splits * p.kslice >= k && (p.splits - 1) * p.kslice < k,
                "{p:?}"
            );
            assert!(p.m_tiles * 8 >= m && p.kslice.is_multiple_of(64) && p.splits <= 8);
            assert_eq!(p.wgmma, m > SKINNY_SYNC_MAX_M, "{p:?}");
        }
        // a small-n GEMM is cut along k so that the grid is not a handful of blocks
        for m in [8, 64] {
            let p = skinny_plan(m, 2048, 2560);
            assert!(
                p.splits * 2560usize.div_ceil(p.block_rows()) >= 100,
                "{p:?}"
            );
        }
        assert!(!skinny_fits(129, 64) && !skinny_fits(8, 12) && skinny_fits(1, 8));
        // wgmma's N: the rows of x padded to 16, 32, 64 or 128
        for (m, tiles) in [
            (9, 2),
            (16, 2),
            (17, 4),
            (33, 8),
            (64, 8),
            (65, 16),
            (128, 16),
        ] {
            assert_eq!(skinny_plan(m, 2048, 2048).m_tiles, tiles, "m {m}");
        }
        // the decode shapes of 3B / 7B (qkv, o, gate|up, down, lm_head) at batch 128 to 8
        for m in [128, 64, 32, 16, 8] {
            for (k, n) in [
                (2048, 2560),
                (2048, 2048),
                (2048, 22016),
                (11008, 2048),
                (2048, 151_936),
                (3584, 4608),
                (3584, 3584),
                (3584, 37888),
                (18944, 3584),
                (3584, 152_064),
            ] {
                let p = skinny_plan(m, k, n);
                let blocks = n.div_ceil(p.block_rows()) * p.splits;
                println!("m{m} k{k} n{n}: {p:?}, {blocks} blocks");
                assert!(blocks >= 120 || p.splits == 8 || p.kslice < 512, "{p:?}");
                assert!(p.splits * p.kslice >= k && p.splits <= 8);
                // the partial tile fits in the stages it reuses
                assert!(
                    p.stages * p.stage_bytes() >= p.block_rows() * (8 * p.m_tiles + 4) * 4,
                    "{p:?}"
                );
                assert!(p.with_stages(p.stages) == Some(p), "{p:?}");
            }
        }
        // stages: 6 up to m = 16; above, 3 for grids of two blocks an SM (gate|up, lm head)
        // and 6 for smaller ones (down, cut along k)
        for m in [9, 16] {
            assert_eq!(skinny_plan(m, 2048, 22016).stages, 6, "m {m}");
        }
        for m in [17, 64] {
            assert_eq!(skinny_plan(m, 2048, 22016).stages, 3, "m {m}");
            assert_eq!(skinny_plan(m, 2048, 151_936).stages, 3, "m {m}");
            let down = skinny_plan(m, 11008, 2048);
            assert_eq!((down.stages, down.splits), (6, 4), "m {m}");
        }
        // the forms convert into each other with the cut kept
        let p = skinny_plan(64, 2048, 2560);
        let q = p.with_form(64, false);
        assert!(!q.wgmma && q.m_tiles == 8 && q.splits == p.splits && q.kslice == p.kslice);
        assert_eq!(q.with_form(64, true), p);
    }

    /// Compiles the kernel's variants for sm_90 where libnvrtc loads (no GPU needed) and prints
    /// ptxas's register / spill report.
    #[test]
    fn gemv_variants_compile_for_sm90() {
        if !nvrtc_or_skip() {
            return;
        }
        let source = format!("{COMMON}\n#line 1 \"gemv.cu\"\n{}", GEMV.source);
        for (mt, rt, wgs, s, sw, wg, st) in [
            (8, 2, 1, 1, 0, 0, 4),
            (8, 1, 1, 8, 0, 0, 4),
            (1, 2, 1, 4, 0, 0, 4),
            (8, 2, 1, 2, 1, 0, 4),
            (3, 1, 1, 7, 1, 0, 4),
            (16, 2, 1, 8, 0, 1, 3),
            (16, 2, 1, 4, 1, 1, 3),
            (16, 2, 2, 2, 0, 1, 3),
            (16, 1, 2, 4, 1, 1, 4),
            (8, 2, 1, 1, 0, 1, 4),
            (4, 1, 1, 2, 1, 1, 5),
            (2, 2, 1, 8, 0, 1, 6),
            (2, 2, 2, 8, 1, 1, 4),
            (1, 1, 1, 8, 2, 0, 4),
            (2, 1, 1, 8, 2, 1, 6),
            (8, 1, 1, 4, 2, 1, 3),
            (16, 1, 1, 2, 2, 1, 3),
        ] {
            // sw: the epilogue, 0 plain, 1 SwiGLU, 2 rotary
            let d = [
                ("GEMV_MT", mt),
                ("GEMV_RT", rt),
                ("GEMV_WGS", wgs),
                ("GEMV_S", s),
                ("GEMV_SWIGLU", (sw == 1) as u32),
                ("GEMV_ROPE", (sw == 2) as u32),
                ("GEMV_WG", wg),
                ("GEMV_STAGES", st),
            ];
            let arch = if wg == 1 { "sm_90a" } else { "sm_90" };
            match compile_uncached("gemv", &source, &options(arch, &d)) {
                Ok((cubin, log)) => {
                    assert!(!cubin.is_empty());
                    println!("== gemv {d:?}\n{log}");
                }
                Err(e) => panic!("{e}"),
            }
        }
    }
}
