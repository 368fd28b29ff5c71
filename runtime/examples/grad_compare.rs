//! Compares our training gradients with PyTorch autograd of transformers' Qwen2.5-VL
//! (`tests/reference/grad_compare.py` writes the cases).
//!
//! For every case directory under the root given on the command line: loads `model/` with our
//! checkpoint loader, builds the GRPO group of `grad_inputs.safetensors` (prompt with media, G
//! responses, old/ref log-probs, advantages, mask), runs `train::forward_backward` with both
//! activation policies (they must agree bitwise), and compares with `grad_ref.safetensors`:
//! per-token log-probs, the loss, and the gradient of every parameter tensor (relative L2 error
//! `‖ours - torch‖ / ‖torch‖`, and the max abs error). Prints one line per tensor, a summary per
//! case, writes `grad_results.json` in the root, and exits 1 if any tensor's relative error is
//! above `--tol` (default 1e-3) or the policies differ.
//!
//! `--backend cuda` runs our CUDA trainer instead (`gpu::train::GpuTrainer`: bf16 weights and
//! activations, fp32 gradient sums; the whole actor trained: text decoder, merger and vision
//! tower, every tensor compared) against the cases of `grad_compare.py --dtype bfloat16`
//! (PyTorch autograd of the model cast to bf16).
//! The bound is PyTorch's own bf16 error: where the case has `grad_ref_f32.safetensors` (the
//! same model in float32), a tensor passes when `‖ours - torch_f32‖ / ‖torch_f32‖ <=
//! max(--bf16-factor (3) x ‖torch_bf16 - torch_f32‖ / ‖torch_f32‖, --tol)`, i.e. our bf16
//! gradient is at most 3x as far from the f32 gradient as PyTorch's bf16 gradient is (or within
//! `--tol`, default 1e-2 for cuda); the log-probs are judged the same way. Without the f32 file
//! the bound is `‖ours - torch_bf16‖ / ‖torch_bf16‖ <= --tol`.
//!
//! Usage: cargo run -p rollplex-runtime --example grad_compare -- ROOT [--tol 1e-3] [--quiet]
//!        [--backend cpu|cuda] [--bf16-factor 3]

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{anyhow, bail, Context, Result};
use rollplex_kernels::cuda::Gpu;
use rollplex_plan::spec::{AdamWSpec, KlEstimator, LossAgg, LrSchedule};
use rollplex_runtime::gpu::train::{GpuGroupBatch, GpuTrainer, PromptMedia};
use rollplex_runtime::model::{MediaInput, MediaKind, Qwen25VL};
use rollplex_runtime::train::{
    forward_backward, GroupBatch, LossConfig, Normaliser, ResponseBatch, TrainConfig,
};
use safetensors::tensor::{Dtype, SafeTensors};

struct Tensors {
    bytes: Vec<u8>,
}

impl Tensors {
    fn load(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        SafeTensors::deserialize(&bytes).with_context(|| format!("parsing {}", path.display()))?;
        Ok(Tensors { bytes })
    }
    fn st(&self) -> SafeTensors<'_> {
        SafeTensors::deserialize(&self.bytes).expect("checked at load")
    }
    fn names(&self) -> Vec<String> {
        self.st()
            .names()
            .into_iter()
            .map(|s| s.to_string())
            .collect()
    }
    fn f32s(&self, name: &str) -> Result<Option<Vec<f32>>> {
        let st = self.st();
        let Ok(v) = st.tensor(name) else {
            return Ok(None);
        };
        if v.dtype() != Dtype::F32 {
            bail!("{name}: expected f32, found {:?}", v.dtype());
        }
        Ok(Some(
            v.data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        ))
    }
    fn f64s(&self, name: &str) -> Result<Option<Vec<f64>>> {
        let st = self.st();
        let Ok(v) = st.tensor(name) else {
            return Ok(None);
        };
        if v.dtype() != Dtype::F64 {
            bail!("{name}: expected f64, found {:?}", v.dtype());
        }
        Ok(Some(
            v.data()
                .chunks_exact(8)
                .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
                .collect(),
        ))
    }
    fn i64s(&self, name: &str) -> Result<Option<Vec<i64>>> {
        let st = self.st();
        let Ok(v) = st.tensor(name) else {
            return Ok(None);
        };
        if v.dtype() != Dtype::I64 {
            bail!("{name}: expected i64, found {:?}", v.dtype());
        }
        Ok(Some(
            v.data()
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
                .collect(),
        ))
    }
    fn need_f32(&self, name: &str) -> Result<Vec<f32>> {
        self.f32s(name)?
            .ok_or_else(|| anyhow!("missing tensor {name}"))
    }
    fn need_i64(&self, name: &str) -> Result<Vec<i64>> {
        self.i64s(name)?
            .ok_or_else(|| anyhow!("missing tensor {name}"))
    }
}

