//! Communicator tests: rank-order reduction, every collective, and failures that must end every
//! rank's wait with an error naming the culprit (each test fails instead of hanging: it runs
//! under a watchdog).

use std::sync::mpsc;
use std::time::Duration;

use super::comm::*;
use super::TpError;

/// Runs `f` on another thread and fails the test if it takes longer than 20 s (a hang).
fn within<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(20))
        .expect("collectives hung (no result within 20 s)")
}

#[test]
fn all_reduce_sums_in_rank_order_and_equal_on_every_rank() {
    // f32: (1e8 + 1) + -1e8 = 0 (1 is absorbed), any other order that adds -1e8 first gives 1
    let out = within(|| {
        run_ranks(3, |c: &ThreadComm| -> Result<Vec<f32>, TpError> {
            let mut b = match c.rank() {
                0 => vec![1e8f32, 2.0],
                1 => vec![1.0, 3.0],
                _ => vec![-1e8, 4.0],
            };
            c.all_reduce_sum(&mut b)?;
            Ok(b)
        })
    })
    .unwrap();
    for r in &out {
        assert_eq!(r, &vec![0.0, 9.0]);
    }
    let max = within(|| {
        run_ranks(4, |c: &ThreadComm| -> Result<Vec<f64>, TpError> {
            let mut b = vec![c.rank() as f64, -(c.rank() as f64), f64::NAN];
            if c.rank() == 2 {
                b[2] = 7.0;
            }
            c.all_reduce(&mut b, ReduceOp::Max)?;
            Ok(b)
        })
    })
    .unwrap();
    for r in &max {
        assert_eq!(r, &vec![3.0, 0.0, 7.0]);
    }
}

#[test]
fn gather_broadcast_barrier_and_uneven_gather() {
    let out = within(|| {
        run_ranks(3, |c: &ThreadComm| -> Result<_, TpError> {
            let r = c.rank() as f32;
            let mut g = vec![0f32; 6];
            c.all_gather(&[r, 10.0 + r], &mut g)?;
            let mut b = vec![r; 2];
            c.broadcast(&mut b, 2)?;
            c.barrier()?;
            let counts = [1, 3, 2];
            let mine: Vec<f32> = (0..counts[c.rank()])
                .map(|i| 100.0 * r + i as f32)
                .collect();
            let u = all_gather_uneven(c, &mine, &counts)?;
            Ok((g, b, u))
        })
    })
    .unwrap();
    for (g, b, u) in &out {
        assert_eq!(g, &vec![0.0, 10.0, 1.0, 11.0, 2.0, 12.0]);
        assert_eq!(b, &vec![2.0, 2.0]);
        assert_eq!(u, &vec![0.0, 100.0, 101.0, 102.0, 200.0, 201.0]);
    }
}

#[test]
fn many_collectives_in_a_row_stay_in_step() {
    // fast ranks run ahead into the next collective while slow ones still read the last
    let out = within(|| {
        run_ranks(4, |c: &ThreadComm| -> Result<f32, TpError> {
            let mut acc = 0f32;
            for i in 0..500 {
                let mut b = [(c.rank() * 1000 + i) as f32];
                c.all_reduce_sum(&mut b)?;
                acc += b[0];
            }
            Ok(acc)
        })
    })
    .unwrap();
    let want: f32 = (0..500)
        .map(|i| (0..4).map(|r| (r * 1000 + i) as f32).sum::<f32>())
        .sum();
    assert!(out.iter().all(|&a| a == want), "{out:?} vs {want}");
}

#[test]
fn a_rank_that_errors_fails_the_others_with_its_rank() {
    let res = within(|| {
        run_ranks(3, |c: &ThreadComm| -> Result<(), TpError> {
            if c.rank() == 1 {
                return Err(TpError::Config("rank one's input is bad".into()));
            }
            let mut b = [1f32];
            c.all_reduce_sum(&mut b)?;
            c.barrier()?;
            Ok(())
        })
    });
    let e = res.unwrap_err();
    assert_eq!(e.rank, 1, "{e}");
    assert!(e.to_string().contains("rank one's input is bad"), "{e}");
    // the peers' own errors name rank 1
    let comms = ThreadComm::group(2).unwrap();
    let mut it = comms.into_iter();
    let (c0, c1) = (it.next().unwrap(), it.next().unwrap());
    let h = std::thread::spawn(move || {
        let mut b = [0f32];
        c0.all_reduce_sum(&mut b)
    });
    c1.abort("out of memory");
    let err = h.join().unwrap().unwrap_err();
    assert_eq!(
        err,
        CommError::PeerFailed {
            rank: 1,
            reason: "out of memory".into()
        }
    );
    assert_eq!(
        err.to_string(),
        "tensor-parallel rank 1 failed: out of memory"
    );
}

