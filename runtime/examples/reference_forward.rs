//! Compares our Qwen2.5-VL forward with what Hugging Face transformers computed
//! (`tests/reference/make_tiny.py` writes the cases).
//!
//! For every case directory under the root given on the command line: loads `model/` with our
//! checkpoint loader, runs the vision tower and the full-sequence forward on the case's
//! `input_ids` / pixels / grids, compares the logits with transformers' (max abs error, max abs
//! error relative to the largest reference logit, relative L2 error), and generates 32 tokens
//! greedily (prefill + KV-arena decode) to compare with transformers' `generate`.
//! Prints one line per case, writes `results.json` in the root, exits 1 if a case fails
//! (relative max error above `--tol`, default 1e-3, or any greedy token different).
//!
//! Usage: cargo run -p rollplex-runtime --example reference_forward -- ROOT [--tol 1e-3]

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{anyhow, bail, Context, Result};
use rollplex_runtime::model::{
    EncodedMedia, GenerateConfig, MediaInput, MediaKind, Prompt, Qwen25VL, SamplingParams,
};

#[path = "common/inputs.rs"]
mod inputs;
use inputs::{grids_of, Inputs};

struct CaseResult {
    name: String,
    prompt_len: usize,
    max_abs: f64,
    max_rel: f64,
    rel_l2: f64,
    greedy_match: usize,
    greedy_total: usize,
    passed: bool,
}

fn run_case(dir: &Path, tol: f64) -> Result<CaseResult> {
    let name = dir
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let model = Qwen25VL::load(&dir.join("model"))
        .with_context(|| format!("{name}: loading the checkpoint"))?;
    let inp = Inputs::load(&dir.join("inputs.safetensors"))?;
    let ids: Vec<u32> = inp
        .i64s("input_ids")?
        .ok_or_else(|| anyhow!("no input_ids"))?
        .iter()
        .map(|&x| x as u32)
        .collect();
    let want = inp.f32s("logits")?.ok_or_else(|| anyhow!("no logits"))?;
    let generated: Vec<u32> = inp
        .i64s("generated")?
        .ok_or_else(|| anyhow!("no generated"))?
        .iter()
        .map(|&x| x as u32)
        .collect();
    let pd = model.config.patch_dim();
    let img_pix = inp.f32s("image_pixels")?.unwrap_or_default();
    let vid_pix = inp.f32s("video_pixels")?.unwrap_or_default();
    let img_grid = grids_of(inp.i64s("image_grid_thw")?);
    let vid_grid = grids_of(inp.i64s("video_grid_thw")?);
    let secs = inp.f32s("second_per_grid_ts")?.unwrap_or_default();
    // media in placeholder order: each run of image (video) tokens takes the next image (video)
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
    let enc: Vec<EncodedMedia> = model.encode_media(&items, None)?;
    let refs: Vec<&EncodedMedia> = enc.iter().collect();
    let prompt = Prompt {
        ids: &ids,
        media: &refs,
    };
    let got = model.forward_logits(prompt)?;
    if got.len() != want.len() {
        bail!(
            "{name}: {} logits, transformers gave {}",
            got.len(),
            want.len()
        );
    }
    let (mut max_abs, mut ref_max, mut num, mut den) = (0f64, 0f64, 0f64, 0f64);
    for (g, w) in got.iter().zip(&want) {
        let d = (*g as f64 - *w as f64).abs();
        max_abs = max_abs.max(d);
        ref_max = ref_max.max((*w as f64).abs());
        num += d * d;
        den += (*w as f64) * (*w as f64);
    }
    let max_rel = max_abs / ref_max.max(f64::MIN_POSITIVE);
    let rel_l2 = (num / den.max(f64::MIN_POSITIVE)).sqrt();
    let st = model.prefill(&[prompt], None)?.remove(0);
    let cfg = GenerateConfig {
        sampling: SamplingParams::greedy(),
        max_new_tokens: generated.len() as u32,
        stop_ids: Vec::new(),
        seed: 0,
        iteration: 0,
    };
    let ours = model.generate_group(&st, &[0], &cfg)?.remove(0).tokens;
    let greedy_match = ours
        .iter()
        .zip(&generated)
        .take_while(|(a, b)| a == b)
        .count();
    let passed = max_rel <= tol && greedy_match == generated.len() && ours.len() == generated.len();
    if greedy_match < generated.len() {
        eprintln!("{name}: greedy differs at token {greedy_match}:\n  ours {ours:?}\n  hf   {generated:?}");
    }
    Ok(CaseResult {
        name,
        prompt_len: ids.len(),
        max_abs,
        max_rel,
        rel_l2,
        greedy_match,
        greedy_total: generated.len(),
        passed,
    })
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn run() -> Result<bool> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut root: Option<PathBuf> = None;
    let mut tol = 1e-3;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--tol" => {
                tol = it
                    .next()
                    .ok_or_else(|| anyhow!("--tol needs a value"))?
                    .parse()?
            }
            "-h" | "--help" => {
                println!("usage: reference_forward ROOT [--tol 1e-3]  (ROOT: output of tests/reference/make_tiny.py)");
                return Ok(true);
            }
            _ => root = Some(PathBuf::from(a)),
        }
    }
    let root = root.ok_or_else(|| anyhow!("usage: reference_forward ROOT [--tol 1e-3]"))?;
    let mut cases: Vec<PathBuf> = std::fs::read_dir(&root)
        .with_context(|| format!("reading {}", root.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("inputs.safetensors").exists())
        .collect();
    cases.sort();
    if cases.is_empty() {
        bail!(
            "{}: no case directories (run tests/reference/make_tiny.py first)",
            root.display()
        );
    }
    println!(
        "{:<18} {:>6} {:>11} {:>11} {:>11} {:>8}  result",
        "case", "prompt", "max_abs", "max_rel", "rel_l2", "greedy"
    );
    let mut all = true;
    let mut json = Vec::new();
    for c in &cases {
        let r = run_case(c, tol)?;
        all &= r.passed;
        println!(
            "{:<18} {:>6} {:>11.3e} {:>11.3e} {:>11.3e} {:>5}/{:<2}  {}",
            r.name,
            r.prompt_len,
            r.max_abs,
            r.max_rel,
            r.rel_l2,
            r.greedy_match,
            r.greedy_total,
            if r.passed { "ok" } else { "FAIL" }
        );
        json.push(serde_json::json!({
            "case": r.name, "prompt_len": r.prompt_len, "max_abs": r.max_abs, "max_rel": r.max_rel,
            "rel_l2": r.rel_l2, "greedy_match": r.greedy_match, "greedy_total": r.greedy_total, "passed": r.passed,
        }));
    }
    let out = root.join("results.json");
    std::fs::write(&out, serde_json::to_string_pretty(&json)?)
        .with_context(|| format!("writing {}", out.display()))?;
    println!(
        "{} passed, {} failed",
        json.iter().filter(|j| j["passed"] == true).count(),
        json.iter().filter(|j| j["passed"] == false).count()
    );
    Ok(all)
}
