//! Workbench: one decode step of a Qwen2.5-VL text decoder (3B and 7B dims) built from this
//! crate's kernels and cuBLASLt GEMMs, captured in a CUDA graph and replayed; reports the step
//! time, the bytes it must move (weights + KV cache + logits) and the achieved bandwidth against
//! the device-to-device copy ceiling measured in the same run. Also times the attention alone.
//!
//! Run: `cargo run --release -p rollplex-kernels --example bench_decode` (needs a GPU).
//! Each layer has its own weights (random bf16, never zeros) and its own KV cache, so every byte
//! is real HBM traffic. Per step: embedding gather, 36/28 x (rmsnorm, qkv GEMM + bias, rope, KV
//! append, decode attention, o GEMM, residual add, rmsnorm, gate|up GEMM, SwiGLU, down GEMM,
//! residual add), final rmsnorm, lm_head GEMM, sampling (T = 1).

use std::sync::Arc;

use cudarc::driver::sys;
use half::bf16;
use rollplex_kernels::cpu::{AttnDims, DecodeSeq};
use rollplex_kernels::cuda::attention::RowStrides;
use rollplex_kernels::cuda::pointwise::add_fwd_bf16_inplace;
use rollplex_kernels::cuda::*;

type Res<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[derive(Clone, Copy)]
struct Dims {
    name: &'static str,
    h: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
    f: usize,
    layers: usize,
    vocab: usize,
    tied: bool,
}

const D3B: Dims = Dims {
    name: "3B",
    h: 2048,
    nh: 16,
    nkv: 2,
    hd: 128,
    f: 11008,
    layers: 36,
    vocab: 151_936,
    tied: true,
};
const D7B: Dims = Dims {
    name: "7B",
    h: 3584,
    nh: 28,
    nkv: 4,
    hd: 128,
    f: 18944,
    layers: 28,
    vocab: 152_064,
    tied: false,
};

struct Layer {
    wqkv: CudaSlice<bf16>,
    bqkv: CudaSlice<bf16>,
    wo: CudaSlice<bf16>,
    wgu: CudaSlice<bf16>,
    wd: CudaSlice<bf16>,
    n1: CudaSlice<bf16>,
    n2: CudaSlice<bf16>,
    kc: CudaSlice<bf16>,
    vc: CudaSlice<bf16>,
}

struct Model {
    d: Dims,
    batch: usize,
    layers: Vec<Layer>,
    embed: CudaSlice<bf16>,
    lm_head: Option<CudaSlice<bf16>>,
    norm: CudaSlice<bf16>,
    // activations
    h: CudaSlice<bf16>,
    x: CudaSlice<bf16>,
    qkv: CudaSlice<bf16>,
    attn: CudaSlice<bf16>,
    tmp: CudaSlice<bf16>,
    gu: CudaSlice<bf16>,
    act: CudaSlice<bf16>,
    logits: CudaSlice<bf16>,
    tokens: CudaSlice<u32>,
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
    slots: CudaSlice<u32>,
    seqs: CudaSlice<AttnSeqGpu>,
    ws: CudaSlice<f32>,
    sample_ids: CudaSlice<u32>,
    steps: CudaSlice<u32>,
    plan: DecodePlan,
    kv_len: usize,
    /// Fused kernels (add+rmsnorm, rope+KV append) or the separate ones.
    fused: bool,
    /// Distinct KV rows read per layer (shared prefixes counted once).
    kv_rows_read: usize,
}

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

/// A device buffer of `n` elements filled by repeating a random source (fast for GBs).
fn filled(g: &Gpu, s: &Arc<CudaStream>, src: &CudaSlice<bf16>, n: usize) -> Res<CudaSlice<bf16>> {
    let mut d = g.alloc::<bf16>(s, n)?;
    let c = src.len();
    let mut off = 0;
    let mut k = 0usize;
    while off < n {
        let len = c.min(n - off);
        // rotate the source window so consecutive chunks differ
        let start = (k * 7919) % (c - len + 1).max(1);
        s.memcpy_dtod(
            &src.slice(start..start + len),
            &mut d.slice_mut(off..off + len),
        )?;
        off += len;
        k += 1;
    }
    Ok(d)
}

