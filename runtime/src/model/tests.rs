//! Model-level tests: the RL operations agree with a full forward, batch composition never
//! changes a bit, sampling is reproducible, checkpoints round-trip.

use rollplex_kernels::cpu::logprobs_fwd;
use rollplex_plan::models::TestModel;
use rollplex_plan::spec::{DType, ModelSpec};

use super::*;

const IMG: u32 = 290;
const VID: u32 = 291;
const VS: u32 = 288;
const VE: u32 = 289;
const EOS: u32 = 287;

pub(crate) fn tiny_spec(tie: bool) -> ModelSpec {
    TestModel {
        tie,
        ..TestModel::default()
    }
    .spec()
}

/// A model with random weights and random (non-zero) biases and norms, so every path counts.
fn tiny_model(tie: bool) -> Qwen25VL {
    perturbed(tiny_spec(tie))
}

/// `spec`'s random model (seed 5) with its zero biases and unit norms moved off 0 and 1.
pub(crate) fn perturbed(spec: ModelSpec) -> Qwen25VL {
    let mut m = Qwen25VL::random(spec, 5).unwrap();
    for (i, x) in m.weights.data.iter_mut().enumerate() {
        if *x == 0.0 || *x == 1.0 {
            *x += 0.05 * (((i * 2654435761) % 1000) as f32 / 500.0 - 1.0);
        }
    }
    m
}

fn pixels(n: usize, pd: usize, seed: u64) -> Vec<f32> {
    (0..n * pd)
        .map(|i| (((i as u64 + seed * 7919) * 2654435761 % 2000) as f32 / 1000.0) - 1.0)
        .collect()
}