#[test]
fn a_rank_that_panics_fails_the_others_instead_of_hanging() {
    let res = within(|| {
        run_ranks(4, |c: &ThreadComm| -> Result<(), TpError> {
            let mut b = [1f32];
            c.all_reduce_sum(&mut b)?;
            if c.rank() == 2 {
                panic!("boom on two");
            }
            c.all_reduce_sum(&mut b)?;
            Ok(())
        })
    });
    let e = res.unwrap_err();
    assert_eq!(e.rank, 2, "{e}");
    let s = e.to_string();
    assert!(s.contains("panicked: boom on two"), "{s}");
    // a handle dropped while panicking (threads spawned by hand) fails the group too
    let mut comms = ThreadComm::group(2).unwrap();
    let c1 = comms.pop().unwrap();
    let c0 = comms.pop().unwrap();
    let h = std::thread::spawn(move || {
        let _c = c1;
        panic!("worker died");
    });
    assert!(h.join().is_err());
    let err = within(move || c0.barrier()).unwrap_err();
    assert_eq!(
        err,
        CommError::PeerFailed {
            rank: 1,
            reason: "panicked".into()
        }
    );
}

#[test]
fn a_rank_that_leaves_early_or_calls_another_collective_is_named() {
    let e = within(|| {
        run_ranks(3, |c: &ThreadComm| -> Result<(), TpError> {
            if c.rank() == 0 {
                return Ok(()); // forgets the collective
            }
            c.barrier()?;
            Ok(())
        })
    })
    .unwrap_err();
    assert!(
        matches!(
            e.error,
            TpError::Comm(CommError::PeerExited { rank: 0, .. })
        ),
        "{e}"
    );
    let e = within(|| {
        run_ranks(2, |c: &ThreadComm| -> Result<(), TpError> {
            let mut b = [0f32; 4];
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_millis(50));
                let mut g = [0f32; 8];
                c.all_gather(&b, &mut g)?;
            } else {
                c.all_reduce_sum(&mut b)?;
            }
            Ok(())
        })
    })
    .unwrap_err();
    let s = e.to_string();
    assert!(
        s.contains("rank 0 called all_reduce(Sum) of 4 f32, rank 1 called all_gather of 4 f32"),
        "{s}"
    );
}

#[test]
fn a_late_rank_times_out_the_group() {
    let comms = ThreadComm::group_with_timeout(2, Some(Duration::from_millis(100))).unwrap();
    let mut it = comms.into_iter();
    let (c0, c1) = (it.next().unwrap(), it.next().unwrap());
    let late = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(400));
        c1.barrier()
    });
    let err = within(move || c0.barrier()).unwrap_err();
    assert!(
        matches!(&err, CommError::Timeout { missing, .. } if missing == &vec![1]),
        "{err}"
    );
    let late_err = late.join().unwrap().unwrap_err();
    assert!(
        matches!(late_err, CommError::PeerFailed { rank: 1, .. }),
        "{late_err}"
    );
}

#[test]
fn bad_arguments_are_errors() {
    assert!(ThreadComm::group(0).is_err());
    let c = ThreadComm::group(1).unwrap().pop().unwrap();
    let mut g = [0f32; 3];
    assert!(matches!(
        c.all_gather(&[1.0], &mut g),
        Err(CommError::Invalid(_))
    ));
    assert!(matches!(c.broadcast(&mut g, 1), Err(CommError::Invalid(_))));
    // a single rank: collectives are the identity
    let mut b = [1.5f32, -2.0];
    c.all_reduce_sum(&mut b).unwrap();
    assert_eq!(b, [1.5, -2.0]);
}

// ---- backward of the text decoder under TP ----

mod grads {
    use std::sync::Arc;

    use rollplex_kernels::cpu::{
        embedding_bwd, linear_bwd, linear_fwd, logprobs_bwd, logprobs_fwd, rmsnorm_bwd, AttnDims,
        AttnMask,
    };

    use crate::model::{CacheMode, ForwardCache, Prompt, Qwen25VL, Weights};
    use crate::tp::{run_ranks, Communicator, ThreadComm, TpError, TpModel, TpPlan};
    use crate::train::block_bwd::{block_bwd, grad_of, BlockCtx};

    /// The model tests' tiny config with 4 vision heads (so TP=4 splits the tower): 4 query
    /// heads, 2 kv heads (replicated at TP=4), vocab 300.
    fn tiny() -> Qwen25VL {
        let mut s = crate::model::tests::tiny_spec(false);
        s.vision.num_heads = 4;
        crate::model::tests::perturbed(s)
    }