fn grids_of(v: Option<Vec<i64>>) -> Vec<[u32; 3]> {
    v.map(|g| {
        g.chunks_exact(3)
            .map(|c| [c[0] as u32, c[1] as u32, c[2] as u32])
            .collect()
    })
    .unwrap_or_default()
}

/// `‖a - b‖ / ‖b‖` and `max |a - b|`.
fn errors(a: &[f32], b: &[f32]) -> (f64, f64) {
    let (mut num, mut den, mut max) = (0f64, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        let d = (*x as f64 - *y as f64).abs();
        num += d * d;
        den += (*y as f64).powi(2);
        max = max.max(d);
    }
    ((num / den.max(f64::MIN_POSITIVE)).sqrt(), max)
}

/// Which trainer computes our gradients.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Backend {
    Cpu,
    Cuda,
}

/// What a case is judged by (see the module doc).
#[derive(Clone, Copy)]
struct Bound {
    tol: f64,
    bf16_factor: f64,
}

/// One compared tensor: name, rel L2 vs the reference, max abs, ‖torch‖, and with an f32
/// reference: ours vs f32, torch bf16 vs f32, and the bound applied.
struct TensorErr {
    name: String,
    rel: f64,
    max: f64,
    norm: f64,
    f32: Option<(f64, f64)>,
    bound: f64,
}

impl TensorErr {
    /// The error the bound judges: vs f32 where there is an f32 reference.
    fn judged(&self) -> f64 {
        self.f32.map(|f| f.0).unwrap_or(self.rel)
    }
}

struct CaseResult {
    name: String,
    loss_ours: f64,
    loss_torch: f64,
    /// PyTorch's float32 loss (bf16 cases only).
    loss_torch_f32: Option<f64>,
    logp_rel: f64,
    logp_f32: Option<(f64, f64)>,
    worst_rel: f64,
    worst_tensor: String,
    worst_ratio: f64,
    ratio_tensor: String,
    tensors: Vec<TensorErr>,
    skipped: usize,
    /// CPU only: the two activation policies gave the same bits.
    policies_bitwise: Option<bool>,
    passed: bool,
}