/// A prompt with one image (grid 1x4x6 -> 6 tokens) and one video (grid 2x4x4 -> 8 tokens).
fn media_prompt(m: &Qwen25VL) -> (Vec<u32>, Vec<EncodedMedia>) {
    let pd = m.config.patch_dim();
    let img = pixels(24, pd, 1);
    let vid = pixels(32, pd, 2);
    let items = [
        MediaInput {
            kind: MediaKind::Image,
            pixels: &img,
            grid: [1, 4, 6],
        },
        MediaInput {
            kind: MediaKind::Video {
                second_per_grid_t: Some(1.0),
            },
            grid: [2, 4, 4],
            pixels: &vid,
        },
    ];
    let enc = m.encode_media(&items, None).unwrap();
    let mut ids = vec![5, 6, VS];
    ids.extend([IMG; 6]);
    ids.extend([VE, 7, VS]);
    ids.extend([VID; 8]);
    ids.extend([VE, 8, 9, 10]);
    (ids, enc)
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn vision_items_together_equal_alone_bitwise() {
    let m = tiny_model(false);
    let pd = m.config.patch_dim();
    let a = pixels(24, pd, 3);
    let b = pixels(64, pd, 4);
    let ia = MediaInput {
        kind: MediaKind::Image,
        pixels: &a,
        grid: [1, 4, 6],
    };
    let ib = MediaInput {
        kind: MediaKind::Video {
            second_per_grid_t: None,
        },
        pixels: &b,
        grid: [2, 8, 4],
    };
    let both = m.encode_media(&[ia, ib], None).unwrap();
    let ea = m.encode_media(&[ia], None).unwrap();
    let eb = m.encode_media(&[ib], None).unwrap();
    assert_eq!(both[0], ea[0]);
    assert_eq!(both[1], eb[0]);
    assert_eq!(both[1].embeds.len(), 16 * 48);
    assert!(both[0].embeds.iter().all(|x| x.is_finite()));
    let bad = MediaInput {
        kind: MediaKind::Image,
        pixels: &a[1..],
        grid: [1, 4, 6],
    };
    assert!(m.encode_media(&[bad], None).is_err());
}

#[test]
fn prefill_then_decode_equals_full_forward() {
    let m = tiny_model(false);
    let (ids, enc) = media_prompt(&m);
    let refs: Vec<&EncodedMedia> = enc.iter().collect();
    let response = [11u32, 12, 13, 14, 15];
    let mut full_ids = ids.clone();
    full_ids.extend(&response[..4]);
    let full = m
        .forward_logits(Prompt {
            ids: &full_ids,
            media: &refs,
        })
        .unwrap();
    let v = 300;
    let st = m
        .prefill(
            &[Prompt {
                ids: &ids,
                media: &refs,
            }],
            None,
        )
        .unwrap()
        .remove(0);
    let n = ids.len();
    assert_eq!(st.last_logits, full[(n - 1) * v..n * v].to_vec());
    let mut arena = KvArena::for_model(&m, 64);
    let span = arena.store_prefix(3, &st).unwrap();
    let mut slot = [DecodeSlot::new(span, st.rope_delta, 40, 10)];
    let mut logits = vec![0f32; v];
    for (j, &tok) in response[..4].iter().enumerate() {
        m.decode_step(&mut arena, &mut slot, &[tok], &mut logits)
            .unwrap();
        let want = &full[(n + j) * v..(n + j + 1) * v];
        assert!(
            max_abs(&logits, want) < 1e-5,
            "step {j}: {}",
            max_abs(&logits, want)
        );
        // the video's temporal step (2 * 1) stays below its spatial extent here, so positions
        // agree and the arithmetic is the same: bitwise equal
        assert_eq!(&logits[..], want, "step {j}");
    }
}

#[test]
fn shared_prefix_scoring_equals_full_forward_and_rollout() {
    let m = tiny_model(true);
    let (ids, enc) = media_prompt(&m);
    let refs: Vec<&EncodedMedia> = enc.iter().collect();
    let st = m
        .prefill(
            &[Prompt {
                ids: &ids,
                media: &refs,
            }],
            None,
        )
        .unwrap()
        .remove(0);
    let cfg = GenerateConfig {
        sampling: SamplingParams {
            temperature: 0.9,
            top_k: 50,
            top_p: 0.95,
        },
        max_new_tokens: 7,
        stop_ids: vec![EOS],
        seed: 42,
        iteration: 3,
    };
    let rolls = m.generate_group(&st, &[8, 9, 10, 11], &cfg).unwrap();
    let resp: Vec<&[u32]> = rolls.iter().map(|r| r.tokens.as_slice()).collect();
    let together = m.score(&st, &resp, 0.9, None).unwrap();
    for (i, r) in rolls.iter().enumerate() {
        // bitwise: rollout log-probs == scoring log-probs; group == one by one
        assert_eq!(together[i].logp, r.logp, "sample {i}");
        let alone = m.score(&st, &[r.tokens.as_slice()], 0.9, None).unwrap();
        assert_eq!(alone[0], together[i], "sample {i}");
        // against a full forward of prompt + response
        let mut full_ids = ids.clone();
        full_ids.extend(&r.tokens);
        let logits = m
            .forward_logits(Prompt {
                ids: &full_ids,
                media: &refs,
            })
            .unwrap();
        let n = ids.len();
        let l = r.tokens.len();
        let mut lp = vec![0f32; l];
        logprobs_fwd(
            &mut lp,
            None,
            None,
            &logits[(n - 1) * 300..(n - 1 + l) * 300],
            &r.tokens,
            l,
            300,
            0.9,
        )
        .unwrap();
        assert!(max_abs(&lp, &together[i].logp) < 1e-5, "sample {i}");
    }
}

#[test]
fn sampling_is_independent_of_group_composition() {
    let m = tiny_model(false);
    let ids = [1u32, 2, 3, 4, 5, 6];
    let st = m
        .prefill(
            &[Prompt {
                ids: &ids,
                media: &[],
            }],
            None,
        )
        .unwrap()
        .remove(0);
    let cfg = GenerateConfig {
        sampling: SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
        },
        max_new_tokens: 12,
        stop_ids: vec![EOS, 100, 101, 102],
        seed: 9,
        iteration: 0,
    };
    let group = m.generate_group(&st, &[0, 1, 2, 3, 4], &cfg).unwrap();
    let again = m.generate_group(&st, &[0, 1, 2, 3, 4], &cfg).unwrap();
    assert_eq!(group, again);
    let alone = m.generate_group(&st, &[3], &cfg).unwrap();
    assert_eq!(alone[0], group[3]);
    let reordered = m.generate_group(&st, &[4, 3], &cfg).unwrap();
    assert_eq!(reordered[1], group[3]);
    assert!(
        group.iter().any(|r| r.tokens != group[0].tokens),
        "samples differ from each other"
    );
    for r in &group {
        assert!(r.tokens.len() <= 12);
        if r.stop == StopReason::StopToken {
            assert!(cfg.stop_ids.contains(r.tokens.last().unwrap()));
        }
    }
    let next_iter = m
        .generate_group(
            &st,
            &[0],
            &GenerateConfig {
                iteration: 1,
                ..cfg.clone()
            },
        )
        .unwrap();
    assert_ne!(next_iter[0].tokens, group[0].tokens);
}