/// `prefix`: (group size, shared prefix length); the rest of `kv_len` is each sample's own.
fn build(
    g: &Gpu,
    s: &Arc<CudaStream>,
    d: Dims,
    batch: usize,
    kv_len: usize,
    prefix: Option<(usize, usize)>,
) -> Res<Model> {
    let src = s.clone_htod(&rand_bf(1 << 25, 7, 0.03))?;
    let big = s.clone_htod(&rand_bf(1 << 22, 9, 1.0))?;
    let qkvw = (d.nh + 2 * d.nkv) * d.hd;
    let kvw = d.nkv * d.hd;
    let (gsize, plen) = prefix.unwrap_or((1, 0));
    let groups = batch.div_ceil(gsize);
    let own = kv_len - plen;
    let rows = groups * plen + batch * own;
    let mut layers = Vec::new();
    for _ in 0..d.layers {
        layers.push(Layer {
            wqkv: filled(g, s, &src, qkvw * d.h)?,
            bqkv: filled(g, s, &src, qkvw)?,
            wo: filled(g, s, &src, d.h * d.nh * d.hd)?,
            wgu: filled(g, s, &src, 2 * d.f * d.h)?,
            wd: filled(g, s, &src, d.h * d.f)?,
            n1: filled(g, s, &big, d.h)?,
            n2: filled(g, s, &big, d.h)?,
            kc: filled(g, s, &big, rows * kvw)?,
            vc: filled(g, s, &big, rows * kvw)?,
        });
    }
    let mut seqs = Vec::new();
    let mut slots = Vec::new();
    for b in 0..batch {
        let own_off = groups * plen + b * own;
        let ds = DecodeSeq {
            prefix_offset: ((b / gsize) * plen) as u32,
            prefix_len: plen as u32,
            suffix_offset: own_off as u32,
            suffix_len: own as u32,
        };
        seqs.push(AttnSeqGpu::from_decode(b as u32, &ds));
        slots.push((own_off + own - 1) as u32); // the current token's row
    }
    let dims = AttnDims {
        num_heads: d.nh,
        num_kv_heads: d.nkv,
        head_dim: d.hd,
    };
    let plan = decode_plan(batch, dims, kv_len);
    let ang: Vec<f32> = (0..batch * d.hd)
        .map(|i| (i as f32 * 0.37).sin() * 3.0)
        .collect();
    Ok(Model {
        d,
        batch,
        embed: filled(g, s, &src, d.vocab * d.h)?,
        lm_head: if d.tied {
            None
        } else {
            Some(filled(g, s, &src, d.vocab * d.h)?)
        },
        norm: filled(g, s, &big, d.h)?,
        h: filled(g, s, &big, batch * d.h)?,
        x: g.alloc(s, batch * d.h)?,
        qkv: g.alloc(s, batch * qkvw)?,
        attn: g.alloc(s, batch * d.nh * d.hd)?,
        tmp: g.alloc(s, batch * d.h)?,
        gu: g.alloc(s, batch * 2 * d.f)?,
        act: g.alloc(s, batch * d.f)?,
        logits: g.alloc(s, batch * d.vocab)?,
        tokens: s.clone_htod(&(0..batch as u32).map(|i| i * 101).collect::<Vec<_>>())?,
        cos: s.clone_htod(&ang.iter().map(|a| a.cos()).collect::<Vec<_>>())?,
        sin: s.clone_htod(&ang.iter().map(|a| a.sin()).collect::<Vec<_>>())?,
        slots: s.clone_htod(&slots)?,
        seqs: s.clone_htod(&seqs)?,
        ws: g.alloc(s, plan.workspace_len())?,
        sample_ids: s.clone_htod(&(0..batch as u32).collect::<Vec<_>>())?,
        steps: s.clone_htod(&vec![5u32; batch])?,
        plan,
        kv_len,
        fused: true,
        kv_rows_read: groups * plen + batch * own,
        layers,
    })
}

impl Model {
    fn dims(&self) -> AttnDims {
        AttnDims {
            num_heads: self.d.nh,
            num_kv_heads: self.d.nkv,
            head_dim: self.d.hd,
        }
    }

    fn attention(&mut self, g: &Gpu, s: &Arc<CudaStream>, l: usize) -> Res<()> {
        let d = self.d;
        let qkvw = (d.nh + 2 * d.nkv) * d.hd;
        let strides = RowStrides {
            q: qkvw,
            kv: d.nkv * d.hd,
            prefix: d.nkv * d.hd,
            out: d.nh * d.hd,
        };
        let dims = self.dims();
        let ly = &self.layers[l];
        attention_decode_bf16(
            g,
            s,
            &mut self.attn,
            None,
            &mut self.ws,
            &self.qkv,
            &ly.kc,
            &ly.vc,
            &self.seqs,
            dims,
            1.0 / (d.hd as f32).sqrt(),
            strides,
            self.plan,
        )?;
        Ok(())
    }