    const SEQS: [&[u32]; 3] = [
        &[1, 2, 3, 4, 5, 6, 7],
        &[9, 8, 7, 6, 5],
        &[100, 200, 299, 3],
    ];
    const TEMP: f32 = 0.8;

    fn dlogp(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| {
                if i % 3 == 0 {
                    -0.3
                } else {
                    0.1 + 0.02 * i as f32
                }
            })
            .collect()
    }

    /// The single-rank gradient of `Σ dlogp · logp`: the model's prefill with a full cache, the
    /// kernels' head backward and the trainer's `block_bwd`.
    fn reference(m: &Qwen25VL) -> (Vec<f32>, Vec<f32>) {
        let w = &m.weights;
        let lay = &w.layout;
        let t = m.config.text();
        let (h, v) = (t.hidden_size as usize, t.vocab_size as usize);
        let prompts: Vec<Prompt<'_>> = SEQS
            .iter()
            .map(|s| Prompt {
                ids: &s[..s.len() - 1],
                media: &[],
            })
            .collect();
        let mut c = ForwardCache::new(CacheMode::Full);
        m.prefill(&prompts, Some(&mut c)).unwrap();
        let targets: Vec<u32> = SEQS.iter().flat_map(|s| s[1..].to_vec()).collect();
        let rows = c.tokens;
        let dl = dlogp(rows);
        let mut logits = vec![0f32; rows * v];
        linear_fwd(
            &mut logits,
            &c.final_out,
            w.get(lay.lm_head),
            None,
            rows,
            h,
            v,
        )
        .unwrap();
        let mut logp = vec![0f32; rows];
        logprobs_fwd(&mut logp, None, None, &logits, &targets, rows, v, TEMP).unwrap();
        let mut dlogits = vec![0f32; rows * v];
        logprobs_bwd(&mut dlogits, &dl, None, &logits, &targets, rows, v, TEMP).unwrap();
        let mut g = vec![0f32; w.table.total()];
        let mut dxn = vec![0f32; rows * h];
        linear_bwd(
            Some(&mut dxn),
            Some(grad_of(w, &mut g, lay.lm_head)),
            None,
            &dlogits,
            &c.final_out,
            w.get(lay.lm_head),
            rows,
            h,
            v,
            false,
        )
        .unwrap();
        let mut dx = vec![0f32; rows * h];
        rmsnorm_bwd(
            &mut dx,
            Some(grad_of(w, &mut g, lay.final_norm)),
            &dxn,
            &c.final_in,
            w.get(lay.final_norm),
            &c.final_rstd,
            rows,
            h,
            false,
        )
        .unwrap();
        let dims = AttnDims {
            num_heads: t.num_heads as usize,
            num_kv_heads: t.num_kv_heads as usize,
            head_dim: t.head_dim() as usize,
        };
        for l in (0..lay.text_layers.len()).rev() {
            let ctx = BlockCtx {
                seqs: &c.seqs,
                mask: AttnMask::Causal,
                prefix_k: &[],
                prefix_v: &[],
                cos: &c.cos,
                sin: &c.sin,
                dims,
                eps: t.rms_norm_eps as f32,
            };
            dx = block_bwd(
                &crate::tp::SoloComm,
                w,
                &lay.text_layers[l],
                &c.layers[l],
                rows,
                &ctx,
                &dx,
                None,
                None,
                Some(&mut g),
            )
            .unwrap();
        }
        embedding_bwd(grad_of(w, &mut g, lay.embed), &dx, &c.ids, h).unwrap();
        (logp, g)
    }

    /// Log-probs and the full (unsharded) gradient of a TP run.
    fn run(m: &Qwen25VL, degree: usize) -> (Vec<f32>, Vec<f32>) {
        run_onto(m, degree, 0.0)
    }

    /// As [`run`], with every gradient buffer starting at `start` (gradients are added).
    fn run_onto(m: &Qwen25VL, degree: usize, start: f32) -> (Vec<f32>, Vec<f32>) {
        let plan = Arc::new(TpPlan::new(&m.config, degree).unwrap());
        let ranks: Vec<TpModel> = (0..degree)
            .map(|r| TpModel::shard(Arc::clone(&plan), &m.weights, r).unwrap())
            .collect();
        let n: usize = SEQS.iter().map(|s| s.len() - 1).sum();
        let dl = dlogp(n);
        let outs = run_ranks(degree, |c: &ThreadComm| -> Result<_, TpError> {
            let r = &ranks[c.rank()];
            let mut g = vec![start; r.weights.table.total()];
            let lp = r
                .as_rank()
                .text_forward_backward(c, &SEQS, &dl, TEMP, &mut g)?;
            Ok((lp, g))
        })
        .unwrap();
        for o in &outs[1..] {
            assert_eq!(o.0, outs[0].0, "log-probs differ between ranks");
        }
        let shards: Vec<Weights> = outs
            .iter()
            .zip(&ranks)
            .map(|((_, g), r)| Weights {
                table: r.weights.table.clone(),
                layout: r.weights.layout.clone(),
                data: g.clone(),
            })
            .collect();
        // unshard also checks that replicated gradients agree bitwise across ranks
        let full = plan.unshard(&shards).unwrap();
        (outs[0].0.clone(), full.data)
    }

    #[test]
    fn tp_text_gradients_match_single_rank() {
        let m = tiny();
        let (lp0, g0) = reference(&m);
        let gmax = g0.iter().fold(0f32, |a, x| a.max(x.abs()));
        assert!(gmax > 0.0);
        let text0 = m.weights.table.entry(m.weights.layout.embed).offset;
        for t in [1, 2, 4] {
            let (lp, g) = run(&m, t);
            let elp = lp
                .iter()
                .zip(&lp0)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            let eg = g
                .iter()
                .zip(&g0)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            println!(
                "TP={t}: log-probs max abs error {elp:.3e}; gradients max abs error {eg:.3e} \
                 (max |grad| {gmax:.3e})"
            );
            // the vision tower and merger get no gradient from a text-only batch
            assert!(g[..text0].iter().all(|&x| x == 0.0));
            if t == 1 {
                assert_eq!(
                    lp, lp0,
                    "TP=1 log-probs must be bitwise the single-rank ones"
                );
                assert_eq!(g, g0, "TP=1 gradients must be bitwise the single-rank ones");
            }
            assert!(elp <= 2e-5, "TP={t}: log-prob error {elp}");
            assert!(
                eg <= 1e-4 * gmax,
                "TP={t}: gradient error {eg} vs max {gmax}"
            );
        }
        // two TP=2 runs are bitwise equal
        assert_eq!(run(&m, 2), run(&m, 2));
        // gradients are added to what the buffer holds, replicated kv heads included (their
        // replica sum must not count the previous contents twice)
        let (_, g) = run_onto(&m, 4, 0.25);
        let e = g
            .iter()
            .zip(&g0)
            .map(|(a, b)| (a - 0.25 - b).abs())
            .fold(0.0, f32::max);
        assert!(e <= 1e-4 * gmax, "TP=4 onto 0.25: error {e}");
    }

    fn pixels(n: usize, pd: usize, seed: u64) -> Vec<f32> {
        (0..n * pd)
            .map(|i| (((i as u64 + seed * 7919) * 2654435761 % 2000) as f32 / 1000.0) - 1.0)
            .collect()
    }

    #[test]
    fn tp_vision_gradients_match_single_rank() {
        use crate::model::{MediaInput, MediaKind, VisionCache};
        use crate::train::backward::vision_backward;
        use crate::train::{GroupBatch, LossConfig, TrainConfig};
        use rollplex_plan::spec::{KlEstimator, LossAgg};

        let m = tiny();
        let pd = m.config.patch_dim();
        let (img, vid) = (pixels(24, pd, 1), pixels(32, pd, 2));
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
                pixels: &vid,
                grid: [2, 4, 4],
            },
        ];
        // the single-rank trainer's merger + tower backward
        let mut vc = VisionCache::new(CacheMode::Full);
        let enc = m.encode_media(&items, Some(&mut vc)).unwrap();
        let n_emb: usize = enc.iter().map(|e| e.embeds.len()).sum();
        let d: Vec<f32> = (0..n_emb)
            .map(|i| ((i * 37 % 101) as f32 / 101.0 - 0.5) * 0.1)
            .collect();
        let cfg = TrainConfig {
            loss: LossConfig {
                clip_low: 0.2,
                clip_high: 0.2,
                dual_clip: None,
                kl_coef: 0.0,
                kl_estimator: KlEstimator::K3,
                agg: LossAgg::TokenMean,
                ratio: rollplex_plan::spec::RatioLevel::Token,
                horizon: 0,
            },
            kept_layers: usize::MAX,
            kept_prompt_layers: usize::MAX,
            freeze_vision: false,
            freeze_merger: false,
            temperature: 1.0,
        };
        let batch = GroupBatch {
            prompt_ids: &[],
            media: &items,
            responses: &[],
        };
        let mut g0 = vec![0f32; m.weights.table.total()];
        vision_backward(&m, &cfg, &batch, &vc, &d, &mut g0).unwrap();
        let gmax = g0.iter().fold(0f32, |a, x| a.max(x.abs()));
        assert!(gmax > 0.0);
        let text0 = m.weights.table.entry(m.weights.layout.embed).offset;
        let mut last = None;
        for t in [1, 2, 4, 2] {
            let plan = Arc::new(TpPlan::new(&m.config, t).unwrap());
            let ranks: Vec<TpModel> = (0..t)
                .map(|r| TpModel::shard(Arc::clone(&plan), &m.weights, r).unwrap())
                .collect();
            let outs = run_ranks(t, |c: &ThreadComm| -> Result<_, TpError> {
                let r = &ranks[c.rank()];
                let mut g = vec![0f32; r.weights.table.total()];
                let e = r.as_rank().vision_forward_backward(c, &items, &d, &mut g)?;
                Ok((e, g))
            })
            .unwrap();
            let shards: Vec<Weights> = outs
                .iter()
                .zip(&ranks)
                .map(|((_, g), r)| Weights {
                    table: r.weights.table.clone(),
                    layout: r.weights.layout.clone(),
                    data: g.clone(),
                })
                .collect();
            let g = plan.unshard(&shards).unwrap().data;
            let ee = outs[0]
                .0
                .iter()
                .zip(&enc)
                .flat_map(|(a, b)| a.embeds.iter().zip(&b.embeds).map(|(x, y)| (x - y).abs()))
                .fold(0.0, f32::max);
            let eg = g
                .iter()
                .zip(&g0)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            println!(
                "vision TP={t}: embeddings max abs error {ee:.3e}; gradients max abs error \
                 {eg:.3e} (max |grad| {gmax:.3e})"
            );
            assert!(g[text0..].iter().all(|&x| x == 0.0), "text got a gradient");
            if t == 1 {
                assert_eq!(g, g0, "TP=1 vision gradients must be bitwise the trainer's");
            }
            assert!(
                eg <= 1e-4 * gmax,
                "TP={t}: gradient error {eg} vs max {gmax}"
            );
            if t == 2 {
                // the second TP=2 run is bitwise the first
                if let Some(prev) = last.replace(g.clone()) {
                    assert_eq!(prev, g, "two TP=2 runs differ");
                }
            }
        }
    }

    #[test]
    fn tp_training_step_matches_single_rank_trainer() {
        use crate::model::{MediaInput, MediaKind};
        use crate::train::{
            forward_backward, GroupBatch, LossConfig, Normaliser, ResponseBatch, TrainConfig,
        };
        use rollplex_plan::spec::{KlEstimator, LossAgg};

        let m = tiny();
        let tk = m.config.spec.tokens.clone();
        let pd = m.config.patch_dim();
        let (img, vid) = (pixels(24, pd, 1), pixels(32, pd, 2));
        let media = [
            MediaInput {
                kind: MediaKind::Image,
                pixels: &img,
                grid: [1, 4, 6],
            },
            MediaInput {
                kind: MediaKind::Video {
                    second_per_grid_t: Some(1.0),
                },
                pixels: &vid,
                grid: [2, 4, 4],
            },
        ];
        let mut prompt = vec![5, 6, tk.vision_start_token_id];
        prompt.extend([tk.image_token_id; 6]);
        prompt.extend([tk.vision_end_token_id, 7, tk.vision_start_token_id]);
        prompt.extend([tk.video_token_id; 8]);
        prompt.extend([tk.vision_end_token_id, 8, 9, 10]);
        let toks: [&[u32]; 3] = [&[11, 12, 13, 14, 15], &[20, 21], &[30]];
        let old: Vec<Vec<f32>> = toks
            .iter()
            .map(|t| (0..t.len()).map(|j| -5.0 - 0.1 * j as f32).collect())
            .collect();
        let adv: Vec<Vec<f32>> = [0.8f32, -0.5, 0.3]
            .iter()
            .zip(&toks)
            .map(|(a, t)| vec![*a; t.len()])
            .collect();
        let masks: Vec<Vec<bool>> = toks
            .iter()
            .map(|t| (0..t.len()).map(|j| j != 2).collect())
            .collect();
        let responses: Vec<ResponseBatch<'_>> = (0..3)
            .map(|i| ResponseBatch {
                tokens: toks[i],
                old_logp: Some(&old[i]),
                ref_logp: None,
                advantages: &adv[i],
                mask: &masks[i],
            })
            .collect();
        let groups = [GroupBatch {
            prompt_ids: &prompt,
            media: &media,
            responses: &responses,
        }];
        let cfg = TrainConfig {
            loss: LossConfig {
                clip_low: 0.2,
                clip_high: 0.28,
                dual_clip: Some(3.0),
                kl_coef: 0.0,
                kl_estimator: KlEstimator::K3,
                agg: LossAgg::TokenMean,
                ratio: rollplex_plan::spec::RatioLevel::Token,
                horizon: 0,
            },
            kept_layers: usize::MAX,
            kept_prompt_layers: usize::MAX,
            freeze_vision: false,
            freeze_merger: false,
            temperature: 0.9,
        };
        let norm = Normaliser { tokens: 7, seqs: 3 };
        let mut g0 = vec![0f32; m.weights.table.total()];
        let out0 = forward_backward(&m, &cfg, &groups, norm, &mut g0).unwrap();
        let gmax = g0.iter().fold(0f32, |a, x| a.max(x.abs()));
        assert!(gmax > 0.0);
        // then one AdamW step with an active global clip
        let spec = rollplex_plan::spec::AdamWSpec {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            grad_clip: 0.05,
            lr_schedule: rollplex_plan::spec::LrSchedule::Constant,
        };
        let mut w0 = m.weights.data.clone();
        let table = crate::train::OptTable::from_model(&m.weights.table, |_| true).unwrap();
        let mut opt = crate::train::AdamW::new(spec.clone(), table, &w0).unwrap();
        let rep0 = opt.step_f32(&mut g0.clone(), &mut w0).unwrap();
        assert!(rep0.grad_norm > spec.grad_clip, "the clip must be active");
        for t in [1, 2, 4] {
            let plan = Arc::new(TpPlan::new(&m.config, t).unwrap());
            let ranks: Vec<TpModel> = (0..t)
                .map(|r| TpModel::shard(Arc::clone(&plan), &m.weights, r).unwrap())
                .collect();
            let outs = run_ranks(t, |c: &ThreadComm| -> Result<_, TpError> {
                let r = &ranks[c.rank()];
                let mut g = vec![0f32; r.weights.table.total()];
                let o = r
                    .as_rank()
                    .forward_backward(c, &cfg, &groups, norm, &mut g)?;
                let mut stepped = r.clone();
                let mut opt = crate::tp::TpAdamW::new(&stepped, spec.clone(), |_| true)?;
                let rep = opt.step(c, &mut stepped, &mut g.clone())?;
                Ok((o, g, stepped.weights, rep))
            })
            .unwrap();
            let stepped: Vec<Weights> = outs.iter().map(|o| o.2.clone()).collect();
            // replicated parameters are still bitwise equal on every rank (unshard checks)
            let w = plan.unshard(&stepped).unwrap().data;
            let ew = w
                .iter()
                .zip(&w0)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            let moved = w
                .iter()
                .zip(&w0)
                .filter(|(a, b)| (*a - *b).abs() > 1e-6)
                .count();
            let rep = outs[0].3;
            println!(
                "adamw TP={t}: grad norm {:.9e} vs {:.9e}; weights max abs error {ew:.3e}, \
                 {moved} of {} elements differ by more than 1e-6 (lr {})",
                rep.grad_norm,
                rep0.grad_norm,
                w.len(),
                spec.lr
            );
            assert!(
                outs.iter().all(|o| o.3 == rep),
                "ranks report different steps"
            );
            assert!((rep.grad_norm - rep0.grad_norm).abs() <= 1e-6 * rep0.grad_norm);
            if t == 1 {
                assert_eq!(rep, rep0);
                assert_eq!(w, w0, "TP=1 AdamW step must be bitwise the single-rank one");
            }
            // Adam's first step moves an element by at most lr (plus decay), whatever its
            // gradient: a gradient within rounding of 0 may flip sign, nothing can differ more
            assert!(
                ew <= 2.0 * spec.lr as f32 + 1e-6,
                "TP={t}: weights differ by {ew}"
            );
            assert!(
                moved * 1000 <= w.len(),
                "TP={t}: {moved} weights differ by > 1e-6"
            );
            for o in &outs[1..] {
                assert_eq!(o.0, outs[0].0, "TP={t}: ranks report different outputs");
            }
            let shards: Vec<Weights> = outs
                .iter()
                .zip(&ranks)
                .map(|(o, r)| Weights {
                    table: r.weights.table.clone(),
                    layout: r.weights.layout.clone(),
                    data: o.1.clone(),
                })
                .collect();
            let g = plan.unshard(&shards).unwrap().data;
            let o = &outs[0].0;
            let lp: Vec<f32> = o.logp.iter().flatten().copied().collect();
            let lp0: Vec<f32> = out0.logp.iter().flatten().copied().collect();
            let elp = lp
                .iter()
                .zip(&lp0)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            let eg = g
                .iter()
                .zip(&g0)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            println!(
                "train step TP={t}: log-probs max abs error {elp:.3e}; gradients max abs error \
                 {eg:.3e} (max |grad| {gmax:.3e}); loss {:?} vs {:?}",
                o.metrics, out0.metrics
            );
            if t == 1 {
                assert_eq!(o, &out0, "TP=1 step output must be bitwise the trainer's");
                assert_eq!(g, g0, "TP=1 step gradients must be bitwise the trainer's");
            }
            assert!(elp <= 2e-5, "TP={t}: log-prob error {elp}");
            assert!(
                eg <= 1e-4 * gmax,
                "TP={t}: gradient error {eg} vs max {gmax}"
            );
        }
    }

    /// `freeze_vision` / `freeze_merger` and the KL term under TP: one GRPO group (image + video
    /// prompt, 3 responses, reference log-probs, kl_coef 0.05) against `train::forward_backward`
    /// with the same freezing, at TP 1, 2, 4. A frozen part gets no gradient on any rank, and
    /// `TpAdamW` over the trainable tensors leaves it unchanged.
    #[test]
    fn tp_frozen_parts_and_kl_match_single_rank() {
        use crate::model::{MediaInput, MediaKind};
        use crate::train::{
            forward_backward, GroupBatch, LossConfig, Normaliser, ResponseBatch, TrainConfig,
        };
        use rollplex_plan::spec::{KlEstimator, LossAgg};

        let m = tiny();
        let tk = m.config.spec.tokens.clone();
        let pd = m.config.patch_dim();
        let (img, vid) = (pixels(24, pd, 3), pixels(32, pd, 4));
        let media = [
            MediaInput {
                kind: MediaKind::Image,
                pixels: &img,
                grid: [1, 4, 6],
            },
            MediaInput {
                kind: MediaKind::Video {
                    second_per_grid_t: Some(0.5),
                },
                pixels: &vid,
                grid: [2, 4, 4],
            },
        ];
        let mut prompt = vec![4, tk.vision_start_token_id];
        prompt.extend([tk.image_token_id; 6]);
        prompt.extend([tk.vision_end_token_id, tk.vision_start_token_id]);
        prompt.extend([tk.video_token_id; 8]);
        prompt.extend([tk.vision_end_token_id, 17]);
        let toks: [&[u32]; 3] = [&[40, 41, 42, 43], &[50, 51, 52], &[60, 61]];
        let lps = |base: f32| -> Vec<Vec<f32>> {
            toks.iter()
                .map(|t| (0..t.len()).map(|j| base - 0.07 * j as f32).collect())
                .collect()
        };
        let (old, refl) = (lps(-5.6), lps(-5.8));
        let adv: Vec<Vec<f32>> = [0.6f32, -0.9, 0.3]
            .iter()
            .zip(&toks)
            .map(|(a, t)| vec![*a; t.len()])
            .collect();
        let mask: Vec<Vec<bool>> = toks.iter().map(|t| vec![true; t.len()]).collect();
        let responses: Vec<ResponseBatch<'_>> = (0..3)
            .map(|i| ResponseBatch {
                tokens: toks[i],
                old_logp: Some(&old[i]),
                ref_logp: Some(&refl[i]),
                advantages: &adv[i],
                mask: &mask[i],
            })
            .collect();
        let groups = [GroupBatch {
            prompt_ids: &prompt,
            media: &media,
            responses: &responses,
        }];
        let norm = Normaliser { tokens: 9, seqs: 3 };
        let spec = rollplex_plan::spec::AdamWSpec {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            grad_clip: 1.0,
            lr_schedule: rollplex_plan::spec::LrSchedule::Constant,
        };
        for (freeze_vision, freeze_merger) in [(true, true), (true, false), (false, true)] {
            let cfg = TrainConfig {
                loss: LossConfig {
                    clip_low: 0.2,
                    clip_high: 0.2,
                    dual_clip: None,
                    kl_coef: 0.05,
                    kl_estimator: KlEstimator::K3,
                    agg: LossAgg::TokenMean,
                    ratio: rollplex_plan::spec::RatioLevel::Token,
                    horizon: 0,
                },
                kept_layers: usize::MAX,
                kept_prompt_layers: usize::MAX,
                freeze_vision,
                freeze_merger,
                temperature: 1.0,
            };
            let what = format!("freeze_vision {freeze_vision}, freeze_merger {freeze_merger}");
            let mut g0 = vec![0f32; m.weights.table.total()];
            let out0 = forward_backward(&m, &cfg, &groups, norm, &mut g0).unwrap();
            assert!(out0.metrics.kl != 0.0, "{what}: the KL term must count");
            let gmax = g0.iter().fold(0f32, |a, x| a.max(x.abs()));
            // which elements of the full table are frozen
            let frozen: Vec<bool> = {
                let mut f = vec![false; m.weights.table.total()];
                for e in m.weights.table.entries() {
                    if !cfg.trainable(&e.name) {
                        f[e.offset..e.offset + e.len].fill(true);
                    }
                }
                f
            };
            assert!(frozen.iter().any(|&f| f) && frozen.iter().any(|&f| !f));
            assert!(
                g0.iter().zip(&frozen).all(|(g, f)| !f || *g == 0.0),
                "{what}: the single-rank trainer gave a frozen part a gradient"
            );
            for t in [1, 2, 4] {
                let plan = Arc::new(TpPlan::new(&m.config, t).unwrap());
                let ranks: Vec<TpModel> = (0..t)
                    .map(|r| TpModel::shard(Arc::clone(&plan), &m.weights, r).unwrap())
                    .collect();
                let outs = run_ranks(t, |c: &ThreadComm| -> Result<_, TpError> {
                    let r = &ranks[c.rank()];
                    let mut g = vec![0f32; r.weights.table.total()];
                    let o = r
                        .as_rank()
                        .forward_backward(c, &cfg, &groups, norm, &mut g)?;
                    let mut stepped = r.clone();
                    let mut opt =
                        crate::tp::TpAdamW::new(&stepped, spec.clone(), |n| cfg.trainable(n))?;
                    opt.step(c, &mut stepped, &mut g.clone())?;
                    Ok((o, g, stepped.weights))
                })
                .unwrap();
                let as_weights = |data: &dyn Fn(usize) -> Vec<f32>| -> Vec<Weights> {
                    ranks
                        .iter()
                        .enumerate()
                        .map(|(i, r)| Weights {
                            table: r.weights.table.clone(),
                            layout: r.weights.layout.clone(),
                            data: data(i),
                        })
                        .collect()
                };
                let g = plan
                    .unshard(&as_weights(&|i| outs[i].1.clone()))
                    .unwrap()
                    .data;
                let w = plan
                    .unshard(&as_weights(&|i| outs[i].2.data.clone()))
                    .unwrap()
                    .data;
                assert!(
                    g.iter().zip(&frozen).all(|(g, f)| !f || *g == 0.0),
                    "TP={t}, {what}: a frozen part got a gradient"
                );
                // the trained part of the tower (if any) did get one
                let visual = m
                    .weights
                    .table
                    .entries()
                    .iter()
                    .filter(|e| e.name.starts_with("model.visual.") && cfg.trainable(&e.name));
                let trained: Vec<f32> = visual
                    .flat_map(|e| g[e.offset..e.offset + e.len].iter().copied())
                    .collect();
                assert_eq!(
                    trained.iter().any(|&x| x != 0.0),
                    !(freeze_vision && freeze_merger),
                    "TP={t}, {what}: the trained part of the tower got no gradient"
                );
                assert!(
                    w.iter()
                        .zip(&m.weights.data)
                        .zip(&frozen)
                        .all(|((a, b), f)| !f || a.to_bits() == b.to_bits()),
                    "TP={t}, {what}: the optimizer moved a frozen weight"
                );
                let eg = g
                    .iter()
                    .zip(&g0)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f32::max);
                let o = &outs[0].0;
                println!(
                    "TP={t}, {what}: gradients max abs error {eg:.3e} (max |grad| {gmax:.3e}); \
                     kl {:.6e} vs {:.6e}",
                    o.metrics.kl, out0.metrics.kl
                );
                if t == 1 {
                    assert_eq!(
                        o, &out0,
                        "TP=1, {what}: output must be bitwise the trainer's"
                    );
                    assert_eq!(
                        g, g0,
                        "TP=1, {what}: gradients must be bitwise the trainer's"
                    );
                }
                assert!(eg <= 1e-4 * gmax, "TP={t}, {what}: gradient error {eg}");
                assert!(
                    (o.metrics.loss - out0.metrics.loss).abs() <= 1e-5 * out0.metrics.loss.abs(),
                    "TP={t}, {what}: loss {} vs {}",
                    o.metrics.loss,
                    out0.metrics.loss
                );
            }
        }
    }
}
