//! Workbench: the two ceilings (device-to-device copy bandwidth, bf16 GEMM rate) and the GEMM
//! rate through this crate's wrappers at 8192^3 and at prefill shapes of Qwen2.5-VL 3B/7B, on the
//! whole GPU and on a green-context partition.
//!
//! Run: `cargo run --release -p rollplex-kernels --example bench_gemm` (needs a GPU).
//! Random data (never zeros); warm-up first; each number is the median of timed repeats
//! (CUDA events around each repeat).

use std::sync::Arc;

use half::bf16;
use rollplex_kernels::cpu::Gemm;
use rollplex_kernels::cuda::green::Priority;
use rollplex_kernels::cuda::*;

type Res<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn rand_bf(n: usize, seed: u64, scale: f32) -> Vec<bf16> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            bf16::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale)
        })
        .collect()
}

/// Median milliseconds of `reps` timed runs of `f` on `s` after `warm` untimed ones.
fn time_ms(
    g: &Gpu,
    s: &Arc<CudaStream>,
    warm: usize,
    reps: usize,
    mut f: impl FnMut() -> Res<()>,
) -> Res<f64> {
    for _ in 0..warm {
        f()?;
    }
    s.synchronize()?;
    let mut ts = Vec::new();
    for _ in 0..reps {
        let (a, b) = (g.timing_event()?, g.timing_event()?);
        a.record(s)?;
        f()?;
        b.record(s)?;
        b.synchronize()?;
        ts.push(a.elapsed_ms(&b)? as f64);
    }
    ts.sort_by(|x, y| x.partial_cmp(y).unwrap());
    Ok(ts[ts.len() / 2])
}

