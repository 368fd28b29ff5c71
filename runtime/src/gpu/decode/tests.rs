//! The device decode loop on a tiny model: a graph replay gives bitwise what the same steps
//! launched eagerly give, through compactions and across iterations (graphs reused, the key
//! read from the device); the bucket sizes.

use rollplex_kernels::cuda::test_gpu;
use rollplex_plan::models::TestModel;

use super::super::generate::sample_params;
use super::super::text::{GpuKvArena, GpuPrompt};
use super::*;
use crate::model::{Qwen25VL, SamplingParams};

#[test]
fn buckets_grow_by_halves() {
    assert_eq!(buckets(1), vec![1]);
    assert_eq!(buckets(3), vec![1, 2, 3]);
    assert_eq!(buckets(16), vec![1, 2, 3, 4, 6, 8, 12, 16]);
    assert_eq!(buckets(20), vec![1, 2, 3, 4, 6, 8, 12, 16, 20]);
    assert_eq!(bucket_for(5, 16), 6);
    assert_eq!(bucket_for(16, 16), 16);
    assert_eq!(bucket_for(1, 1), 1);
}

/// Runs a whole decode of 3 groups of 4 (forced lengths that empty group 0, then group 1,
/// early) and returns (tokens, log-prob bits, stop steps) of the live entries.
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
fn run(
    dd: &mut DeviceDecode,
    arena: &mut GpuKvArena,
    gm: &GpuModel,
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    states: &[super::super::text::GpuPrefixState],
    iteration: u32,
    eager: bool,
    temperature: f32,
) -> (Vec<Vec<u32>>, Vec<Vec<u32>>, Vec<u32>, Vec<usize>) {
    let (group, max_new) = (4usize, 40u32);
    let rows_per_group = dd.group;
    let samples = states.len() * group;
    let mut off = 0;
    let mut spans = Vec::new();
    for p in states {
        spans.push(arena.store_prefix(s, off, p).unwrap());
        off += p.len;
    }
    let slots: Vec<DecodeSlot> = (0..samples)
        .map(|i| {
            let sl = DecodeSlot::new(spans[i / group], states[i / group].rope_delta, off, max_new);
            off += max_new;
            sl
        })
        .collect();
    let forced: Vec<u32> = (0..samples as u32)
        .map(|i| match i / 4 {
            0 => 1 + i % 4,
            1 => 9 + i % 4,
            _ => 20 + 5 * (i % 4),
        })
        .collect();
    dd.set_eager(eager);
    for i in 0..samples {
        let g = i / group;
        s.memcpy_dtod(&*states[g].last_logits, &mut dd.first_logits_mut(i))
            .unwrap();
    }
    let sampling = SamplingParams {
        temperature,
        top_k: 0,
        top_p: 1.0,
    };
    let start = DecodeStart {
        slots: &slots,
        keys: None,
        group: rows_per_group,
        max_new,
        stop_ids: &[],
        forced: Some(&forced),
        sampling: sample_params(&sampling, 5, iteration),
        logprob_temperature: 1.0,
    };
    let _ = group;
    dd.start(gm, gpu, s, arena, &start, 5, iteration).unwrap();
    let mut batches = Vec::new();
    for step in 0..max_new {
        if !dd.step(gm, gpu, s, arena, step).unwrap() {
            break;
        }
        batches.push(dd.batch_rows());
    }
    let out = dd.collect(s).unwrap();
    let m = max_new as usize;
    let mut toks = Vec::new();
    let mut lps = Vec::new();
    for (i, &f) in forced.iter().enumerate() {
        let n = out.done_step[i] as usize + 1;
        assert_eq!(n, f as usize, "sample {i} stopped at its forced length");
        toks.push(out.tokens[i * m..i * m + n].to_vec());
        lps.push(
            out.logprobs[i * m..i * m + n]
                .iter()
                .map(|x| x.to_bits())
                .collect(),
        );
    }
    (toks, lps, out.done_step, batches)
}