/// The CUDA trainer's gradient (CPU layout) of the whole actor (text decoder, merger and
/// vision tower all trained), loss and log-probs of the group.
fn cuda_grads(
    model: &Qwen25VL,
    loss: &LossConfig,
    temperature: f32,
    ids: &[u32],
    items: &[MediaInput<'_>],
    responses: &[ResponseBatch<'_>],
    norm: Normaliser,
) -> Result<(Vec<f32>, f64, Vec<f32>)> {
    let gpu = Gpu::new(0).context("--backend cuda needs a CUDA device")?;
    let s = gpu.stream(0)?;
    let cfg = TrainConfig {
        loss: loss.clone(),
        kept_layers: 0,
        kept_prompt_layers: 0,
        freeze_vision: false,
        freeze_merger: false,
        temperature,
    };
    // no optimizer step is taken; the spec only has to be valid
    let adamw = AdamWSpec {
        lr: 1e-5,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        grad_clip: 0.0,
        lr_schedule: LrSchedule::Constant,
    };
    let mut tr = GpuTrainer::new(&gpu, &s, model, cfg, adamw)?;
    let group = [GpuGroupBatch {
        prompt_ids: ids,
        media: PromptMedia::Raw(items),
        responses,
    }];
    let out = tr.micro_batch(&gpu, &s, 0, &group, norm)?;
    let grads = tr.grads_host(&s)?;
    Ok((grads, out.metrics.loss, out.logp.concat()))
}

fn run_case(dir: &Path, backend: Backend, bound: Bound, quiet: bool) -> Result<CaseResult> {
    let tol = bound.tol;
    let name = dir
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let model = Qwen25VL::load(&dir.join("model"))
        .with_context(|| format!("{name}: loading the checkpoint"))?;
    let inp = Tensors::load(&dir.join("grad_inputs.safetensors"))?;
    let rf = Tensors::load(&dir.join("grad_ref.safetensors"))?;
    let case: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("grad_case.json"))
            .with_context(|| format!("{name}: grad_case.json"))?,
    )?;
    let l = &case["loss"];
    let num = |k: &str| {
        l[k].as_f64()
            .ok_or_else(|| anyhow!("grad_case.json: loss.{k} missing"))
    };
    let agg = match l["agg"].as_str().unwrap_or("") {
        "token_mean" => LossAgg::TokenMean,
        "seq_mean_token_mean" => LossAgg::SeqMeanTokenMean,
        "seq_mean_token_sum" => LossAgg::SeqMeanTokenSum,
        other => bail!("grad_case.json: unknown agg {other:?}"),
    };
    let kl_estimator = match l["kl_estimator"].as_str().unwrap_or("") {
        "k1" => KlEstimator::K1,
        "k2" => KlEstimator::K2,
        "k3" => KlEstimator::K3,
        other => bail!("grad_case.json: unknown kl_estimator {other:?}"),
    };
    let loss = LossConfig {
        clip_low: num("clip_low")?,
        clip_high: num("clip_high")?,
        dual_clip: Some(num("dual_clip")?),
        kl_coef: num("kl_coef")?,
        kl_estimator,
        agg,
        ratio: rollplex_plan::spec::RatioLevel::Token,
        horizon: 0,
    };
    let temperature = num("temperature")? as f32;

    // prompt and media in placeholder order (each run of image/video tokens takes the next item)
    let ids: Vec<u32> = inp
        .need_i64("input_ids")?
        .iter()
        .map(|&x| x as u32)
        .collect();
    let pd = model.config.patch_dim();
    let img_pix = inp.f32s("image_pixels")?.unwrap_or_default();
    let vid_pix = inp.f32s("video_pixels")?.unwrap_or_default();
    let img_grid = grids_of(inp.i64s("image_grid_thw")?);
    let vid_grid = grids_of(inp.i64s("video_grid_thw")?);
    let secs = inp.f32s("second_per_grid_ts")?.unwrap_or_default();
    let tok = &model.config.spec.tokens;
    let (mut ii, mut vi, mut ioff, mut voff) = (0usize, 0usize, 0usize, 0usize);
    let mut items: Vec<MediaInput<'_>> = Vec::new();
    let mut i = 0;
    while i < ids.len() {
        let id = ids[i];
        if id != tok.image_token_id && id != tok.video_token_id {
            i += 1;
            continue;
        }
        let mut j = i;
        while j < ids.len() && ids[j] == id {
            j += 1;
        }
        if id == tok.image_token_id {
            let g = *img_grid
                .get(ii)
                .ok_or_else(|| anyhow!("more image runs than image grids"))?;
            let n = (g[0] * g[1] * g[2]) as usize * pd;
            items.push(MediaInput {
                kind: MediaKind::Image,
                pixels: &img_pix[ioff..ioff + n],
                grid: g,
            });
            ii += 1;
            ioff += n;
        } else {
            let g = *vid_grid
                .get(vi)
                .ok_or_else(|| anyhow!("more video runs than video grids"))?;
            let n = (g[0] * g[1] * g[2]) as usize * pd;
            let s = secs.get(vi).map(|s| *s as f64);
            items.push(MediaInput {
                kind: MediaKind::Video {
                    second_per_grid_t: s,
                },
                pixels: &vid_pix[voff..voff + n],
                grid: g,
            });
            vi += 1;
            voff += n;
        }
        i = j;
    }

    // the group
    let tokens: Vec<u32> = inp
        .need_i64("resp_tokens")?
        .iter()
        .map(|&x| x as u32)
        .collect();
    let offsets: Vec<usize> = inp
        .need_i64("resp_offsets")?
        .iter()
        .map(|&x| x as usize)
        .collect();
    let old = inp.need_f32("old_logp")?;
    let refl = inp.need_f32("ref_logp")?;
    let adv = inp.need_f32("advantages")?;
    let mask: Vec<bool> = inp.need_i64("mask")?.iter().map(|&x| x != 0).collect();
    let responses: Vec<ResponseBatch<'_>> = offsets
        .windows(2)
        .map(|w| ResponseBatch {
            tokens: &tokens[w[0]..w[1]],
            old_logp: Some(&old[w[0]..w[1]]),
            ref_logp: Some(&refl[w[0]..w[1]]),
            advantages: &adv[w[0]..w[1]],
            mask: &mask[w[0]..w[1]],
        })
        .collect();
    let group = [GroupBatch {
        prompt_ids: &ids,
        media: &items,
        responses: &responses,
    }];
    let norm = Normaliser::of(&offsets, &mask)?;
    let run_cpu = |kept_layers| -> Result<(Vec<f32>, f64, Vec<f32>)> {
        let cfg = TrainConfig {
            loss: loss.clone(),
            kept_layers,
            kept_prompt_layers: kept_layers,
            freeze_vision: false,
            freeze_merger: false,
            temperature,
        };
        let mut grads = vec![0f32; model.weights.table.total()];
        let out = forward_backward(&model, &cfg, &group, norm, &mut grads)?;
        Ok((grads, out.metrics.loss, out.logp.concat()))
    };
    let (grads, loss_ours, logp, policies_bitwise) = match backend {
        Backend::Cpu => {
            let (grads, loss_ours, logp) = run_cpu(usize::MAX)?;
            let (grads_rc, loss_rc, _) = run_cpu(0)?;
            let bitwise = loss_rc.to_bits() == loss_ours.to_bits()
                && grads
                    .iter()
                    .zip(&grads_rc)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
            (grads, loss_ours, logp, Some(bitwise))
        }
        Backend::Cuda => {
            let (g, l, lp) =
                cuda_grads(&model, &loss, temperature, &ids, &items, &responses, norm)?;
            (g, l, lp, None)
        }
    };
    // PyTorch's f32 run of the same case (bf16 cases only): ours and torch bf16 against it
    let f32_path = dir.join("grad_ref_f32.safetensors");
    let rf32 = if f32_path.exists() {
        Some(Tensors::load(&f32_path)?)
    } else {
        None
    };
    // (ours vs f32, torch bf16 vs f32) and the bound they give
    let against_f32 = |ours: &[f32], torch: &[f32], name: &str| -> Result<Option<(f64, f64)>> {
        let Some(r) = &rf32 else { return Ok(None) };
        let f = r.need_f32(name)?;
        Ok(Some((errors(ours, &f).0, errors(torch, &f).0)))
    };
    let bound_of = |f: Option<(f64, f64)>| match f {
        Some((_, t)) => (bound.bf16_factor * t).max(tol),
        None => tol,
    };

    let torch_logp = rf.need_f32("torch_logp")?;
    let (logp_rel, _) = errors(&logp, &torch_logp);
    let logp_f32 = against_f32(&logp, &torch_logp, "torch_logp")?;
    let logp_ok = logp_f32.map(|f| f.0).unwrap_or(logp_rel) <= bound_of(logp_f32);
    let loss_torch_f32 = match &rf32 {
        Some(r) => r.f64s("torch_loss")?.and_then(|v| v.first().copied()),
        None => None,
    };
    let loss_torch = rf
        .f64s("torch_loss")?
        .and_then(|v| v.first().copied())
        .ok_or_else(|| anyhow!("no torch_loss"))?;

    let mut tensors = Vec::new();
    let n_entries = model.weights.table.entries().len();
    // every tensor is compared: both backends train the whole actor here
    let wanted = vec![true; n_entries];
    let mut seen = vec![false; n_entries];
    let mut skipped = 0;
    for tname in rf.names() {
        if tname == "torch_logp" || tname == "torch_loss" {
            continue;
        }
        let id = model
            .weights
            .table
            .find(&tname)
            .ok_or_else(|| anyhow!("{name}: torch parameter {tname} is not in our model"))?;
        if !wanted[id.0 as usize] {
            skipped += 1;
            continue;
        }
        seen[id.0 as usize] = true;
        let e = model.weights.table.entry(id);
        let want = rf.need_f32(&tname)?;
        if want.len() != e.len {
            bail!(
                "{name}: {tname} has {} gradient values in torch, {} here",
                want.len(),
                e.len
            );
        }
        let ours = &grads[e.offset..e.offset + e.len];
        let (rel, max) = errors(ours, &want);
        let norm_t = want.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        let f32 = against_f32(ours, &want, &tname)?;
        tensors.push(TensorErr {
            name: e.name.clone(),
            rel,
            max,
            norm: norm_t,
            f32,
            bound: bound_of(f32),
        });
    }
    if let Some(i) = (0..n_entries).find(|&i| wanted[i] && !seen[i]) {
        bail!(
            "{name}: torch gave no gradient for our {}",
            model.weights.table.entries()[i].name
        );
    }
    let (worst_rel, worst_tensor) = tensors.iter().fold((0f64, String::new()), |w, t| {
        if t.judged() > w.0 {
            (t.judged(), t.name.clone())
        } else {
            w
        }
    });
    let (worst_ratio, ratio_tensor) = tensors.iter().fold((0f64, String::new()), |w, t| {
        let r = t.judged() / t.bound;
        if r > w.0 {
            (r, t.name.clone())
        } else {
            w
        }
    });
    if !quiet {
        println!("{name}:");
        for t in &tensors {
            let extra = match t.f32 {
                Some((o, tb)) => format!(
                    "  vs f32: ours {o:9.2e} torch bf16 {tb:9.2e}  bound {:9.2e}",
                    t.bound
                ),
                None => String::new(),
            };
            println!(
                "  {:<62} rel {:9.2e}  max abs {:9.2e}  |torch| {:9.2e}{extra}",
                t.name, t.rel, t.max, t.norm
            );
        }
    }
    let passed = tensors.iter().all(|t| t.judged() <= t.bound)
        && policies_bitwise.unwrap_or(true)
        && logp_ok;
    Ok(CaseResult {
        name,
        loss_ours,
        loss_torch,
        loss_torch_f32,
        logp_rel,
        logp_f32,
        worst_rel,
        worst_tensor,
        worst_ratio,
        ratio_tensor,
        tensors,
        skipped,
        policies_bitwise,
        passed,
    })
}