fn main() -> Res<()> {
    let g = Gpu::new(0)?;
    let s = g.stream(0)?;
    g.prepare_stream(&s)?;
    println!(
        "device: {} ({}, {} SMs), driver {}",
        g.name(),
        g.arch(),
        g.sm_count(),
        green::driver_version()?
    );

    // Copy ceiling: 2 GiB buffer copied device to device; bytes read + written.
    let n = 1usize << 30; // bf16 elements = 2 GiB
    let src = s.clone_htod(&rand_bf(1 << 24, 1, 1.0))?;
    let mut a = g.alloc::<bf16>(&s, n)?;
    let mut b = g.alloc::<bf16>(&s, n)?;
    for i in 0..(n >> 24) {
        s.memcpy_dtod(&src, &mut a.slice_mut(i << 24..(i + 1) << 24))?;
    }
    let ms = time_ms(&g, &s, 3, 10, || {
        s.memcpy_dtod(&a, &mut b)?;
        Ok(())
    })?;
    let copy_bw = 2.0 * (n * 2) as f64 / (ms * 1e-3) / 1e12;
    println!("device copy 2 GiB: {ms:.3} ms = {copy_bw:.2} TB/s (read + write)");
    drop((a, b));

    let run =
        |label: &str, m: usize, k: usize, n: usize, st: &Arc<CudaStream>, lt: bool| -> Res<f64> {
            let da = st.clone_htod(&rand_bf(m * k, 2, 1.0))?;
            let db = st.clone_htod(&rand_bf(n * k, 3, 0.05))?;
            let mut dc = g.alloc::<bf16>(st, m * n)?;
            let gm = Gemm::nt(m, k, n);
            let ms = time_ms(&g, st, 5, 20, || {
                if lt {
                    matmul_bf16(&g, st, &mut dc, &da, &db, gm)?;
                } else {
                    matmul_bf16_cublas(&g, st, &mut dc, &da, &db, gm)?;
                }
                Ok(())
            })?;
            let tf = 2.0 * (m * n * k) as f64 / (ms * 1e-3) / 1e12;
            println!("{label:<44} m{m:<6} k{k:<6} n{n:<6} {ms:8.3} ms {tf:7.1} TFLOP/s");
            Ok(tf)
        };
    let ceiling = run("matmul_bf16 (cuBLASLt) 8192^3", 8192, 8192, 8192, &s, true)?;
    run(
        "matmul_bf16_cublas (cublasGemmEx) 8192^3",
        8192,
        8192,
        8192,
        &s,
        false,
    )?;
    // Prefill GEMMs of one decoder layer at 8192 tokens: qkv, o, gate|up, down.
    for (name, h, q, kv, f) in [
        ("3B", 2048usize, 2048usize, 256usize, 11008usize),
        ("7B", 3584, 3584, 512, 18944),
    ] {
        let t = 8192;
        let mut flops = 0.0;
        let mut time = 0.0;
        for (what, k, n) in [
            ("qkv", h, q + 2 * kv),
            ("o_proj", q, h),
            ("gate_up", h, 2 * f),
            ("down", f, h),
        ] {
            let tf = run(
                &format!("linear {name} {what} (8192 tokens)"),
                t,
                k,
                n,
                &s,
                true,
            )?;
            let fl = 2.0 * (t * k * n) as f64;
            flops += fl;
            time += fl / (tf * 1e12);
        }
        println!(
            "=> {name} layer GEMMs at 8192 tokens: {:.1} TFLOP/s ({:.0}% of the 8192^3 rate)",
            flops / time / 1e12,
            100.0 * flops / time / 1e12 / ceiling
        );
    }
    // Decode-shaped (skinny) GEMMs: time and weight bandwidth against the copy ceiling,
    // cuBLASLt (our default) and classic cuBLAS side by side. Weights rotate over 4 copies so
    // that the 60 MB L2 does not serve repeats.
    println!("decode GEMMs (weights streamed from HBM; bandwidth = weight bytes / time):");
    let src = s.clone_htod(&rand_bf(1 << 24, 77, 0.05))?;
    // A device buffer of n elements filled from the random source (fast for GBs).
    let filled = |n: usize, shift: usize| -> Res<CudaSlice<bf16>> {
        let mut d = g.alloc::<bf16>(&s, n)?;
        let c = src.len();
        let mut off = 0;
        let mut k = shift;
        while off < n {
            let len = c.min(n - off);
            let st = (k * 7919) % (c - len + 1).max(1);
            s.memcpy_dtod(&src.slice(st..st + len), &mut d.slice_mut(off..off + len))?;
            off += len;
            k += 1;
        }
        Ok(d)
    };
    for (name, h, q, kv, f, vocab) in [
        (
            "3B",
            2048usize,
            2048usize,
            256usize,
            11008usize,
            151_936usize,
        ),
        ("7B", 3584, 3584, 512, 18944, 152_064),
    ] {
        for (what, k, n) in [
            ("qkv", h, q + 2 * kv),
            ("o_proj", q, h),
            ("gate_up", h, 2 * f),
            ("down", f, h),
            ("lm_head", h, vocab),
        ] {
            let copies = 4;
            let ws: Vec<_> = (0..copies)
                .map(|i| filled(n * k, i * 13))
                .collect::<Res<_>>()?;
            for m in [64usize, 8] {
                let dx = s.clone_htod(&rand_bf(m * k, 3, 1.0))?;
                let mut dy = g.alloc::<bf16>(&s, m * n)?;
                let gm = Gemm::nt(m, k, n);
                let mut res = Vec::new();
                for lt in [true, false] {
                    let mut i = 0;
                    let ms = time_ms(&g, &s, 4, 24, || {
                        let w = &ws[i % copies];
                        i += 1;
                        if lt {
                            matmul_bf16(&g, &s, &mut dy, &dx, w, gm)?;
                        } else {
                            matmul_bf16_cublas(&g, &s, &mut dy, &dx, w, gm)?;
                        }
                        Ok(())
                    })?;
                    res.push((ms, (n * k * 2) as f64 / (ms * 1e-3) / 1e12));
                }
                println!(
                    "  {name} {what:<8} m{m:<3} k{k:<6} n{n:<7} cuBLASLt {:7.1} us {:5.2} TB/s ({:3.0}%) | cuBLAS {:7.1} us {:5.2} TB/s",
                    res[0].0 * 1e3,
                    res[0].1,
                    100.0 * res[0].1 / copy_bw,
                    res[1].0 * 1e3,
                    res[1].1
                );
            }
        }
    }

    // Prefill attention (the SIMT flash-style kernel): causal, 8192 tokens in 4 sequences.
    for (name, nh, nkv) in [("3B", 16usize, 2usize), ("7B", 28, 4)] {
        let dims = rollplex_kernels::cpu::AttnDims {
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: 128,
        };
        let (t, per) = (8192usize, 2048usize);
        let dq = s.clone_htod(&rand_bf(t * dims.q_width(), 4, 1.0))?;
        let dk = s.clone_htod(&rand_bf(t * dims.kv_width(), 5, 1.0))?;
        let dv = s.clone_htod(&rand_bf(t * dims.kv_width(), 6, 1.0))?;
        let seqs: Vec<AttnSeqGpu> = (0..t / per)
            .map(|i| {
                let st = (i * per) as u32;
                AttnSeqGpu {
                    q_start: st,
                    q_len: per as u32,
                    p_start: 0,
                    p_len: 0,
                    k_start: st,
                    k_len: per as u32,
                }
            })
            .collect();
        let dsq = s.clone_htod(&seqs)?;
        let mut dout = g.alloc::<bf16>(&s, t * dims.q_width())?;
        let strides = attention::RowStrides::contiguous(dims);
        let ms = time_ms(&g, &s, 2, 10, || {
            attention_fwd_bf16(
                &g,
                &s,
                &mut dout,
                None,
                FwdInputs {
                    q: &dq,
                    k: &dk,
                    v: &dv,
                    prefix_k: &dk,
                    prefix_v: &dv,
                    seqs: &dsq,
                    n_seqs: seqs.len(),
                    max_q_len: per,
                    dims,
                    mask: rollplex_kernels::cpu::AttnMask::Causal,
                    scale: 0.088,
                    strides,
                },
            )?;
            Ok(())
        })?;
        let flops = 4.0 * (t / per) as f64 * (per * per) as f64 / 2.0 * 128.0 * nh as f64;
        println!(
            "attention_fwd_bf16 {name} causal 4 x 2048 tokens, {nh}/{nkv} heads: {ms:.3} ms = {:.1} TFLOP/s",
            flops / (ms * 1e-3) / 1e12
        );
    }

    let set = StreamSet::new(&g)?;
    let granted = set.granted(48, Priority::High)?;
    let parts = [
        (Priority::High, granted),
        (Priority::Normal, g.sm_count() - granted),
    ];
    println!(
        "partitions: green {}, SMs {:?} {}",
        set.green(),
        parts.map(|(_, n)| n),
        set.warning().unwrap_or("")
    );
    for (i, (prio, sms)) in parts.into_iter().enumerate() {
        let stream = set.partition(sms, prio)?;
        g.prepare_stream(&stream)?;
        run(
            &format!("matmul_bf16 8192^3 on partition {i} ({sms} SMs)"),
            8192,
            8192,
            8192,
            &stream,
            true,
        )?;
    }
    Ok(())
}