    fn step(&mut self, g: &Gpu, s: &Arc<CudaStream>) -> Res<()> {
        let d = self.d;
        let b = self.batch;
        let qkvw = (d.nh + 2 * d.nkv) * d.hd;
        let kvw = d.nkv * d.hd;
        let eps = 1e-6;
        embedding_fwd_bf16(g, s, &mut self.h, &self.embed, &self.tokens, b, d.h, d.h)?;
        // Fused path: the residual add runs inside the next norm, rope inside the KV append.
        let n1 = &self.layers[0].n1;
        rmsnorm_fwd_bf16(g, s, &mut self.x, None, &self.h, n1, b, d.h, eps)?;
        for l in 0..d.layers {
            let ly = &self.layers[l];
            let bias = Some(&ly.bqkv as &dyn cudarc::driver::DevicePtr<bf16>);
            linear_fwd_bf16(g, s, &mut self.qkv, &self.x, &ly.wqkv, bias, b, d.h, qkvw)?;
            let (cos, sin, slots) = (&self.cos, &self.sin, &self.slots);
            if self.fused {
                let ly = &mut self.layers[l];
                let (kc, vc) = (&mut ly.kc, &mut ly.vc);
                rope_kv_append_bf16(
                    g,
                    s,
                    &mut self.qkv,
                    kc,
                    vc,
                    cos,
                    sin,
                    slots,
                    b,
                    d.nh,
                    d.nkv,
                    d.hd,
                    true,
                )?;
            } else {
                rope_fwd_bf16(
                    g,
                    s,
                    &mut self.qkv,
                    cos,
                    sin,
                    b,
                    qkvw,
                    d.nh + d.nkv,
                    d.hd,
                    true,
                )?;
                let ly = &mut self.layers[l];
                let (ks, vs) = (
                    self.qkv.slice(d.nh * d.hd..),
                    self.qkv.slice((d.nh + d.nkv) * d.hd..),
                );
                kv_append_bf16(g, s, &mut ly.kc, &ks, slots, b, kvw, qkvw, kvw)?;
                kv_append_bf16(g, s, &mut ly.vc, &vs, slots, b, kvw, qkvw, kvw)?;
            }
            self.attention(g, s, l)?;
            let ly = &self.layers[l];
            linear_fwd_bf16(
                g,
                s,
                &mut self.tmp,
                &self.attn,
                &ly.wo,
                None,
                b,
                d.nh * d.hd,
                d.h,
            )?;
            if self.fused {
                add_rmsnorm_fwd_bf16(
                    g,
                    s,
                    &mut self.x,
                    None,
                    &mut self.h,
                    &self.tmp,
                    &ly.n2,
                    b,
                    d.h,
                    eps,
                )?;
            } else {
                add_fwd_bf16_inplace(g, s, &mut self.h, &self.tmp, b * d.h)?;
                rmsnorm_fwd_bf16(g, s, &mut self.x, None, &self.h, &ly.n2, b, d.h, eps)?;
            }
            linear_fwd_bf16(g, s, &mut self.gu, &self.x, &ly.wgu, None, b, d.h, 2 * d.f)?;
            let up = self.gu.slice(d.f..);
            swiglu_fwd_bf16(
                g,
                s,
                &mut self.act,
                &self.gu,
                &up,
                b,
                d.f,
                d.f,
                2 * d.f,
                2 * d.f,
            )?;
            linear_fwd_bf16(g, s, &mut self.tmp, &self.act, &ly.wd, None, b, d.f, d.h)?;
            let next_norm = if l + 1 < d.layers {
                &self.layers[l + 1].n1
            } else {
                &self.norm
            };
            if self.fused {
                add_rmsnorm_fwd_bf16(
                    g,
                    s,
                    &mut self.x,
                    None,
                    &mut self.h,
                    &self.tmp,
                    next_norm,
                    b,
                    d.h,
                    eps,
                )?;
            } else {
                add_fwd_bf16_inplace(g, s, &mut self.h, &self.tmp, b * d.h)?;
                rmsnorm_fwd_bf16(g, s, &mut self.x, None, &self.h, next_norm, b, d.h, eps)?;
            }
        }
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        linear_fwd_bf16(g, s, &mut self.logits, &self.x, head, None, b, d.h, d.vocab)?;
        let p = SampleParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 1,
            iteration: 0,
        };
        let (ids, steps) = (&self.sample_ids, &self.steps);
        sample_bf16(
            g,
            s,
            &mut self.tokens,
            &self.logits,
            ids,
            steps,
            b,
            d.vocab,
            d.vocab,
            &p,
        )?;
        Ok(())
    }

    /// Only the step's GEMMs (same shapes, same buffers), to split the step time.
    fn gemms(&mut self, g: &Gpu, s: &Arc<CudaStream>) -> Res<()> {
        let d = self.d;
        let b = self.batch;
        let qkvw = (d.nh + 2 * d.nkv) * d.hd;
        for ly in &self.layers {
            let bias = Some(&ly.bqkv as &dyn cudarc::driver::DevicePtr<bf16>);
            linear_fwd_bf16(g, s, &mut self.qkv, &self.x, &ly.wqkv, bias, b, d.h, qkvw)?;
            linear_fwd_bf16(
                g,
                s,
                &mut self.tmp,
                &self.attn,
                &ly.wo,
                None,
                b,
                d.nh * d.hd,
                d.h,
            )?;
            linear_fwd_bf16(g, s, &mut self.gu, &self.x, &ly.wgu, None, b, d.h, 2 * d.f)?;
            linear_fwd_bf16(g, s, &mut self.tmp, &self.act, &ly.wd, None, b, d.f, d.h)?;
        }
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        linear_fwd_bf16(g, s, &mut self.logits, &self.x, head, None, b, d.h, d.vocab)?;
        Ok(())
    }

    /// (weight bytes, KV bytes, logits bytes) one step must move.
    fn bytes(&self) -> (f64, f64, f64) {
        let d = self.d;
        let qkvw = (d.nh + 2 * d.nkv) * d.hd;
        let per_layer = qkvw * d.h + qkvw + d.h * d.nh * d.hd + 3 * d.f * d.h + 2 * d.h;
        let w = (d.layers * per_layer + d.h + d.vocab * d.h + self.batch * d.h) as f64 * 2.0;
        let kv = (d.layers * (self.kv_rows_read + self.batch) * 2 * d.nkv * d.hd) as f64 * 2.0;
        let logits = (2 * self.batch * d.vocab) as f64 * 2.0;
        (w, kv, logits)
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Median ms of `reps` replays of `graph` (events around each), after 3 warm-up replays.
fn time_graph(
    g: &Gpu,
    s: &Arc<CudaStream>,
    graph: &cudarc::driver::CudaGraph,
    reps: usize,
) -> Res<f64> {
    for _ in 0..3 {
        graph.launch()?;
    }
    s.synchronize()?;
    let mut ts = Vec::new();
    for _ in 0..reps {
        let (a, b) = (g.timing_event()?, g.timing_event()?);
        a.record(s)?;
        graph.launch()?;
        b.record(s)?;
        b.synchronize()?;
        ts.push(a.elapsed_ms(&b)? as f64);
    }
    Ok(median(ts))
}

fn capture(s: &Arc<CudaStream>, f: impl FnOnce() -> Res<()>) -> Res<cudarc::driver::CudaGraph> {
    s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let r = f();
    let graph = s.end_capture(sys::CUgraphInstantiate_flags(0))?;
    r?;
    graph.ok_or_else(|| "stream capture produced no graph".into())
}

fn copy_ceiling(g: &Gpu, s: &Arc<CudaStream>) -> Res<f64> {
    let n = 1usize << 30;
    let src = s.clone_htod(&rand_bf(1 << 24, 1, 1.0))?;
    let a = filled(g, s, &src, n)?;
    let mut b = g.alloc::<bf16>(s, n)?;
    for _ in 0..3 {
        s.memcpy_dtod(&a, &mut b)?;
    }
    let mut ts = Vec::new();
    for _ in 0..10 {
        let (e0, e1) = (g.timing_event()?, g.timing_event()?);
        e0.record(s)?;
        s.memcpy_dtod(&a, &mut b)?;
        e1.record(s)?;
        e1.synchronize()?;
        ts.push(e0.elapsed_ms(&e1)? as f64);
    }
    Ok(2.0 * (n * 2) as f64 / (median(ts) * 1e-3) / 1e12)
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    for a in &args {
        if !["--unfused", "--simt"].contains(&a.as_str()) {
            return Err(format!("unknown flag {a}; flags: --unfused (separate add/norm and rope/append kernels), --simt (the SIMT decode attention instead of the tensor-core one)").into());
        }
    }
    let unfused = args.iter().any(|a| a == "--unfused");
    let tensor_cores = !args.iter().any(|a| a == "--simt");
    println!(
        "variant: {} kernels, {} decode attention",
        if unfused { "unfused" } else { "fused" },
        if tensor_cores { "tensor-core" } else { "SIMT" }
    );
    let g = Gpu::new(0)?;
    let s = g.stream(0)?;
    g.prepare_stream(&s)?;
    let ceiling = copy_ceiling(&g, &s)?;
    println!(
        "device: {} ({} SMs); device copy ceiling {ceiling:.2} TB/s (read + write, 2 GiB)",
        g.name(),
        g.sm_count()
    );
    let mut rows = Vec::new();
    // (dims, batch, (group size, shared prefix length))
    type Case = (Dims, usize, Option<(usize, usize)>);
    let configs: [Case; 5] = [
        (D3B, 64, None),
        (D3B, 8, None),
        (D7B, 64, None),
        (D7B, 8, None),
        (D3B, 64, Some((8, 1792))),
    ];
    for (d, batch, prefix) in configs {
        let kv_len = 2048;
        let mut m = build(&g, &s, d, batch, kv_len, prefix)?;
        m.fused = !unfused;
        m.plan.tensor_cores = tensor_cores;
        s.synchronize()?;
        // eager once (also checks every launch), then the graph
        m.step(&g, &s)?;
        s.synchronize()?;
        let t_eager = {
            let (a, b) = (g.timing_event()?, g.timing_event()?);
            a.record(&s)?;
            m.step(&g, &s)?;
            b.record(&s)?;
            b.synchronize()?;
            a.elapsed_ms(&b)? as f64
        };
        let graph = capture(&s, || m.step(&g, &s))?;
        let t = time_graph(&g, &s, &graph, 20)?;
        drop(graph);
        let att_graph = capture(&s, || {
            for l in 0..d.layers {
                m.attention(&g, &s, l)?;
            }
            Ok(())
        })?;
        let t_att = time_graph(&g, &s, &att_graph, 20)?;
        drop(att_graph);
        let (w, kv, lg) = m.bytes();
        let gemm_graph = capture(&s, || m.gemms(&g, &s))?;
        let t_gemm = time_graph(&g, &s, &gemm_graph, 20)?;
        drop(gemm_graph);
        let split_line = format!(
            "    split: GEMMs {t_gemm:.3} ms ({:.2} TB/s on {:.2} GB of weights), attention {t_att:.3} ms, the rest {:.3} ms",
            w / (t_gemm * 1e-3) / 1e12,
            w / 1e9,
            t - t_gemm - t_att
        );
        // Attention alone under other splits (the default aims at DECODE_TARGET_BLOCKS = 264).
        let mut sweep = Vec::new();
        let default_plan = m.plan;
        for target in [528usize, 1056, 2112] {
            m.plan = DecodePlan {
                tensor_cores,
                ..decode_plan_for_blocks(batch, m.dims(), kv_len, target)
            };
            if m.plan.workspace_len() > m.ws.len() {
                m.ws = g.alloc(&s, m.plan.workspace_len())?;
            }
            let gr = capture(&s, || {
                for l in 0..d.layers {
                    m.attention(&g, &s, l)?;
                }
                Ok(())
            })?;
            let ta = time_graph(&g, &s, &gr, 20)?;
            sweep.push(format!(
                "{target} blocks ({}x{}): {ta:.3} ms {:.2} TB/s",
                m.plan.splits,
                m.plan.chunk,
                kv / (ta * 1e-3) / 1e12
            ));
        }
        m.plan = default_plan;
        let total = w + kv + lg;
        let bw = total / (t * 1e-3) / 1e12;
        let att_bw = kv / (t_att * 1e-3) / 1e12;
        let tok = s.clone_dtoh(&m.tokens)?;
        let pre = match prefix {
            Some((gs, pl)) => format!("G{gs} prefix {pl}"),
            None => "no sharing".to_string(),
        };
        let line = format!(
            "{} B={batch} KV={} ({pre}) splits {}x{}: step {t:.3} ms (eager {t_eager:.3}), moved {:.2} GB (w {:.2} + kv {:.2} + logits {:.3}) = {bw:.2} TB/s = {:.0}% of copy; attention {t_att:.3} ms for {:.2} GB = {att_bw:.2} TB/s ({:.0}%); tokens[0..4] {:?}",
            d.name,
            m.kv_len,
            m.plan.splits,
            m.plan.chunk,
            total / 1e9,
            w / 1e9,
            kv / 1e9,
            lg / 1e9,
            100.0 * bw / ceiling,
            kv / 1e9,
            100.0 * att_bw / ceiling,
            &tok[..4.min(tok.len())]
        );
        println!("{line}");
        println!("    attention sweep: {}", sweep.join("; "));
        println!("{split_line}");
        rows.push(line);
        drop(m);
        s.synchronize()?;
    }
    println!("\nsummary (copy ceiling {ceiling:.2} TB/s):");
    for r in rows {
        println!("  {r}");
    }
    Ok(())
}
