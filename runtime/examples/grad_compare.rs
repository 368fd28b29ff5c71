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
//! Usage: cargo run -p rollplex-runtime --example grad_compare -- ROOT [--tol 1e-3] [--quiet]

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{anyhow, bail, Context, Result};
use rollplex_plan::spec::{KlEstimator, LossAgg, Recompute};
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

struct CaseResult {
    name: String,
    loss_ours: f64,
    loss_torch: f64,
    logp_rel: f64,
    worst_rel: f64,
    worst_tensor: String,
    tensors: Vec<(String, f64, f64, f64)>,
    policies_bitwise: bool,
    passed: bool,
}

fn run_case(dir: &Path, tol: f64, quiet: bool) -> Result<CaseResult> {
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
            old_logp: &old[w[0]..w[1]],
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
    let run = |recompute| -> Result<(Vec<f32>, f64, Vec<f32>)> {
        let cfg = TrainConfig {
            loss: loss.clone(),
            recompute,
            freeze_vision: false,
            freeze_merger: false,
            temperature,
        };
        let mut grads = vec![0f32; model.weights.table.total()];
        let out = forward_backward(&model, &cfg, &group, norm, &mut grads)?;
        Ok((grads, out.metrics.loss, out.logp.concat()))
    };
    let (grads, loss_ours, logp) = run(Recompute::None)?;
    let (grads_rc, loss_rc, _) = run(Recompute::Full)?;
    let policies_bitwise = loss_rc.to_bits() == loss_ours.to_bits()
        && grads
            .iter()
            .zip(&grads_rc)
            .all(|(a, b)| a.to_bits() == b.to_bits());

    let torch_logp = rf.need_f32("torch_logp")?;
    let (logp_rel, _) = errors(&logp, &torch_logp);
    let loss_torch = rf
        .f64s("torch_loss")?
        .and_then(|v| v.first().copied())
        .ok_or_else(|| anyhow!("no torch_loss"))?;

    let mut tensors = Vec::new();
    let mut seen = vec![false; model.weights.table.entries().len()];
    for tname in rf.names() {
        if tname == "torch_logp" || tname == "torch_loss" {
            continue;
        }
        let id = model
            .weights
            .table
            .find(&tname)
            .ok_or_else(|| anyhow!("{name}: torch parameter {tname} is not in our model"))?;
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
        tensors.push((e.name.clone(), rel, max, norm_t));
    }
    if let Some(i) = seen.iter().position(|s| !s) {
        bail!(
            "{name}: torch gave no gradient for our {}",
            model.weights.table.entries()[i].name
        );
    }
    let (worst_rel, worst_tensor) = tensors.iter().fold((0f64, String::new()), |w, t| {
        if t.1 > w.0 {
            (t.1, t.0.clone())
        } else {
            w
        }
    });
    if !quiet {
        println!("{name}:");
        for (n, rel, max, nrm) in &tensors {
            println!("  {n:<62} rel {rel:9.2e}  max abs {max:9.2e}  |torch| {nrm:9.2e}");
        }
    }
    let passed = worst_rel <= tol && policies_bitwise && logp_rel <= tol;
    Ok(CaseResult {
        name,
        loss_ours,
        loss_torch,
        logp_rel,
        worst_rel,
        worst_tensor,
        tensors,
        policies_bitwise,
        passed,
    })
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut root: Option<PathBuf> = None;
    let mut tol = 1e-3;
    let mut quiet = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--tol" => match it.next().and_then(|v| v.parse().ok()) {
                Some(v) => tol = v,
                None => {
                    eprintln!("error: --tol needs a number");
                    return ExitCode::from(2);
                }
            },
            "--quiet" => quiet = true,
            "-h" | "--help" => {
                println!("usage: grad_compare ROOT [--tol 1e-3] [--quiet]   (ROOT: written by tests/reference/grad_compare.py)");
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
        eprintln!("usage: grad_compare ROOT [--tol 1e-3] [--quiet]");
        return ExitCode::from(2);
    };
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
        match run_case(d, tol, quiet) {
            Ok(r) => {
                println!(
                    "{}: loss ours {:.9} torch {:.9}; logp rel {:.2e}; worst tensor rel {:.2e} ({}); keep == recompute bitwise: {}; {}",
                    r.name,
                    r.loss_ours,
                    r.loss_torch,
                    r.logp_rel,
                    r.worst_rel,
                    r.worst_tensor,
                    r.policies_bitwise,
                    if r.passed { "ok" } else { "FAIL" }
                );
                all_ok &= r.passed;
                json.push(serde_json::json!({
                    "case": r.name,
                    "loss_ours": r.loss_ours,
                    "loss_torch": r.loss_torch,
                    "logp_rel_l2": r.logp_rel,
                    "worst_rel_l2": r.worst_rel,
                    "worst_tensor": r.worst_tensor,
                    "keep_equals_recompute_bitwise": r.policies_bitwise,
                    "passed": r.passed,
                    "tensors": r.tensors.iter().map(|t| serde_json::json!({"name": t.0, "rel_l2": t.1, "max_abs": t.2, "torch_norm": t.3})).collect::<Vec<_>>(),
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
        "{} of {} cases within rel {tol:e}",
        json.iter().filter(|j| j["passed"] == true).count(),
        dirs.len()
    );
    if all_ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