#[test]
fn batched_prefill_equals_single_prefill_bitwise() {
    let m = tiny_model(false);
    let (ids, enc) = media_prompt(&m);
    let refs: Vec<&EncodedMedia> = enc.iter().collect();
    let text = [3u32, 1, 4, 1, 5];
    let both = m
        .prefill(
            &[
                Prompt {
                    ids: &text,
                    media: &[],
                },
                Prompt {
                    ids: &ids,
                    media: &refs,
                },
            ],
            None,
        )
        .unwrap();
    let a = m
        .prefill(
            &[Prompt {
                ids: &text,
                media: &[],
            }],
            None,
        )
        .unwrap();
    let b = m
        .prefill(
            &[Prompt {
                ids: &ids,
                media: &refs,
            }],
            None,
        )
        .unwrap();
    assert_eq!(both[0], a[0]);
    assert_eq!(both[1], b[0]);
}

#[test]
fn forward_cache_keeps_layer_activations() {
    let m = tiny_model(false);
    let ids = [1u32, 2, 3, 4];
    let mut full = ForwardCache::new(CacheMode::Full);
    let st = m
        .prefill(
            &[Prompt {
                ids: &ids,
                media: &[],
            }],
            Some(&mut full),
        )
        .unwrap();
    assert_eq!(full.layers.len(), 2);
    assert_eq!(full.tokens, 4);
    let l0 = &full.layers[0];
    assert_eq!(l0.x_in.len(), 4 * 48);
    assert_eq!(l0.q.len(), 4 * 48);
    assert_eq!(l0.k, st[0].layer_k(0));
    assert_eq!(l0.act.len(), 4 * 64);
    // layer 1's input is layer 0's output
    assert_ne!(full.layers[1].x_in, l0.x_in);
    assert_eq!(full.final_out.len(), 4 * 48);
    let mut inputs = ForwardCache::new(CacheMode::LayerInputs);
    m.prefill(
        &[Prompt {
            ids: &ids,
            media: &[],
        }],
        Some(&mut inputs),
    )
    .unwrap();
    assert_eq!(inputs.layers[1].x_in, full.layers[1].x_in);
    assert!(inputs.layers[1].q.is_empty());
}

#[test]
fn decode_rejects_overlapping_or_full_slots() {
    let m = tiny_model(false);
    let st = m
        .prefill(
            &[Prompt {
                ids: &[1, 2, 3],
                media: &[],
            }],
            None,
        )
        .unwrap()
        .remove(0);
    let mut arena = KvArena::for_model(&m, 20);
    let span = arena.store_prefix(0, &st).unwrap();
    let mut logits = vec![0f32; 2 * 300];
    let mut slots = [
        DecodeSlot::new(span, 0, 3, 5),
        DecodeSlot::new(span, 0, 6, 5),
    ];
    let e = m
        .decode_step(&mut arena, &mut slots, &[1, 2], &mut logits)
        .unwrap_err();
    assert!(e.to_string().contains("overlap"), "{e}");
    let mut slots = [DecodeSlot::new(span, 0, 2, 5)];
    assert!(m
        .decode_step(&mut arena, &mut slots, &[1], &mut logits[..300])
        .is_err());
    let mut slots = [DecodeSlot {
        suffix_len: 5,
        ..DecodeSlot::new(span, 0, 3, 5)
    }];
    assert!(m
        .decode_step(&mut arena, &mut slots, &[1], &mut logits[..300])
        .is_err());
    assert!(arena.store_prefix(18, &st).is_err());
}

