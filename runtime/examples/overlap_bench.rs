//! Decode beside prefill on one GPU: decode steps (batch 64, KV ~2048 per sample) on a decode
//! SM partition while packed prefills (8 x 1024 tokens) run on the side partition, for several
//! splits, against both run one after the other on the whole GPU and against two plain
//! streams with priorities (decode high). All configurations run side by side in one process,
//! round-robin, after a warm-up of each; times are CUDA events, medians of `--reps`.
//!
//! The model has Qwen2.5-VL-3B's text widths (2048 / 16 heads / 2 kv heads / FFN 11008 / vocab
//! 151936, as `gpu_bench.rs`) with `--layers` layers, random weights. Each sample's KV is its own
//! copy of a prefilled prompt of `kv - steps - 1` tokens, so the step's KV length goes from
//! `kv - steps` to `kv - 1`. Decode steps take fixed token ids (no sampling, no host sync between
//! steps); `GpuModel::decode_step` and `GpuModel::prefill` are the model's own calls. Decode and
//! side work are issued from two host threads (one per stream, as an executor would).
//!
//! Usage: overlap_bench [--layers 8] [--batch 64] [--kv 2048] [--steps 64] [--prefills 4]
//!                      [--prompts 8] [--prompt-len 1024] [--reps 5] [--splits 40,48,64,80]

use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use rollplex_kernels::cuda::{CudaStream, Gpu};
use rollplex_runtime::gpu::streams::{Priority, StreamSet};
use rollplex_runtime::gpu::{GpuKvArena, GpuModel, GpuPrompt};
use rollplex_runtime::model::{DecodeSlot, Qwen25VL};

#[path = "common/widths.rs"]
mod widths;

fn arg(args: &[String], name: &str, default: usize) -> Result<usize> {
    match args.iter().position(|a| a == name) {
        Some(i) => args
            .get(i + 1)
            .ok_or_else(|| anyhow!("{name} needs a value"))?
            .parse()
            .with_context(|| name.to_string()),
        None => Ok(default),
    }
}

fn list(args: &[String], name: &str, default: &[u32]) -> Result<Vec<u32>> {
    match args.iter().position(|a| a == name) {
        Some(i) => args
            .get(i + 1)
            .ok_or_else(|| anyhow!("{name} needs a value"))?
            .split(',')
            .map(|v| v.parse().with_context(|| format!("{name}: {v}")))
            .collect(),
        None => Ok(default.to_vec()),
    }
}

struct Bench<'a> {
    gpu: &'a Gpu,
    gm: &'a GpuModel,
    slots: Vec<DecodeSlot>,
    steps: usize,
    prefills: usize,
    prompts: Vec<Vec<u32>>,
}

/// Device milliseconds of one run: (makespan, decode done, side done) from a common start.
#[derive(Clone, Copy)]
struct Times {
    total: f64,
    decode: f64,
    side: f64,
}

