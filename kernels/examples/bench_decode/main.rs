//! Workbench: one decode step of a Qwen2.5-VL text decoder (3B and 7B dims) built from this
//! crate's kernels, captured in a CUDA graph and replayed; reports the step time, the bytes it
//! moves (weights + KV cache + logits) and the achieved bandwidth against the device-to-device
//! copy ceiling measured in the same run. Each case runs these variants side by side:
//! - `base`: cuBLASLt GEMMs + `swiglu_fwd_bf16`, the warp-split decode attention aiming at 264
//!   blocks (the step as of 3ab030b);
//! - `gemm`: the dispatching GEMM entry points (`linear_fwd_bf16`, `gate_up_swiglu_bf16`: our
//!   split-k tensor-core kernel where `skinny_pays` (every GEMM at m <= 16, gate|up, down and
//!   the lm head at m <= 64; gate|up fused with SwiGLU), cuBLASLt elsewhere), the same attention;
//! - `new`: those GEMMs and `attention_decode_bf16` with `decode_plan` (the block-pipelined
//!   kernel), every sample reading its own KV;
//! - `shared` (GRPO cases): `attention_decode_grouped_bf16` with `grouped_decode_plan`, which
//!   reads a group's shared prefix once per group when there are enough groups; `forced`: the
//!   group pass forced on (where the default plan leaves it off); `sepqkv`: `shared` with the
//!   q|k|v GEMM and `rope_kv_append_bf16` as two launches.
//!
//! The dispatching variants make q|k|v, rope and the KV append with `qkv_rope_append_bf16` (one
//! skinny launch where it fuses them, as the runtime does); each case also times that work
//! alone over all layers in its three forms (cuBLASLt's or the skinny GEMM followed by
//! `rope_kv_append_bf16`, and the fused launch).
//!
//! Bytes are counted two ways: what a per-sample reader moves (every sample reads its whole KV,
//! as PyTorch's SDPA decode does) and what the variant moves (a GRPO group's shared prefix once
//! per group when the group pass runs). Also times the GEMMs alone, each GEMM kind alone
//! (cuBLASLt vs the skinny kernel) and the attention alone.
//!
//! `--gemm-sweep`: instead of the cases, each GEMM kind of the 3B and 7B steps alone over all
//! layers at m = 128, 64, 32 and 16 rows (`--gemm-rows` picks others): cuBLASLt (each answer of
//! its heuristic), the skinny kernel's default plan and the other cuts of its `wgmma` form (row
//! tiles, one or two consumer warpgroups, k slices, stages; and, at m <= 32, its `mma.sync`
//! form) side by side, with the weight-streaming rate against the copy ceiling and the 8
//! fastest of each kind.
//!
//! `--attn-sweep`: instead of the step, the group-shared attention alone over all layers of the
//! chosen cases (`--cases`) under each pair of block targets for its two passes and, per pass,
//! each chunk of 128-512 keys (`--attn-lens P,O`: a prefix of P keys and O own keys a sample).
//!
//! `--sms N`: every graph on a high-priority green partition of about N SMs (what an overlap
//! plan's decode window gets beside its side work; the copy ceiling stays the whole GPU's).
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
use rollplex_kernels::cuda::attention::{
    attention_decode_grouped_bf16, group_pass_units, grouped_decode_plan,
    grouped_decode_plan_for_blocks, grouped_decode_plan_for_targets, DecodeInputs,
    GroupedDecodePlan, RowStrides,
};
use rollplex_kernels::cuda::gemm::{
    gate_up_swiglu_bf16, linear_fwd_bf16_cublaslt, linear_fwd_bf16_cublaslt_ranked, qkv_rope_fuses,
    skinny_gate_up_swiglu_bf16, skinny_linear_fwd_bf16_with, skinny_pays, skinny_plan,
    skinny_plan_with, skinny_qkv_rope_bf16, skinny_qkv_rope_plan, SkinnyPlan, LT_RANKS,
    SKINNY_SYNC_MAX_M,
};
use rollplex_kernels::cuda::green::Priority;
use rollplex_kernels::cuda::pointwise::add_fwd_bf16_inplace;
use rollplex_kernels::cuda::*;