#[test]
fn graph_replay_is_bitwise_the_eager_steps() {
    let Some(gpu) = test_gpu() else { return };
    let s = gpu.stream(0).unwrap();
    let spec = TestModel::gpu(4, 2, 32, false).spec();
    let cpu = Qwen25VL::random(spec, 11).unwrap();
    let gm = GpuModel::upload(&gpu, &s, &cpu).unwrap();
    let ids: Vec<Vec<u32>> = [7usize, 12, 5]
        .iter()
        .enumerate()
        .map(|(p, &n)| {
            (0..n as u32)
                .map(|i| 1 + (i * 31 + p as u32 * 7) % 200)
                .collect()
        })
        .collect();
    let prompts: Vec<GpuPrompt> = ids
        .iter()
        .map(|x| GpuPrompt { ids: x, media: &[] })
        .collect();
    let states = gm.prefill(&gpu, &s, &prompts).unwrap();
    let max_prefix = states.iter().map(|p| p.len as usize).max().unwrap();
    let mut dd = DeviceDecode::new(&gm, &gpu, &s, 12, 4, 40, max_prefix).unwrap();
    assert!(dd.grouped, "head_dim 32 takes the group-shared attention");
    let rows: u32 = states.iter().map(|p| p.len).sum::<u32>() + 12 * 40;
    let mut arena = GpuKvArena::for_model(&gm, &gpu, &s, rows).unwrap();
    let a = &mut arena;
    let eager = run(&mut dd, a, &gm, &gpu, &s, &states, 1, true, 1.0);
    let graph = run(&mut dd, a, &gm, &gpu, &s, &states, 1, false, 1.0);
    println!("batches by step: {:?}", graph.3);
    assert_eq!(graph.0, eager.0, "tokens");
    assert_eq!(graph.1, eager.1, "log-probs");
    assert_eq!(graph.2, eager.2, "stop steps");
    assert_eq!(graph.3, eager.3, "batches");
    // compactions: group 0 stops by step 3 (seen at step 8 for step 16), group 1 by step 12
    assert_eq!(graph.3[0], 12);
    assert!(
        graph.3.contains(&8) && graph.3.contains(&4),
        "{:?}",
        graph.3
    );
    // the next iteration replays the same graphs with its own key
    let graphs = dd.graphs.len();
    let before: Vec<_> = dd
        .graphs
        .values()
        .map(|g| g.cu_graph_exec() as usize)
        .collect();
    let next = run(&mut dd, a, &gm, &gpu, &s, &states, 2, false, 1.0);
    let after: Vec<_> = dd
        .graphs
        .values()
        .map(|g| g.cu_graph_exec() as usize)
        .collect();
    assert_eq!(dd.graphs.len(), graphs);
    assert!(
        before.iter().all(|g| after.contains(g)),
        "graphs reused across iterations"
    );
    assert_ne!(next.0, graph.0, "iteration 2 draws other tokens");
    let next_eager = run(&mut dd, a, &gm, &gpu, &s, &states, 2, true, 1.0);
    assert_eq!(next.0, next_eager.0);
    assert_eq!(next.1, next_eager.1);
    // group-shared attention against one row at a time (groups of one): greedy tokens agree
    // and their log-probs are within bf16 rounding
    let greedy = run(&mut dd, a, &gm, &gpu, &s, &states, 3, false, 0.0);
    let mut single = DeviceDecode::new(&gm, &gpu, &s, 12, 1, 40, max_prefix).unwrap();
    assert!(!single.grouped);
    let alone = run(&mut single, a, &gm, &gpu, &s, &states, 3, false, 0.0);
    let (mut same, mut worst) = (0usize, 0f32);
    for (i, (g, o)) in greedy.0.iter().zip(&alone.0).enumerate() {
        let n = g.iter().zip(o).take_while(|(x, y)| x == y).count();
        same += n;
        for t in 0..n {
            let d = f32::from_bits(greedy.1[i][t]) - f32::from_bits(alone.1[i][t]);
            worst = worst.max(d.abs());
        }
        assert!(n >= 1, "sample {i}: the first greedy token differs");
    }
    let total: usize = greedy.0.iter().map(Vec::len).sum();
    println!(
        "grouped vs per-row greedy: {same}/{total} tokens agree, log-probs within {worst:.2e}"
    );
    assert!(worst < 5e-2, "log-probs differ by {worst}");
}
