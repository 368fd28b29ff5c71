//! Tests of the GPU model: host-side logic (no GPU needed), and the whole tiny-model forward on
//! CUDA against the CPU engine (skipped, saying so, where no CUDA device is usable).
//!
//! The CPU reference runs the same weights rounded to bf16, so what differs is the bf16
//! rounding of activations only. Errors are reported as max abs and max abs relative to the
//! largest reference value (`max_rel`).

use half::bf16;
use rollplex_kernels::cpu::linear_fwd;
use rollplex_kernels::cuda::{sample_ref, test_gpu, Gpu};
use rollplex_plan::models::TestModel;
use rollplex_plan::spec::ModelSpec;

use super::plan::*;
use super::weights::fuse_linears;
use super::*;
use crate::model::weights::Init;
use crate::model::{
    DecodeSlot, GenerateConfig, KvArena, KvSpan, MediaInput, MediaKind, Prompt, Qwen25VL,
    SamplingParams,
};

const VS: u32 = 296;
const VE: u32 = 297;
const IMG: u32 = 298;
const VID: u32 = 299;

/// Tiny dims the CUDA kernels take: vision head_dim 16, text head_dim `text_hd` (32: the
/// tensor-core decode; 16: the varlen decode path); odd FFN and vocabulary sizes.
fn spec(text_heads: u32, kv_heads: u32, text_hd: u32, tie: bool) -> ModelSpec {
    TestModel::gpu(text_heads, kv_heads, text_hd, tie).spec()
}

/// A random model at the scales of tests/reference/make_tiny.py (weights 1/sqrt(fan_in),
/// embeddings 1, biases 0.1, norms 1 +- 0.1), its weights rounded to bf16 so that the CPU and
/// GPU runs read the same numbers.
fn model(spec: ModelSpec) -> Qwen25VL {
    let mut m = Qwen25VL::random(spec, 11).unwrap();
    let entries = m.weights.table.entries().to_vec();
    let embed = m.weights.layout.embed;
    for (i, e) in entries.iter().enumerate() {
        let d = &mut m.weights.data[e.offset..e.offset + e.len];
        let fan_in: usize = e.shape[1..].iter().product::<usize>().max(1);
        for (j, x) in d.iter_mut().enumerate() {
            let u = (((i * 7919 + j) as u64 * 2654435761) % 2000) as f32 / 1000.0 - 1.0;
            *x = match e.init {
                Init::Normal if i == embed.0 as usize => *x / 0.02,
                Init::Normal => *x / 0.02 / (fan_in as f32).sqrt(),
                Init::Ones => 1.0 + 0.1 * u,
                Init::Zeros => 0.1 * u,
            };
            *x = bf16::from_f32(*x).to_f32();
        }
    }
    m
}

fn pixels(n: usize, pd: usize, seed: u64) -> Vec<f32> {
    (0..n * pd)
        .map(|i| (((i as u64 + seed * 7919) * 2654435761 % 2000) as f32 / 1000.0) - 1.0)
        .collect()
}

fn text(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + seed * 101) % 290).collect()
}

/// (max abs, max abs / max |ref|).
fn err(got: &[f32], want: &[f32]) -> (f64, f64) {
    assert_eq!(got.len(), want.len());
    let (mut ma, mut mr) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        ma = ma.max((*g as f64 - *w as f64).abs());
        mr = mr.max((*w as f64).abs());
        assert!(g.is_finite(), "non-finite output {g}");
    }
    (ma, ma / mr.max(f64::MIN_POSITIVE))
}