const USAGE: &str = "usage: grad_compare ROOT [--tol 1e-3 (cpu) / 1e-2 (cuda)] [--quiet] \
                     [--backend cpu|cuda] [--bf16-factor 3]   (ROOT: written by \
                     tests/reference/grad_compare.py; cuda: with --dtype bfloat16)";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut root: Option<PathBuf> = None;
    let mut tol: Option<f64> = None;
    let mut bf16_factor = 3.0;
    let mut backend = Backend::Cpu;
    let mut quiet = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--tol" | "--bf16-factor" => match it.next().and_then(|v| v.parse::<f64>().ok()) {
                Some(v) if a == "--tol" => tol = Some(v),
                Some(v) => bf16_factor = v,
                None => {
                    eprintln!("error: {a} needs a number");
                    return ExitCode::from(2);
                }
            },
            "--backend" => match it.next().map(|s| s.as_str()) {
                Some("cpu") => backend = Backend::Cpu,
                Some("cuda") => backend = Backend::Cuda,
                other => {
                    eprintln!("error: --backend takes cpu or cuda, not {other:?}");
                    return ExitCode::from(2);
                }
            },
            "--quiet" => quiet = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            _ if root.is_none() => root = Some(PathBuf::from(a)),
            _ => {
                eprintln!("error: unexpected argument {a}");
                return ExitCode::from(2);
            }
        }
    }
    let Some(root) = root else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    let tol = tol.unwrap_or(match backend {
        Backend::Cpu => 1e-3,
        Backend::Cuda => 1e-2,
    });
    let bound = Bound { tol, bf16_factor };
    let mut dirs: Vec<PathBuf> = match std::fs::read_dir(&root) {
        Ok(rd) => rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.join("grad_ref.safetensors").exists())
            .collect(),
        Err(e) => {
            eprintln!("error: {}: {e}", root.display());
            return ExitCode::from(2);
        }
    };
    dirs.sort();
    if dirs.is_empty() {
        eprintln!("error: no case with grad_ref.safetensors under {} (run tests/reference/grad_compare.py first)", root.display());
        return ExitCode::from(2);
    }
    let mut all_ok = true;
    let mut json = Vec::new();
    for d in &dirs {
        match run_case(d, backend, bound, quiet) {
            Ok(r) => {
                let bitwise = match r.policies_bitwise {
                    Some(b) => format!("; keep == recompute bitwise: {b}"),
                    None => String::new(),
                };
                let (vs, f32s) = match r.logp_f32 {
                    Some((o, t)) => (
                        " vs torch f32",
                        format!(" (ours vs torch f32 {o:.2e}, torch bf16 vs f32 {t:.2e})"),
                    ),
                    None => ("", String::new()),
                };
                let skipped = if r.skipped > 0 {
                    format!("; {} frozen vision tensors not compared", r.skipped)
                } else {
                    String::new()
                };
                let loss_f32 = r
                    .loss_torch_f32
                    .map(|l| format!(" (torch f32 {l:.9})"))
                    .unwrap_or_default();
                println!(
                    "{}: loss ours {:.9} torch {:.9}{loss_f32}; logp rel {:.2e}{f32s}; {} tensors, worst rel{vs} {:.2e} ({}); worst error / bound {:.2} ({}){bitwise}{skipped}; {}",
                    r.name,
                    r.loss_ours,
                    r.loss_torch,
                    r.logp_rel,
                    r.tensors.len(),
                    r.worst_rel,
                    r.worst_tensor,
                    r.worst_ratio,
                    r.ratio_tensor,
                    if r.passed { "ok" } else { "FAIL" }
                );
                all_ok &= r.passed;
                json.push(serde_json::json!({
                    "case": r.name,
                    "loss_ours": r.loss_ours,
                    "loss_torch": r.loss_torch,
                    "loss_torch_f32": r.loss_torch_f32,
                    "backend": if backend == Backend::Cuda { "cuda" } else { "cpu" },
                    "logp_rel_l2": r.logp_rel,
                    "logp_vs_f32": r.logp_f32.map(|f| serde_json::json!({"ours": f.0, "torch_bf16": f.1})),
                    "worst_rel_l2": r.worst_rel,
                    "worst_tensor": r.worst_tensor,
                    "worst_error_over_bound": r.worst_ratio,
                    "worst_ratio_tensor": r.ratio_tensor,
                    "skipped_frozen": r.skipped,
                    "keep_equals_recompute_bitwise": r.policies_bitwise,
                    "passed": r.passed,
                    "tensors": r.tensors.iter().map(|t| serde_json::json!({"name": t.name, "rel_l2": t.rel, "max_abs": t.max, "torch_norm": t.norm, "vs_f32": t.f32.map(|f| serde_json::json!({"ours": f.0, "torch_bf16": f.1})), "bound": t.bound})).collect::<Vec<_>>(),
                }));
            }
            Err(e) => {
                println!("{}: error: {e:#}", d.display());
                all_ok = false;
            }
        }
    }
    let out = root.join("grad_results.json");
    if let Err(e) = std::fs::write(
        &out,
        serde_json::to_string_pretty(&json).unwrap_or_default(),
    ) {
        eprintln!("warning: could not write {}: {e}", out.display());
    }
    println!(
        "{} of {} cases within their bound (tol {tol:e}{})",
        json.iter().filter(|j| j["passed"] == true).count(),
        dirs.len(),
        if backend == Backend::Cuda {
            format!(", or {bf16_factor} x torch's own bf16 error vs f32")
        } else {
            String::new()
        }
    );
    if all_ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
