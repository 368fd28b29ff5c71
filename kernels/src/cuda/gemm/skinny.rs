//! The skinny GEMM for decode-sized products (our own tensor-core kernel, `kernels/cuda/gemv.cu`):
//! its cut ([`SkinnyPlan`], a function of the shape), its launch, and the fused gate|up + SwiGLU.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use super::super::launch::{aligned16, launch, ptr, ptr_mut, u32_of, Grid};
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
/// `64 * row_tiles` weight rows (output features; half gate, half up in the SwiGLU form), and k
/// cut into `splits` slices of `kslice` (a multiple of 64) summed in a cluster of `splits`
/// blocks; `wgmma`: the products on warpgroup MMAs (Hopper; `8 * m_tiles` is then 16, 32, 64 or
/// 128) rather than `mma.sync`; `stages`: the cp.async pipeline's depth (64 k each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SkinnyPlan {
    pub m_tiles: usize,
    pub row_tiles: usize,
    pub splits: usize,
    pub kslice: usize,
    pub wgmma: bool,
    pub stages: usize,
}

impl SkinnyPlan {
    /// Weight rows one block covers.
    pub fn block_rows(&self) -> usize {
        64 * self.row_tiles
    }
    /// Bytes of one pipeline stage (64 k of the block's weight rows and of x's padded rows).
    fn stage_bytes(&self) -> usize {
        (self.block_rows() + 8 * self.m_tiles) * 64 * 2
    }
    /// Dynamic shared memory one block uses (the stages; + 1 KiB to align them for `wgmma`).
    pub fn smem_bytes(&self) -> usize {
        self.stages * self.stage_bytes() + if self.wgmma { 1024 } else { 0 }
    }
    /// This plan with a `stages`-deep pipeline (`None` where the partial-sum tile would not fit
    /// in the stages, the stages not in a block's shared memory, or `stages` is outside 2..=8,
    /// 3..=8 for `wgmma`).
    pub fn with_stages(self, stages: usize) -> Option<SkinnyPlan> {
        let p = SkinnyPlan { stages, ..self };
        let red = p.block_rows() * (8 * p.m_tiles + 4) * 4;
        let least = if p.wgmma { 3 } else { 2 };
        ((least..=8).contains(&stages)
            && stages * p.stage_bytes() >= red
            && p.smem_bytes() <= SKINNY_SMEM_MAX)
            .then_some(p)
    }
    /// This plan in the `wgmma` form (`true`) or the `mma.sync` one, for `m` rows of x: the m
    /// tiles and the pipeline depth (6 stages for `wgmma`, of which 4 load ahead; 4 for
    /// `mma.sync`) follow the form; the cut of the weights and of k stays.
    pub fn with_form(self, m: usize, wgmma: bool) -> SkinnyPlan {
        SkinnyPlan {
            m_tiles: skinny_m_tiles(m, wgmma),
            wgmma,
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
/// `mma.sync` form at m <= 8 (4 stages), `wgmma` above (6 stages); blocks of 64 weight rows, k
/// cut into the fewest slices (1, 2, 4 or 8, each at least 256 k) that give at least 220 blocks.
/// Measured on the H200 (docs/perf.md, "Decode GEMMs"): at m = 8 this was the fastest or within
/// 3% of the fastest of 1/2 row tiles x 1/2/4/8 slices on every 3B / 7B decode GEMM; at m = 16
/// within 5% of the fastest of 1/2 row tiles x 1/2/4/8 slices x 3/4/6/8 stages (and of
/// cuBLASLt) on every 3B decode GEMM.
pub fn skinny_plan(m: usize, k: usize, n: usize) -> SkinnyPlan {
    let blocks = n.max(1).div_ceil(64);
    let mut plan = skinny_plan_with(m, k, n, 1, 1);
    for splits in [2, 4, 8] {
        if blocks * plan.splits >= 220 {
            break;
        }
        let p = skinny_plan_with(m, k, n, 1, splits);
        if p.kslice < 256 {
            break;
        }
        plan = p;
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

#[allow(clippy::too_many_arguments)]
fn skinny_launch(
    op: &'static str,
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
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
    swiglu: bool,
    plan: SkinnyPlan,
) -> Result<()> {
    let tiles_ok = if plan.wgmma {
        [2, 4, 8, 16].contains(&plan.m_tiles)
    } else {
        plan.m_tiles <= 8
    };
    if plan.m_tiles * 8 < m
        || !tiles_ok
        || !(1..=2).contains(&plan.row_tiles)
        || !(1..=8).contains(&plan.splits)
        || !(if plan.wgmma { 3 } else { 2 }..=8).contains(&plan.stages)
        || plan.smem_bytes() > SKINNY_SMEM_MAX
        || !plan.kslice.is_multiple_of(64)
        || plan.splits * plan.kslice < k
    {
        return Err(shape(
            op,
            format!("plan {plan:?} does not cover m={m} k={k} (m_tiles*8 >= m with m_tiles 2, 4, 8 or 16 for wgmma and at most 8 else, 1..=2 row tiles, 1..=8 splits, 2..=8 stages (3..=8 for wgmma), kslice a multiple of 64, splits*kslice >= k)"),
        ));
    }
    if plan.wgmma && !gpu.has_wgmma() {
        return Err(shape(
            op,
            format!("plan {plan:?} uses warpgroup MMAs, which {} ({}) lacks: take the mma.sync form (SkinnyPlan::with_form) or linear_fwd_bf16", gpu.name(), gpu.arch()),
        ));
    }
    for (name, p) in [("y", y), ("x", x), ("w", w)] {
        if name != "y" {
            aligned16(op, name, p)?;
        }
    }
    let defines: Vec<(&'static str, u32)> = vec![
        ("GEMV_MT", plan.m_tiles as u32),
        ("GEMV_RT", plan.row_tiles as u32),
        ("GEMV_S", plan.splits as u32),
        ("GEMV_SWIGLU", swiglu as u32),
        ("GEMV_WG", plan.wgmma as u32),
        ("GEMV_STAGES", plan.stages as u32),
    ];
    let smem = plan.smem_bytes() as u32;
    let rows_per_block = if swiglu {
        plan.block_rows() / 2
    } else {
        plan.block_rows()
    };
    let gy = u32_of(op, "row blocks", n.div_ceil(rows_per_block))?;
    let cfg = Grid {
        grid: (plan.splits as u32, gy, 1),
        block: (128, 1, 1),
        smem,
    };
    let (mm, nn, kk) = (m as u32, u32_of(op, "n", n)?, u32_of(op, "k", k)?);
    let (lx, ly) = (u32_of(op, "ldx", ldx)?, u32_of(op, "ldy", ldy)?);
    let (ks, uo) = (plan.kslice as u32, u32_of(op, "up_off", up_off)?);
    // SAFETY: the callers checked that y holds (m-1)*ldy + n elements, x (m-1)*ldx + k, w every
    // weight row the kernel reads (n rows of k, or up_off + n rows in the SwiGLU form) and bias
    // n (up_off + n) elements; the kernel reads x rows < m and weight rows < n (+ up_off) only,
    // k < min(k, slice end), and writes y rows < m, columns < n; x and w are 16-byte aligned,
    // k % 8 == 0 and ldx % 8 == 0 (checked); grid.x == splits == the compiled cluster size;
    // arguments match (y, x, w, bias, m, n, k, ldx, ldy, kslice, up_off).
    unsafe {
        launch(
            gpu,
            stream,
            &GEMV,
            &defines,
            "gemv_bf16",
            cfg,
            &[&y, &x, &w, &bias, &mm, &nn, &kk, &lx, &ly, &ks, &uo],
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
    skinny_launch(
        OP, gpu, stream, yp, xp, wp, bp, m, k, n, ldx, ldy, 0, false, plan,
    )
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
    skinny_launch(OP, gpu, stream, yp, xp, wp, 0, m, k, f, k, f, f, true, plan)
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
        for (mt, rt, s, sw, wg, st) in [
            (8, 2, 1, 0, 0, 4),
            (8, 1, 8, 0, 0, 4),
            (1, 2, 4, 0, 0, 4),
            (8, 2, 2, 1, 0, 4),
            (3, 1, 7, 1, 0, 4),
            (16, 2, 8, 0, 1, 3),
            (16, 2, 4, 1, 1, 3),
            (8, 2, 1, 0, 1, 4),
            (4, 1, 2, 1, 1, 5),
            (2, 2, 8, 0, 1, 6),
        ] {
            let d = [
                ("GEMV_MT", mt),
                ("GEMV_RT", rt),
                ("GEMV_S", s),
                ("GEMV_SWIGLU", sw),
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