fn host(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

// ---------------------------------------------------------------- host-side (no GPU)

#[test]
fn fused_linears_compute_their_parts() {
    let m = model(spec(4, 2, 32, false));
    let l = &m.weights.layout.text_layers[1];
    let (w, b, out) = fuse_linears(&m.weights, &[l.q, l.k, l.v]);
    assert_eq!(out, l.q.out + l.k.out + l.v.out);
    let rows = 3;
    let x = pixels(rows, l.q.inp, 4);
    let mut fused = vec![0f32; rows * out];
    linear_fwd(&mut fused, &x, &w, b.as_deref(), rows, l.q.inp, out).unwrap();
    let mut col = 0;
    for part in [&l.q, &l.k, &l.v] {
        let mut y = vec![0f32; rows * part.out];
        let (pw, pb) = (m.weights.lin_w(part), m.weights.lin_b(part));
        linear_fwd(&mut y, &x, pw, pb, rows, part.inp, part.out).unwrap();
        for r in 0..rows {
            assert_eq!(
                &fused[r * out + col..r * out + col + part.out],
                &y[r * part.out..(r + 1) * part.out]
            );
        }
        col += part.out;
    }
    // gate|up of a text layer have no bias: none is made up
    let (_, b2, out2) = fuse_linears(&m.weights, &[l.gate, l.up]);
    assert!(b2.is_none());
    assert_eq!(out2, 2 * 99);
}

#[test]
fn vision_plan_permutes_and_inverts() {
    let m = model(spec(4, 2, 32, false));
    let grids = [[1, 4, 6], [2, 4, 4]];
    let p = VisionPlan::new(&m.config, &grids).unwrap();
    assert_eq!(p.patches, 24 + 32);
    assert_eq!(p.unit, 4);
    for (i, &g) in p.window_index.iter().enumerate() {
        assert_eq!(p.inverse[g as usize], i as u32);
    }
    // rows permuted in groups of 4 patches
    let rows: Vec<f32> = (0..p.patches).map(|r| r as f32).collect();
    let perm = p.permute_rows_bf16(&[&rows[..24], &rows[24..]], 1);
    for (i, &g) in p.window_index.iter().enumerate() {
        for u in 0..4 {
            assert_eq!(perm[i * 4 + u].to_f32(), (g as usize * 4 + u) as f32);
        }
    }
    // sequences cover every permuted row exactly once
    for seqs in [&p.full_seqs, &p.window_seqs] {
        let total: u32 = seqs.iter().map(|s| s.len).sum();
        assert_eq!(total as usize, p.patches);
    }
    assert_eq!(p.full_seqs.len(), 3); // one per frame
    assert!(VisionPlan::new(&m.config, &[[1, 3, 4]]).is_err());
}

#[test]
fn memoised_rope_tables_are_bitwise_the_cpu_engines() {
    use crate::model::positions::{mrope_tables, vision_patch_hw, vision_rope_tables};
    let pos = [
        vec![0i64, 1, 2, 2, 2, 7, 9, 1000, 1],
        vec![0i64, 1, 2, 3, 3, 7, 8, 1001, 1],
        vec![0i64, 1, 2, 3, 4, 7, 9, 1000, 5],
    ];
    assert_eq!(
        mrope_tables_memo(&pos, 32, 1e6, [4, 6, 6]),
        mrope_tables(&pos, 32, 1e6, [4, 6, 6])
    );
    // Qwen2.5-VL's text head (128, sections 16/24/24), the sections filled row-parallel
    assert_eq!(
        mrope_tables_memo(&pos, 128, 1e6, [16, 24, 24]),
        mrope_tables(&pos, 128, 1e6, [16, 24, 24])
    );
    let hw = vision_patch_hw(&[[2, 4, 6], [1, 8, 2]], 2);
    assert_eq!(
        vision_rope_tables_memo(&hw, 80, 1e4),
        vision_rope_tables(&hw, 80, 1e4)
    );
}

#[test]
fn packed_prompts_place_media_rows_and_sequences() {
    let m = model(spec(4, 2, 32, false));
    let mut p0 = text(3, 1);
    p0.push(VS);
    p0.extend([IMG; 6]);
    p0.push(VE);
    let p1 = text(4, 2);
    let specs = [
        PromptSpec {
            ids: &p0,
            media: vec![media_slot(MediaKind::Image, [1, 4, 6])],
        },
        PromptSpec {
            ids: &p1,
            media: vec![],
        },
    ];
    let pk = PackedPrompts::new(&m.config, &specs).unwrap();
    assert_eq!(pk.ids.len(), 15);
    assert_eq!(pk.media_rows, (4..10).collect::<Vec<u32>>());
    assert_eq!((pk.seqs[1].start, pk.seqs[1].len), (11, 4));
    assert_eq!(pk.cos.len(), 15 * 32);
    // wrong media count is an error, not a panic
    let bad = [PromptSpec {
        ids: &p0,
        media: vec![],
    }];
    assert!(PackedPrompts::new(&m.config, &bad).is_err());
    assert!(check_ids("t", &[1, 300], 301).is_ok());
    assert!(check_ids("t", &[1, 301], 301).is_err());
}

#[test]
fn decode_slot_checks() {
    let pre = KvSpan { offset: 0, len: 10 };
    let a = DecodeSlot::new(pre, 0, 10, 5);
    let b = DecodeSlot::new(pre, 0, 15, 5);
    assert!(check_decode_slots(20, &[a, b]).is_ok());
    assert!(check_decode_slots(19, &[a, b]).is_err()); // past the arena
    let c = DecodeSlot::new(pre, 0, 12, 5);
    assert!(check_decode_slots(40, &[a, c]).is_err()); // suffixes overlap
    let d = DecodeSlot::new(pre, 0, 5, 3);
    assert!(check_decode_slots(40, &[d]).is_err()); // suffix inside the prefix
    let mut full = a;
    full.suffix_len = 5;
    assert!(check_decode_slots(40, &[full]).is_err());
    assert_eq!(decode_kernel_for(128).unwrap(), DecodeKernel::TensorCores);
    assert_eq!(decode_kernel_for(80).unwrap(), DecodeKernel::Varlen);
    assert!(decode_kernel_for(12).is_err());
}

// ---------------------------------------------------------------- CUDA vs CPU

/// Device 0, or a printed skip (a failure with `ROLLPLEX_REQUIRE_GPU=1`).
fn gpu_or_skip() -> Option<Gpu> {
    test_gpu()
}

/// Max relative error allowed between the bf16 GPU forward and the CPU forward on bf16
/// weights (activations rounded to bf16 at every op over 3 vision blocks and 3 text layers).
const TOL: f64 = 3e-2;

fn whole_forward(name: &str, spec: ModelSpec) {
    let Some(gpu) = gpu_or_skip() else { return };
    let s = gpu.stream(0).unwrap();
    let cpu = model(spec);
    let gm = GpuModel::upload(&gpu, &s, &cpu).unwrap();
    let pd = cpu.config.patch_dim();
    // media: an image 1x4x6 (6 tokens), a video 2x4x4 (8 tokens), an image 1x6x4 (6 tokens)
    let px = [pixels(24, pd, 1), pixels(32, pd, 2), pixels(24, pd, 3)];
    let items = [
        MediaInput {
            kind: MediaKind::Image,
            pixels: &px[0],
            grid: [1, 4, 6],
        },
        MediaInput {
            kind: MediaKind::Video {
                second_per_grid_t: Some(2.0),
            },
            pixels: &px[1],
            grid: [2, 4, 4],
        },
        MediaInput {
            kind: MediaKind::Image,
            pixels: &px[2],
            grid: [1, 6, 4],
        },
    ];
    let enc_c = cpu.encode_media(&items, None).unwrap();
    let enc_g = gm.encode_media(&gpu, &s, &items).unwrap();
    let mut worst = 0f64;
    for (c, g) in enc_c.iter().zip(&enc_g) {
        let h = g.to_host(&s).unwrap();
        let (a, r) = err(&h.embeds, &c.embeds);
        println!(
            "[{name}] vision {:?} {:?}: max_abs {a:.3e} max_rel {r:.3e}",
            c.kind, c.grid
        );
        worst = worst.max(r);
    }
    assert!(worst < TOL, "vision embeddings off by {worst}");
    // prompts: P0 text+image+text+video+text, P1 text only, P2 text+image+text
    let mut p0 = text(5, 1);
    p0.push(VS);
    p0.extend([IMG; 6]);
    p0.push(VE);
    p0.extend(text(3, 2));
    p0.push(VS);
    p0.extend([VID; 8]);
    p0.push(VE);
    p0.extend(text(4, 3));
    let p1 = text(9, 4);
    let mut p2 = text(2, 5);
    p2.push(VS);
    p2.extend([IMG; 6]);
    p2.push(VE);
    p2.extend(text(6, 6));
    let (c0, c2) = ([&enc_c[0], &enc_c[1]], [&enc_c[2]]);
    let (g0, g2) = ([&enc_g[0], &enc_g[1]], [&enc_g[2]]);
    let cp = [
        Prompt {
            ids: &p0,
            media: &c0,
        },
        Prompt {
            ids: &p1,
            media: &[],
        },
        Prompt {
            ids: &p2,
            media: &c2,
        },
    ];
    let gp = [
        GpuPrompt {
            ids: &p0,
            media: &g0,
        },
        GpuPrompt {
            ids: &p1,
            media: &[],
        },
        GpuPrompt {
            ids: &p2,
            media: &g2,
        },
    ];
    // full forward of the media prompt
    let fc = cpu.forward_logits(cp[0]).unwrap();
    let fg = host(&download(&s, &gm.forward_logits(&gpu, &s, gp[0]).unwrap()).unwrap());
    let (a, r) = err(&fg, &fc);
    println!(
        "[{name}] forward_logits ({} tokens): max_abs {a:.3e} max_rel {r:.3e}",
        p0.len()
    );
    assert!(r < TOL, "forward logits off by {r}");
    // packed prefill of three prompts of different lengths
    let sc = cpu.prefill(&cp, None).unwrap();
    let sg = gm.prefill(&gpu, &s, &gp).unwrap();
    for (i, (c, g)) in sc.iter().zip(&sg).enumerate() {
        assert_eq!((c.len, c.rope_delta), (g.len, g.rope_delta));
        let l = host(&download(&s, &*g.last_logits).unwrap());
        let (a, r) = err(&l, &c.last_logits);
        println!(
            "[{name}] prefill prompt {i} ({} tokens) last logits: max_abs {a:.3e} max_rel {r:.3e}",
            c.len
        );
        assert!(r < TOL, "prefill prompt {i} off by {r}");
    }
    // decode: two groups (prefixes of P0 and P2) of two samples each, 4 steps of fixed tokens
    let v = cpu.config.text().vocab_size as usize;
    let cap = 200;
    let mut ac = KvArena::for_model(&cpu, cap);
    let mut ag = GpuKvArena::for_model(&gm, &gpu, &s, cap).unwrap();
    let sp0 = ac.store_prefix(0, &sc[0]).unwrap();
    let sp2 = ac.store_prefix(40, &sc[2]).unwrap();
    assert_eq!(ag.store_prefix(&s, 0, &sg[0]).unwrap(), sp0);
    assert_eq!(ag.store_prefix(&s, 40, &sg[2]).unwrap(), sp2);
    let mut slots_c = vec![
        DecodeSlot::new(sp0, sc[0].rope_delta, 80, 8),
        DecodeSlot::new(sp0, sc[0].rope_delta, 88, 8),
        DecodeSlot::new(sp2, sc[2].rope_delta, 96, 8),
        DecodeSlot::new(sp2, sc[2].rope_delta, 104, 8),
    ];
    let mut slots_g = slots_c.clone();
    let mut worst = 0f64;
    let mut last_g = Vec::new();
    for step in 0..4u32 {
        let toks: Vec<u32> = (0..4).map(|b| (step * 31 + b * 7 + 3) % 290).collect();
        let mut lc = vec![0f32; 4 * v];
        cpu.decode_step(&mut ac, &mut slots_c, &toks, &mut lc)
            .unwrap();
        let lg_d = gm
            .decode_step(&gpu, &s, &mut ag, &mut slots_g, &toks)
            .unwrap();
        let lg = host(&download(&s, &lg_d).unwrap());
        let (a, r) = err(&lg, &lc);
        println!("[{name}] decode step {step} (batch 4, 2 shared prefixes): max_abs {a:.3e} max_rel {r:.3e}");
        worst = worst.max(r);
        last_g = download(&s, &lg_d).unwrap();
    }
    assert_eq!(slots_c, slots_g);
    assert!(worst < TOL, "decode logits off by {worst}");
    // sampling on the device equals its CPU twin on the same logits
    let sampling = SamplingParams {
        temperature: 0.9,
        top_k: 50,
        top_p: 0.9,
    };
    let ids = [3u32, 9, 27, 81];
    let steps = [5u32, 5, 6, 7];
    let lg_d = upload(&s, &last_g).unwrap();
    let toks = download(
        &s,
        &gm.sample_tokens(&gpu, &s, &lg_d, &sampling, 42, 2, &ids, &steps)
            .unwrap(),
    )
    .unwrap();
    let p = sample_params(&sampling, 42, 2);
    let mism = (0..4)
        .filter(|&b| toks[b] != sample_ref(&last_g[b * v..(b + 1) * v], &p, ids[b], steps[b]))
        .count();
    println!("[{name}] device sampling vs sample_ref: {mism} of 4 rows differ");
    assert!(mism <= 1);
    // score responses of different lengths from P1's kept prefix
    let resp: [Vec<u32>; 4] = [text(5, 7), vec![11], vec![], text(7, 8)];
    let rr: Vec<&[u32]> = resp.iter().map(|r| r.as_slice()).collect();
    let tc = cpu.score(&sc[1], &rr, 0.8, None).unwrap();
    let tg = gm.score(&gpu, &s, &sg[1], &rr, 0.8).unwrap();
    let (mut la, mut ea) = (0f64, 0f64);
    for (c, g) in tc.iter().zip(&tg) {
        assert_eq!(c.logp.len(), g.logp.len());
        la = la.max(err(&g.logp, &c.logp).0);
        ea = ea.max(err(&g.entropy, &c.entropy).0);
    }
    println!("[{name}] score (4 responses, 0..7 tokens, T=0.8): logp max_abs {la:.3e}, entropy max_abs {ea:.3e}");
    // a log-prob moves by at most twice the largest logit error: bound it by the logits' scale
    let scale = fc.iter().fold(0f64, |m, x| m.max(x.abs() as f64));
    let lim = 2.0 * TOL * scale;
    assert!(
        la < lim && ea < lim,
        "scores off by {la} / {ea} (limit {lim:.3e})"
    );
    // greedy generation: agreement with the CPU engine, and rollout log-probs vs score
    let cfg = GenerateConfig {
        sampling: SamplingParams::greedy(),
        max_new_tokens: 24,
        stop_ids: Vec::new(),
        seed: 0,
        iteration: 0,
    };
    let rc = cpu.generate_group(&sc[0], &[0], &cfg).unwrap().remove(0);
    let rg = gm
        .generate_group(&gpu, &s, &sg[0], &[0], &cfg)
        .unwrap()
        .remove(0);
    let agree = rc
        .tokens
        .iter()
        .zip(&rg.tokens)
        .take_while(|(a, b)| a == b)
        .count();
    println!(
        "[{name}] greedy: {agree}/{} tokens agree with the CPU engine\n  cpu {:?}\n  gpu {:?}",
        rc.tokens.len(),
        rc.tokens,
        rg.tokens
    );
    assert!(agree >= 1, "the first greedy token differs");
    let sg0 = gm.score(&gpu, &s, &sg[0], &[&rg.tokens], 1.0).unwrap();
    let (a, _) = err(&rg.logp, &sg0[0].logp);
    println!("[{name}] rollout logp vs score of the same tokens (decode vs packed kernels): max_abs {a:.3e}");
    assert!(
        a < lim,
        "rollout log-probs differ from score's by {a} (limit {lim:.3e})"
    );
}

#[test]
fn cuda_forward_matches_cpu_tensor_core_decode() {
    whole_forward("hd32 gqa2", spec(4, 2, 32, false));
}

#[test]
fn cuda_forward_matches_cpu_varlen_decode_tied() {
    whole_forward("hd16 gqa4 tied", spec(4, 1, 16, true));
}