impl Bench<'_> {
    fn decode(&self, s: &Arc<CudaStream>, arena: &mut GpuKvArena) -> Result<()> {
        let mut slots = self.slots.clone();
        let b = slots.len() as u32;
        for step in 0..self.steps as u32 {
            let tokens: Vec<u32> = (0..b)
                .map(|i| (i * 7919 + step * 104729) % 150000)
                .collect();
            self.gm
                .decode_step(self.gpu, s, arena, &mut slots, &tokens)?;
        }
        Ok(())
    }

    fn side(&self, s: &Arc<CudaStream>) -> Result<()> {
        let gp: Vec<GpuPrompt<'_>> = self
            .prompts
            .iter()
            .map(|ids| GpuPrompt { ids, media: &[] })
            .collect();
        for _ in 0..self.prefills {
            self.gm.prefill(self.gpu, s, &gp)?;
        }
        Ok(())
    }

    /// Decode on `dec` and side work on `side` (either may be absent), from a common start
    /// event; two host threads when both run on different streams, one stream in order when
    /// they are the same stream (serial).
    fn run(
        &self,
        arena: &mut GpuKvArena,
        dec: Option<&Arc<CudaStream>>,
        side: Option<&Arc<CudaStream>>,
    ) -> Result<Times> {
        let gpu = self.gpu;
        let first = dec.or(side).ok_or_else(|| anyhow!("nothing to run"))?;
        for s in [dec, side].into_iter().flatten() {
            s.synchronize()?;
        }
        let start = gpu.timing_event()?;
        let (de, se) = (gpu.timing_event()?, gpu.timing_event()?);
        start.record(first)?;
        if let Some(s) = side {
            s.wait(&start)?;
        }
        match (dec, side) {
            (Some(d), Some(s)) if Arc::ptr_eq(d, s) => {
                self.decode(d, arena)?;
                de.record(d)?;
                self.side(s)?;
                se.record(s)?;
            }
            (Some(d), Some(s)) => {
                let dec_thread = std::thread::scope(|sc| -> Result<()> {
                    let h = sc.spawn(|| -> Result<()> {
                        self.decode(d, arena)?;
                        de.record(d)?;
                        Ok(())
                    });
                    self.side(s)?;
                    se.record(s)?;
                    h.join()
                        .map_err(|_| anyhow!("the decode thread panicked"))?
                });
                dec_thread?;
            }
            (Some(d), None) => {
                self.decode(d, arena)?;
                de.record(d)?;
                se.record(d)?;
            }
            (None, Some(s)) => {
                self.side(s)?;
                de.record(s)?;
                se.record(s)?;
            }
            (None, None) => bail!("nothing to run"),
        }
        de.synchronize()?;
        se.synchronize()?;
        let (d, s) = (start.elapsed_ms(&de)? as f64, start.elapsed_ms(&se)? as f64);
        Ok(Times {
            total: d.max(s),
            decode: d,
            side: s,
        })
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

struct Config {
    name: String,
    dec: Option<Arc<CudaStream>>,
    side: Option<Arc<CudaStream>>,
    runs: Vec<Times>,
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let layers = arg(&args, "--layers", 8)? as u32;
    let batch = arg(&args, "--batch", 64)?;
    let kv = arg(&args, "--kv", 2048)?;
    let steps = arg(&args, "--steps", 64)?;
    let prefills = arg(&args, "--prefills", 4)?;
    let prompts = arg(&args, "--prompts", 8)?;
    let plen = arg(&args, "--prompt-len", 1024)?;
    let reps = arg(&args, "--reps", 5)?.max(1);
    let splits = list(&args, "--splits", &[40, 48, 64, 80])?;
    if kv <= steps + 2 {
        bail!("--kv {kv} must exceed --steps {steps} + 2");
    }
    let gpu = Gpu::new(0).context("overlap_bench needs a CUDA device")?;
    let set = StreamSet::new(&gpu)?;
    let plain = StreamSet::plain(&gpu)?;
    let total = set.total_sms();
    println!(
        "device {}: {} SMs, green contexts: {} (groups of {}, layout {:?})",
        gpu.name(),
        total,
        set.green(),
        set.granularity(),
        set.layout()
    );
    let whole = set.partition(total, Priority::High)?;
    let t0 = std::time::Instant::now();
    let model = Qwen25VL::random(widths::qwen3b_widths(layers, 1), 7)?;
    let gm = GpuModel::upload(&gpu, &whole, &model)?;
    drop(model);
    // every sample's KV: its own copy of a prefilled prompt of `pre` tokens
    let pre = kv - steps - 1;
    let groups = batch.div_ceil(8);
    let pre_ids: Vec<Vec<u32>> = (0..groups)
        .map(|g| {
            (0..pre)
                .map(|i| ((i * 7919 + g * 104729 + 17) % 150000) as u32)
                .collect()
        })
        .collect();
    let gp: Vec<GpuPrompt<'_>> = pre_ids
        .iter()
        .map(|ids| GpuPrompt { ids, media: &[] })
        .collect();
    let states = gm.prefill(&gpu, &whole, &gp)?;
    let mut arena = GpuKvArena::for_model(&gm, &gpu, &whole, (batch * kv) as u32)?;
    let mut slots = Vec::with_capacity(batch);
    for b in 0..batch {
        let st = &states[b / 8];
        let row = (b * kv) as u32;
        let span = arena.store_prefix(&whole, row, st)?;
        slots.push(DecodeSlot::new(
            span,
            st.rope_delta,
            row + pre as u32,
            (steps + 1) as u32,
        ));
    }
    drop(states);
    whole.synchronize()?;
    println!(
        "model ({layers} layers, {:.2} GB bf16) and KV arena ({:.2} GB, {batch} x {kv} rows) ready in {:.1} s",
        gm.weights.bytes as f64 / 1e9,
        arena.bytes() as f64 / 1e9,
        t0.elapsed().as_secs_f64()
    );
    let bench = Bench {
        gpu: &gpu,
        gm: &gm,
        slots,
        steps,
        prefills,
        prompts: (0..prompts)
            .map(|p| {
                (0..plen)
                    .map(|i| ((i * 7919 + p * 104729) % 150000) as u32)
                    .collect()
            })
            .collect(),
    };

    let mut configs = vec![
        Config {
            name: "decode alone, whole GPU".into(),
            dec: Some(whole.clone()),
            side: None,
            runs: vec![],
        },
        Config {
            name: "prefill alone, whole GPU".into(),
            dec: None,
            side: Some(whole.clone()),
            runs: vec![],
        },
        Config {
            name: "serial, one stream".into(),
            dec: Some(whole.clone()),
            side: Some(whole.clone()),
            runs: vec![],
        },
        Config {
            name: "two plain streams (decode high)".into(),
            dec: Some(plain.partition(total, Priority::High)?),
            side: Some(plain.partition(total, Priority::Normal)?),
            runs: vec![],
        },
    ];
    for &d in &splits {
        let (gd, gs) = (
            set.granted(d, Priority::High)?,
            set.granted(total - d, Priority::Normal)?,
        );
        let (ds, ss) = (
            set.partition(d, Priority::High)?,
            set.partition(total - d, Priority::Normal)?,
        );
        let disjoint = set.layout().disjoint(
            set.layout().place(d, Priority::High)?,
            set.layout().place(total - d, Priority::Normal)?,
        );
        if !disjoint {
            println!("note: split {gd}/{gs} is not disjoint");
        }
        configs.push(Config {
            name: format!("decode alone on {gd} SMs"),
            dec: Some(ds.clone()),
            side: None,
            runs: vec![],
        });
        configs.push(Config {
            name: format!("prefill alone on {gs} SMs"),
            dec: None,
            side: Some(ss.clone()),
            runs: vec![],
        });
        configs.push(Config {
            name: format!("green split {gd}/{gs}"),
            dec: Some(ds),
            side: Some(ss),
            runs: vec![],
        });
    }
    // warm-up: kernels, GEMM plans, per-stream workspaces
    for c in &mut configs {
        bench.run(&mut arena, c.dec.as_ref(), c.side.as_ref())?;
    }
    for _ in 0..reps {
        for c in &mut configs {
            let t = bench.run(&mut arena, c.dec.as_ref(), c.side.as_ref())?;
            c.runs.push(t);
        }
    }

    let t = model_dims(&gm);
    let (h, f, hd, nq, nkv) = t;
    let lin_tok = 2.0 * (h * (nq + 2.0 * nkv) * hd + nq * hd * h + h * 2.0 * f + f * h);
    let tokens = (prompts * plen) as f64;
    let pairs = prompts as f64 * (plen as f64 * (plen as f64 + 1.0) / 2.0);
    let vocab = gm.config.text().vocab_size as f64;
    let prefill_flops = prefills as f64
        * (layers as f64 * (tokens * lin_tok + 4.0 * nq * hd * pairs)
            + prompts as f64 * 2.0 * h * vocab);
    // bytes a decode step reads: layer weights, the lm head, every sample's KV
    let avg_kv = (kv - steps / 2 - 1) as f64;
    let step_bytes = layers as f64 * lin_tok
        + 2.0 * h * vocab
        + batch as f64 * avg_kv * layers as f64 * 2.0 * nkv * hd * 2.0;

    println!(
        "\n{steps} decode steps (batch {batch}, KV {}..{}), {prefills} prefills of {prompts} x {plen} tokens; {layers} layers; medians of {reps} (ms)",
        kv - steps,
        kv - 1
    );
    println!(
        "{:<34} {:>9} {:>10} {:>9} {:>10} {:>12}",
        "configuration", "makespan", "decode", "side", "vs serial", "vs 2 streams"
    );
    let med = |c: &Config, f: fn(&Times) -> f64| median(c.runs.iter().map(f).collect());
    let serial = med(&configs[2], |t| t.total);
    let two = med(&configs[3], |t| t.total);
    for c in &configs {
        let (tot, d, s) = (
            med(c, |t| t.total),
            med(c, |t| t.decode),
            med(c, |t| t.side),
        );
        let (d, s) = match (&c.dec, &c.side) {
            (Some(_), None) => (format!("{d:.2}"), "-".to_string()),
            (None, Some(_)) => ("-".to_string(), format!("{s:.2}")),
            _ => (format!("{d:.2}"), format!("{s:.2}")),
        };
        let both = c.dec.is_some() && c.side.is_some();
        println!(
            "{:<34} {:>9.2} {:>10} {:>9} {:>10} {:>12}",
            c.name,
            tot,
            d,
            s,
            if both {
                format!("{:.3}x", serial / tot)
            } else {
                "-".into()
            },
            if both {
                format!("{:.3}x", two / tot)
            } else {
                "-".into()
            },
        );
    }
    let dec_alone = med(&configs[0], |t| t.decode);
    let pre_alone = med(&configs[1], |t| t.side);
    println!(
        "\nwhole GPU alone: decode step {:.3} ms ({:.2} TB/s on {:.2} GB a step); prefill {:.2} ms a call ({:.1} TFLOP/s)",
        dec_alone / steps as f64,
        step_bytes * steps as f64 / dec_alone / 1e9,
        step_bytes / 1e9,
        pre_alone / prefills as f64,
        prefill_flops / pre_alone / 1e9
    );
    let best = configs
        .iter()
        .skip(4)
        .filter(|c| c.dec.is_some() && c.side.is_some())
        .map(|c| (c.name.clone(), med(c, |t| t.total)))
        .min_by(|a, b| a.1.total_cmp(&b.1));
    if let Some((name, t)) = best {
        println!(
            "best: {name} {t:.2} ms: {:.3}x serial, {:.3}x two plain streams; two plain streams {:.3}x serial",
            serial / t,
            two / t,
            serial / two
        );
    }
    Ok(())
}

/// (hidden, ffn, head dim, q heads, kv heads) as f64.
fn model_dims(gm: &GpuModel) -> (f64, f64, f64, f64, f64) {
    let t = gm.config.text();
    (
        t.hidden_size as f64,
        t.intermediate_size as f64,
        t.head_dim() as f64,
        t.num_heads as f64,
        t.num_kv_heads as f64,
    )
}