type Res<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// A case of the workbench: (dims, batch, (group size, shared prefix length)).
type Case = (Dims, usize, Option<(usize, usize)>);

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

mod attn_sweep;
mod gemm_sweep;
mod model;

use attn_sweep::attn_sweep;
use gemm_sweep::{gemm_sweep, GemmBy};
use model::*;

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

struct Timed {
    step: f64,
    /// The same graph captured without programmatic dependent launch.
    step_no_pdl: f64,
    eager: f64,
    gemms: f64,
    attn: f64,
    bytes: (f64, f64, f64, f64),
    tokens: Vec<u32>,
    /// The draw alone: rows split over blocks / one block a row, and whether they drew the
    /// same tokens.
    sampler: (f64, f64, bool),
}

/// Builds the step graph of the model's current variant and times it (also the GEMMs alone and
/// the attention alone, each as its own graph).
fn time_variant(g: &Gpu, s: &Arc<CudaStream>, m: &mut Model) -> Res<Timed> {
    // eager once (also checks every launch), then the graph
    m.step(g, s)?;
    s.synchronize()?;
    // eager: the same launches, one step at a time from an idle device (as the runtime's
    // decode loop issues a step after the previous step's tokens came back); median of 10
    let eager = {
        let mut ts = Vec::new();
        for _ in 0..10 {
            let (a, b) = (g.timing_event()?, g.timing_event()?);
            s.synchronize()?;
            a.record(s)?;
            m.step(g, s)?;
            b.record(s)?;
            b.synchronize()?;
            ts.push(a.elapsed_ms(&b)? as f64);
        }
        median(ts)
    };
    let graph = capture(s, || m.step(g, s))?;
    let step = time_graph(g, s, &graph, 20)?;
    drop(graph);
    let pdl = g.pdl();
    g.set_pdl(false);
    let graph = capture(s, || m.step(g, s));
    g.set_pdl(pdl);
    let graph = graph?;
    let step_no_pdl = time_graph(g, s, &graph, 20)?;
    drop(graph);
    let tokens = s.clone_dtoh(&m.tokens)?;
    let attn = m.attention_ms(g, s)?;
    let gemm_graph = capture(s, || m.gemms(g, s))?;
    let gemms = time_graph(g, s, &gemm_graph, 20)?;
    drop(gemm_graph);
    let draw = |m: &mut Model| -> Res<(f64, Vec<u32>)> {
        let gr = capture(s, || m.sample(g, s))?;
        let t = time_graph(g, s, &gr, 20)?;
        Ok((t, s.clone_dtoh(&m.tokens)?))
    };
    let (split_t, split_tok) = draw(m)?;
    let scratch = m.sample_scratch.take();
    let one = draw(m);
    m.sample_scratch = scratch;
    let (row_t, row_tok) = one?;
    Ok(Timed {
        step,
        step_no_pdl,
        eager,
        gemms,
        attn,
        bytes: m.bytes(),
        tokens: tokens[..4.min(tokens.len())].to_vec(),
        sampler: (split_t, row_t, split_tok == row_tok),
    })
}

