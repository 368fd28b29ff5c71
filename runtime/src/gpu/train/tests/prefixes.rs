//! The kept prompt forwards on CUDA (`TrainPrefixes`): trained through as the self-contained
//! step is, and, where the plan takes them from the rollout's prefill, giving decode the
//! prefill's state bitwise.

use super::*;

/// The kept-prompt path as the executor drives it: one store for the iteration with the groups
/// at other store positions than their micro-batch order, filled by `prefix_forward`, then
/// `micro_batch_prefixed`, gives bitwise the gradient of the self-contained `micro_batch` (the
/// same launches on the same shapes); one prompt copy per response (no prefix dedup) gives the
/// same gradient up to rounding; a kept prompt from before an optimizer step is refused.
#[test]
fn kept_prompt_forwards_train_as_the_self_contained_step() {
    kept_prompts(train_cfg());
}

/// [`kept_prompt_forwards_train_as_the_self_contained_step`] with the tower and merger trained
/// (the media rows' gradients summed over the copies into one vision backward per prompt).
#[test]
fn kept_prompt_forwards_train_the_tower_as_the_self_contained_step() {
    kept_prompts(vision_cfg(false, false));
}

fn kept_prompts(cfg: TrainConfig) {
    let Some(gpu) = gpu_or_skip() else { return };
    let s = gpu.stream(0).unwrap();
    let m = model(false);
    let groups = two_groups(&m);
    let norm = norm_of(&groups);
    let resp: Vec<_> = groups.iter().map(|g| g.responses()).collect();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    // self-contained
    let mut a = GpuTrainer::new(&gpu, &s, &m, cfg.clone(), adamw(1e-3)).unwrap();
    let vision = a.trains_vision();
    let media: Vec<_> = groups.iter().map(|g| g.media()).collect();
    let enc: Vec<Vec<GpuEncodedMedia>> = groups
        .iter()
        .map(|g| a.model().encode_media(&gpu, &s, &g.media()).unwrap())
        .collect();
    let refs: Vec<Vec<&GpuEncodedMedia>> = enc.iter().map(|e| e.iter().collect()).collect();
    let pm = |i: usize| {
        if vision {
            PromptMedia::Raw(&media[i])
        } else {
            PromptMedia::Encoded(&refs[i])
        }
    };
    let batch: Vec<GpuGroupBatch<'_>> = groups
        .iter()
        .enumerate()
        .map(|(i, g)| GpuGroupBatch {
            prompt_ids: &g.prompt,
            media: pm(i),
            responses: &resp[i],
        })
        .collect();
    let out_a = a.micro_batch(&gpu, &s, 0, &batch, norm).unwrap();
    let grad_a = a.grads_host(&s).unwrap();
    // kept prompts, one shared copy per group; store order reversed (group i at store 2 - i,
    // a third, unused group in between)
    let run_kept = |copies: u32| {
        let mut t = GpuTrainer::new(&gpu, &s, &m, cfg.clone(), adamw(1e-3)).unwrap();
        let lens = [
            (groups[1].prompt.len(), copies),
            (7, copies),
            (groups[0].prompt.len(), copies),
        ];
        let mut store = TrainPrefixes::new(&gpu, &s, t.model(), &lens).unwrap();
        assert_eq!(store.groups(), 3);
        for (i, at) in [(0usize, 2usize), (1, 0)] {
            t.prefix_forward(&gpu, &s, &mut store, at, &groups[i].prompt, pm(i))
                .unwrap();
        }
        // a prompt of another length than the store's rows is refused
        assert!(t
            .prefix_forward(&gpu, &s, &mut store, 1, &groups[0].prompt, pm(0))
            .is_err());
        let kept = [
            PrefixedGroup {
                group: 2,
                responses: &resp[0],
            },
            PrefixedGroup {
                group: 0,
                responses: &resp[1],
            },
        ];
        // a group whose prompt never ran is refused
        let missing = [PrefixedGroup {
            group: 1,
            responses: &resp[0],
        }];
        assert!(t
            .micro_batch_prefixed(&gpu, &s, 0, &missing, norm, &store)
            .is_err());
        let out = t
            .micro_batch_prefixed(&gpu, &s, 0, &kept, norm, &store)
            .unwrap();
        let grad = t.grads_host(&s).unwrap();
        t.optimizer_step(&gpu, &s).unwrap();
        // the weights moved: the kept prompts are stale now
        let stale = t.micro_batch_prefixed(&gpu, &s, 0, &kept, norm, &store);
        assert!(
            matches!(stale, Err(GpuTrainError::Train(_))),
            "stale prefix accepted"
        );
        (out, grad)
    };
    let (out_b, grad_b) = run_kept(1);
    assert!(
        bits(&grad_a) == bits(&grad_b),
        "kept prompts in a shared store changed the gradient's bits"
    );
    assert_eq!(out_a.logp, out_b.logp);
    assert_eq!(out_a.metrics.loss.to_bits(), out_b.metrics.loss.to_bits());
    // one prompt copy per response: the same sum up to rounding
    let (out_c, grad_c) = run_kept(3);
    let errs = tensor_errors(&m, &cfg, &grad_c, &grad_b);
    // judged against 1% of the largest tensor's norm, as `gradients_match` does
    let floor = 1e-2 * errs.iter().map(|e| e.2).fold(0.0, f64::max);
    let worst = errs
        .iter()
        .map(|(_, e, n)| e * n / n.max(floor))
        .fold(0.0, f64::max);
    let lp: f64 = out_c
        .logp
        .iter()
        .flatten()
        .zip(out_b.logp.iter().flatten())
        .map(|(x, y)| (*x as f64 - *y as f64).abs())
        .fold(0.0, f64::max);
    println!("vision {vision}: copies 3 vs 1: worst tensor {worst:.3e}, max |dlogp| {lp:.3e}");
    assert!(
        worst < 2e-2,
        "a copy per response moved a gradient by {worst}"
    );
    assert!(lp < 1e-2, "a copy per response moved a log-prob by {lp}");
}