#[test]
fn checkpoint_round_trip_and_old_names() {
    let m = tiny_model(false);
    let dir = std::env::temp_dir().join(format!("rollplex-ckpt-{}", std::process::id()));
    save_checkpoint(&m, &dir, DType::F32).unwrap();
    let back = load_checkpoint(&dir).unwrap();
    assert_eq!(back.weights.data, m.weights.data);
    assert_eq!(back.config.spec.text, m.config.spec.text);
    assert_eq!(back.config.spec.vision, m.config.spec.vision);
    assert_eq!(back.config.spec.tokens, m.config.spec.tokens);
    save_checkpoint(&m, &dir, DType::Bf16).unwrap();
    let bf = load_checkpoint(&dir).unwrap();
    let e = max_abs(&bf.weights.data, &m.weights.data);
    assert!(e > 0.0 && e < 0.01, "bf16 round trip error {e}");
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(
        weights::canonical_name("visual.blocks.0.norm1.weight"),
        "model.visual.blocks.0.norm1.weight"
    );
    assert_eq!(
        weights::canonical_name("model.layers.3.mlp.up_proj.weight"),
        "model.language_model.layers.3.mlp.up_proj.weight"
    );
    assert_eq!(
        weights::canonical_name("model.embed_tokens.weight"),
        "model.language_model.embed_tokens.weight"
    );
    assert_eq!(weights::canonical_name("lm_head.weight"), "lm_head.weight");
    assert!(load_checkpoint(&std::env::temp_dir().join("rollplex-no-such-ckpt")).is_err());
}

/// A checkpoint whose `config.json` or weights are not regular files (`/dev/zero`, a FIFO no
/// one writes) is refused at once, naming the file, instead of filling memory or blocking.
#[test]
fn checkpoint_files_that_are_not_regular_are_refused() {
    use std::os::unix::fs::symlink;
    let m = tiny_model(false);
    let dir = std::env::temp_dir().join(format!("rollplex-ckpt-odd-{}", std::process::id()));
    save_checkpoint(&m, &dir, DType::F32).unwrap();
    let weights = dir.join("model.safetensors");
    std::fs::remove_file(&weights).unwrap();
    symlink("/dev/zero", &weights).unwrap();
    let e = load_checkpoint(&dir).unwrap_err().to_string();
    assert!(e.contains("model.safetensors"), "{e}");
    let config = dir.join("config.json");
    std::fs::remove_file(&config).unwrap();
    let fifo = std::ffi::CString::new(config.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path; mkfifo does not keep the pointer.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    let t = std::time::Instant::now();
    let e = load_checkpoint(&dir).unwrap_err().to_string();
    assert!(
        e.contains("config.json") && t.elapsed().as_secs() < 5,
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn random_init_is_deterministic_and_hf_like() {
    let spec = tiny_spec(false);
    let a = Qwen25VL::random(spec.clone(), 11).unwrap();
    let b = Qwen25VL::random(spec.clone(), 11).unwrap();
    let c = Qwen25VL::random(spec.clone(), 12).unwrap();
    assert_eq!(a.weights.data, b.weights.data);
    assert_ne!(a.weights.data, c.weights.data);
    let pc = spec.param_count();
    assert_eq!(a.weights.table.total() as u64, pc.total());
    let e = a.weights.get(a.weights.layout.embed);
    let mean = e.iter().map(|x| *x as f64).sum::<f64>() / e.len() as f64;
    let std = (e.iter().map(|x| (*x as f64 - mean).powi(2)).sum::<f64>() / e.len() as f64).sqrt();
    assert!(
        (std - 0.02).abs() < 0.001 && mean.abs() < 0.001,
        "std {std} mean {mean}"
    );
    assert!(a
        .weights
        .get(a.weights.layout.final_norm)
        .iter()
        .all(|x| *x == 1.0));
}

#[test]
fn one_rl_step_of_a_tiny_model_is_fast() {
    // encode + prefill + 4 samples x 32 tokens + scoring, on the CPU backend
    let m = tiny_model(false);
    let t0 = std::time::Instant::now();
    let (ids, enc) = media_prompt(&m);
    let refs: Vec<&EncodedMedia> = enc.iter().collect();
    let st = m
        .prefill(
            &[Prompt {
                ids: &ids,
                media: &refs,
            }],
            None,
        )
        .unwrap()
        .remove(0);
    let cfg = GenerateConfig {
        sampling: SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
        },
        max_new_tokens: 32,
        stop_ids: vec![],
        seed: 1,
        iteration: 0,
    };
    let rolls = m.generate_group(&st, &[0, 1, 2, 3], &cfg).unwrap();
    let resp: Vec<&[u32]> = rolls.iter().map(|r| r.tokens.as_slice()).collect();
    m.score(&st, &resp, 1.0, None).unwrap();
    let dt = t0.elapsed().as_secs_f64();
    assert!(dt < 2.0, "tiny rollout + scoring took {dt:.3} s");
}