fn main() -> Res<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    // --cases 4,8,9: only those rows of the case table below (0-based)
    let mut cases: Option<Vec<usize>> = None;
    if let Some(i) = args.iter().position(|a| a == "--cases") {
        let list = args
            .get(i + 1)
            .ok_or("--cases needs a list such as 4,8,9")?;
        cases = Some(
            list.split(',')
                .map(|x| x.trim().parse::<usize>())
                .collect::<std::result::Result<_, _>>()
                .map_err(|e| format!("--cases {list}: {e}"))?,
        );
        args.drain(i..i + 2);
    }
    // --variants shared,new: only those variants of each case
    let mut only: Option<Vec<String>> = None;
    if let Some(i) = args.iter().position(|a| a == "--variants") {
        let list = args
            .get(i + 1)
            .ok_or("--variants needs a list such as shared,new")?;
        only = Some(list.split(',').map(|v| v.trim().to_string()).collect());
        args.drain(i..i + 2);
    }
    // --gemm-rows 16,32: the rows the GEMM sweep takes (default 128,64,32,16)
    let mut sweep_rows = vec![128, 64, 32, 16];
    if let Some(i) = args.iter().position(|a| a == "--gemm-rows") {
        let list = args
            .get(i + 1)
            .ok_or("--gemm-rows needs a list such as 16,32")?;
        sweep_rows = list
            .split(',')
            .map(|x| x.trim().parse::<usize>())
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| format!("--gemm-rows {list}: {e}"))?;
        args.drain(i..i + 2);
    }
    // --attn-lens 1226,384: the attention sweep's shared prefix and own keys per sample
    // (default 1792,256: the case table's KV of 2048)
    let mut attn_lens: Option<(usize, usize)> = None;
    if let Some(i) = args.iter().position(|a| a == "--attn-lens") {
        let list = args
            .get(i + 1)
            .ok_or("--attn-lens needs PREFIX,OWN such as 1226,384")?;
        let v: Vec<usize> = list
            .split(',')
            .map(|x| x.trim().parse::<usize>())
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| format!("--attn-lens {list}: {e}"))?;
        match v[..] {
            [p, o] if p > 0 && o > 0 => attn_lens = Some((p, o)),
            _ => {
                return Err(format!("--attn-lens {list}: two positive lengths, PREFIX,OWN").into())
            }
        }
        args.drain(i..i + 2);
    }
    // --sms 64: every step and part on a high-priority green partition of (about) that many
    // SMs, as a decode window of an overlap plan gives decode (the copy ceiling stays the whole
    // GPU's)
    let mut sms: Option<u32> = None;
    if let Some(i) = args.iter().position(|a| a == "--sms") {
        let n = args.get(i + 1).ok_or("--sms needs a count such as 64")?;
        sms = Some(n.parse().map_err(|e| format!("--sms {n}: {e}"))?);
        args.drain(i..i + 2);
    }
    for a in &args {
        if ![
            "--unfused",
            "--simt",
            "--no-sweep",
            "--gemm-sweep",
            "--attn-sweep",
        ]
        .contains(&a.as_str())
        {
            return Err(format!("unknown flag {a}; flags: --unfused (separate add/norm and rope/append kernels), --simt (the SIMT decode attention instead of the warp-split one in the base and gemm variants), --no-sweep (skip the GEMM comparison), --gemm-sweep (only the GEMM kinds at m = 128..16, every skinny cut), --gemm-rows M,N (the sweep's rows), --attn-lens P,O (the attention sweep's prefix and own keys), --variants V,W (base, gemm, new, shared, forced), --sms N (on a partition of N SMs), --cases I,J (rows of the case table: 0-3 3B/7B at B 64/8 unshared, 4-7 the same with G8 prefixes of 1792, 8-9 3B B 32/128 with G8 prefixes)").into());
        }
    }
    let unfused = args.iter().any(|a| a == "--unfused");
    let tensor_cores = !args.iter().any(|a| a == "--simt");
    let sweep = !args.iter().any(|a| a == "--no-sweep");
    println!(
        "variant flags: {} kernels, base uses the {} decode attention",
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
    // the set stays alive while its partition's stream is in use
    let mut set = None;
    let s = match sms {
        Some(n) => {
            let set = set.insert(StreamSet::new(&g)?);
            let p = set.partition(n, Priority::High)?;
            g.prepare_stream(&p)?;
            println!(
                "on a partition of {} SMs ({n} asked; green contexts: {})",
                set.granted(n, Priority::High)?,
                set.green()
            );
            p
        }
        None => s,
    };
    if args.iter().any(|a| a == "--gemm-sweep") {
        return gemm_sweep(&g, &s, ceiling, &sweep_rows);
    }
    let mut rows = Vec::new();
    let configs: [Case; 10] = [
        (D3B, 64, None),
        (D3B, 8, None),
        (D7B, 64, None),
        (D7B, 8, None),
        (D3B, 64, Some((8, 1792))),
        (D3B, 8, Some((8, 1792))),
        (D7B, 64, Some((8, 1792))),
        (D7B, 8, Some((8, 1792))),
        (D3B, 32, Some((8, 1792))),
        (D3B, 128, Some((8, 1792))),
    ];
    if args.iter().any(|a| a == "--attn-sweep") {
        let picked: Vec<Case> = configs
            .into_iter()
            .enumerate()
            .filter(|(ci, _)| cases.as_ref().is_none_or(|c| c.contains(ci)))
            .map(|(_, c)| c)
            .collect();
        return attn_sweep(&g, &s, ceiling, &picked, attn_lens.unwrap_or((1792, 256)));
    }
    for (ci, (d, batch, prefix)) in configs.into_iter().enumerate() {
        if cases.as_ref().is_some_and(|c| !c.contains(&ci)) {
            continue;
        }
        let kv_len = 2048;
        let mut m = build(&g, &s, d, batch, kv_len, prefix)?;
        m.fused = !unfused;
        m.plan.tensor_cores = tensor_cores;
        s.synchronize()?;
        let pre = match prefix {
            Some((gs, pl)) => format!("G{gs} prefix {pl}"),
            None => "no sharing".to_string(),
        };
        println!("== {} B={batch} KV={kv_len} ({pre})", d.name);
        // Each GEMM kind alone over all layers: cuBLASLt and the skinny kernel's default plan
        // (no-sharing cases: the GEMMs do not depend on the sharing).
        if sweep && ci < 4 {
            for kind in 0..5 {
                let (k, n, wb) = m.gemm_shape(kind);
                let mut line = Vec::new();
                let p = skinny_plan(batch, k, n);
                for (name, how) in [("cublasLt", GemmBy::Lt(0)), ("skinny", GemmBy::Skinny(p))] {
                    let gr = capture(&s, || m.gemm_kind(&g, &s, kind, how))?;
                    let t = time_graph(&g, &s, &gr, 20)?;
                    drop(gr);
                    line.push(format!(
                        "{name} {:.1} us ({:.2} TB/s)",
                        t * 1e3 / if kind == 4 { 1.0 } else { d.layers as f64 },
                        wb / (t * 1e-3) / 1e12
                    ));
                }
                let kname = ["qkv", "o", "gate_up(+swiglu)", "down", "lm_head"][kind];
                let used = if skinny_pays(&g, batch, k, n) {
                    "skinny"
                } else {
                    "cublasLt"
                };
                println!(
                    "  gemm {kname} m{batch} k{k} n{n}: {} [skinny plan {}x{}; dispatch takes {used}]",
                    line.join("; "),
                    p.splits,
                    p.kslice
                );
            }
        }
        // q|k|v + rope + KV append alone over all layers, each form (this case's batch)
        {
            let mut line = Vec::new();
            let n = (d.nh + 2 * d.nkv) * d.hd;
            let fuses = qkv_rope_fuses(&g, batch, d.h, n, d.hd);
            // the fused launch wherever it can run, also above the rows the dispatch fuses
            let can_fuse = skinny_qkv_rope_plan(batch, d.h, n, d.hd).is_some()
                && (batch <= SKINNY_SYNC_MAX_M || g.has_wgmma());
            for how in [QkvBy::Lt, QkvBy::Skinny, QkvBy::Fused] {
                if matches!(how, QkvBy::Fused) && !can_fuse {
                    continue;
                }
                let gr = capture(&s, || {
                    (0..d.layers).try_for_each(|l| m.qkv_rope_by(&g, &s, l, how))
                })?;
                let t = time_graph(&g, &s, &gr, 20)?;
                drop(gr);
                line.push(format!("{how:?} {:.2} us", t * 1e3 / d.layers as f64));
            }
            println!(
                "  q|k|v + rope + KV append a layer (m{batch} k{} n{n}): {} [dispatch {}]",
                d.h,
                line.join(", "),
                if fuses {
                    "fuses"
                } else {
                    "GEMM then rope_kv_append_bf16"
                }
            );
        }
        let (gsize, plen) = m.prefix;
        let old_plan = m.plan;
        let new_plan = decode_plan(batch, m.dims(), kv_len);
        let forced =
            grouped_decode_plan_for_blocks(batch, gsize, m.dims(), plen, kv_len - plen, 264);
        let default_gplan = m.gplan;
        // (name, dispatching GEMMs, per-sample plan, grouped plan, q|k|v with rope fused)
        type Variant<'a> = (&'a str, bool, DecodePlan, Option<GroupedDecodePlan>, bool);
        let mut variants: Vec<Variant> = vec![
            ("base", false, old_plan, None, false),
            ("gemm", true, old_plan, None, true),
            ("new", true, new_plan, None, true),
        ];
        if prefix.is_some() {
            variants.push(("shared", true, new_plan, Some(default_gplan), true));
            variants.push(("sepqkv", true, new_plan, Some(default_gplan), false));
            if forced != default_gplan {
                variants.push(("forced", true, new_plan, Some(forced), true));
            }
        }
        if let Some(keep) = &only {
            variants.retain(|v| keep.iter().any(|k| k == v.0));
        }
        let mut res = Vec::new();
        for (vname, dispatch, plan, gplan, qkv_rope) in variants {
            m.dispatch = dispatch;
            m.qkv_rope = qkv_rope;
            m.plan = plan;
            m.grouped = gplan.is_some();
            m.gplan = gplan.unwrap_or(default_gplan);
            let t = time_variant(&g, &s, &mut m)?;
            let (w, kv_ps, kv_mv, lg) = t.bytes;
            let moved = w + kv_mv + lg;
            let per_sample = w + kv_ps + lg;
            let attn_plan = match gplan {
                Some(gp) => format!(
                    "grouped: group pass {}x{} (G{}, {} per block), per-sample pass {}x{}",
                    gp.p_splits, gp.p_chunk, gp.group, gp.per_block, gp.s_splits, gp.s_chunk
                ),
                None => format!(
                    "{} {}x{}",
                    if !plan.tensor_cores {
                        "SIMT"
                    } else if plan.pipelined {
                        "pipelined"
                    } else {
                        "warp-split"
                    },
                    plan.splits,
                    plan.chunk
                ),
            };
            println!(
                "  {vname:7} step {:.3} ms (without PDL {:.3}, eager {:.3}); GEMMs alone {:.3} ms ({:.2} TB/s on {:.2} GB), attention alone {:.3} ms ({:.2} TB/s on {:.2} GB moved; {attn_plan}), rest {:.3} ms (the draw alone {:.3} ms, one block a row {:.3} ms, tokens {}); bytes per-sample reader {:.2} GB -> {:.2} TB/s ({:.0}% of copy), moved {:.2} GB -> {:.2} TB/s ({:.0}%); tokens {:?}",
                t.step,
                t.step_no_pdl,
                t.eager,
                t.gemms,
                w / (t.gemms * 1e-3) / 1e12,
                w / 1e9,
                t.attn,
                kv_mv / (t.attn * 1e-3) / 1e12,
                kv_mv / 1e9,
                t.step - t.gemms - t.attn,
                t.sampler.0,
                t.sampler.1,
                if t.sampler.2 { "equal" } else { "DIFFER" },
                per_sample / 1e9,
                per_sample / (t.step * 1e-3) / 1e12,
                100.0 * per_sample / (t.step * 1e-3) / 1e12 / ceiling,
                moved / 1e9,
                moved / (t.step * 1e-3) / 1e12,
                100.0 * moved / (t.step * 1e-3) / 1e12 / ceiling,
                t.tokens
            );
            res.push((vname, t.step, per_sample, moved));
        }
        let Some(&(_, base, _, _)) = res.first() else {
            continue;
        };
        let line = format!(
            "{} B={batch} ({pre}): {}",
            d.name,
            res.iter()
                .map(|(v, t, ps, mv)| format!(
                    "{v} {t:.3} ms ({:.2}x base; per-sample {:.0}%, moved {:.0}% of copy)",
                    base / t,
                    100.0 * ps / (t * 1e-3) / 1e12 / ceiling,
                    100.0 * mv / (t * 1e-3) / 1e12 / ceiling
                ))
                .collect::<Vec<_>>()
                .join("; ")
        );
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