/// A plan whose prefill keeps the training prompt forwards (`TrainPrefixSource::Rollout`) gives
/// decode the state `prefix_state` derives from the kept forward: bitwise the prefill's (every
/// layer's keys and values of the prompt, the last token's logits), with and without prefix
/// dedup, so decoding from it draws the tokens the prefill's state would; a kept forward of an
/// older weight version is refused.
#[test]
fn kept_prompt_forward_gives_the_prefills_state_bitwise() {
    let Some(gpu) = gpu_or_skip() else { return };
    let s = gpu.stream(0).unwrap();
    let m = model(false);
    let groups = two_groups(&m);
    let bits = |v: Vec<bf16>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let mut t = GpuTrainer::new(&gpu, &s, &m, train_cfg(), adamw(1e-3)).unwrap();
    let enc: Vec<Vec<GpuEncodedMedia>> = groups
        .iter()
        .map(|g| t.model().encode_media(&gpu, &s, &g.media()).unwrap())
        .collect();
    let refs: Vec<Vec<&GpuEncodedMedia>> = enc.iter().map(|e| e.iter().collect()).collect();
    for copies in [1u32, 3] {
        let lens: Vec<(usize, u32)> = groups.iter().map(|g| (g.prompt.len(), copies)).collect();
        let mut store = TrainPrefixes::new(&gpu, &s, t.model(), &lens).unwrap();
        for (i, g) in groups.iter().enumerate() {
            t.prefix_forward(
                &gpu,
                &s,
                &mut store,
                i,
                &g.prompt,
                PromptMedia::Encoded(&refs[i]),
            )
            .unwrap();
            let kept = t.prefix_state(&gpu, &s, &store, i).unwrap();
            let prompt = crate::gpu::GpuPrompt {
                ids: &g.prompt,
                media: &refs[i],
            };
            let batch = vec![prompt; copies as usize];
            let pre = t.model().prefill(&gpu, &s, &batch).unwrap().remove(0);
            assert_eq!((kept.len, kept.rope_delta), (pre.len, pre.rope_delta));
            let (kw, n) = (kept.kv.kv_width, kept.len as usize);
            assert_eq!(kw, pre.kv.kv_width);
            let layers = kept.kv.k.len() / (n * kw);
            assert_eq!(layers, m.config.text().num_layers as usize);
            let (kk, kv) = (
                bits(s.clone_dtoh(&kept.kv.k).unwrap()),
                bits(s.clone_dtoh(&kept.kv.v).unwrap()),
            );
            let (pk, pv) = (
                bits(s.clone_dtoh(&pre.kv.k).unwrap()),
                bits(s.clone_dtoh(&pre.kv.v).unwrap()),
            );
            for l in 0..layers {
                let a = l * n * kw..(l + 1) * n * kw;
                let b = (l * pre.kv.rows + pre.row0 as usize) * kw;
                let b = b..b + n * kw;
                assert_eq!(
                    kk[a.clone()],
                    pk[b.clone()],
                    "copies {copies} group {i} layer {l}: keys"
                );
                assert_eq!(kv[a], pv[b], "copies {copies} group {i} layer {l}: values");
            }
            assert_eq!(
                bits(s.clone_dtoh(kept.last_logits.as_ref()).unwrap()),
                bits(s.clone_dtoh(pre.last_logits.as_ref()).unwrap()),
                "copies {copies} group {i}: last logits"
            );
        }
    }
    // an optimizer step moves the weights: the kept forward is stale
    let lens: Vec<(usize, u32)> = groups.iter().map(|g| (g.prompt.len(), 1)).collect();
    let mut store = TrainPrefixes::new(&gpu, &s, t.model(), &lens).unwrap();
    t.prefix_forward(
        &gpu,
        &s,
        &mut store,
        0,
        &groups[0].prompt,
        PromptMedia::Encoded(&refs[0]),
    )
    .unwrap();
    let resp = groups[0].responses();
    let trained = [PrefixedGroup {
        group: 0,
        responses: &resp,
    }];
    let norm = norm_of(&groups[..1]);
    t.micro_batch_prefixed(&gpu, &s, 0, &trained, norm, &store)
        .unwrap();
    t.optimizer_step(&gpu, &s).unwrap();
    for (group, why) in [(0, "weight version"), (1, "was not kept")] {
        let e = t.prefix_state(&gpu, &s, &store, group).err().expect(why);
        assert!(e.to_string().contains(why), "{e}");
    }
}
