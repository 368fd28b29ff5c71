//! The device decode loop on a tiny model: a graph replay gives bitwise what the same steps
//! launched eagerly give, through compactions and across iterations (graphs reused, the key
//! read from the device); the bucket sizes, the compactions and the group tables.

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
    // rows: whole groups' worth
    assert_eq!(row_bucket_for(5, 128, 8), 8);
    assert_eq!(row_bucket_for(70, 128, 8), 96);
    assert_eq!(row_bucket_for(0, 128, 8), 8);
    assert_eq!(row_bucket_for(7, 12, 1), 8);
    assert_eq!(table_groups(128, 128, 8), 16);
    assert_eq!(table_groups(8, 128, 8), 8);
}

/// The group table: where each present group's rows start, then empty groups to the cut.
#[test]
fn group_starts_mark_each_groups_first_row() {
    assert_eq!(group_starts(&[0, 1, 2, 3, 4, 5, 6, 7], 4, 2), vec![0, 4, 8]);
    assert_eq!(
        group_starts(&[3, 5, 6, 7, 8, 10, 11], 4, 7),
        vec![0, 1, 4, 7, 7, 7, 7, 7]
    );
    assert_eq!(group_starts(&[9], 4, 1), vec![0, 1]);
}

/// Compaction keeps every live sample, tops the bucket up with stopped samples of live groups
/// first, keeps rows ascending and maps each new row to its old one; it does nothing when the
/// bucket would not shrink.
#[test]
fn compaction_drops_stopped_samples_not_whole_groups() {
    // 3 groups of 4, all rows in; live: 3 (group 0), 5 6 7 (group 1), 8..11 (group 2)
    let all: Vec<usize> = (0..12).collect();
    let live = |m: usize| m == 3 || (5..12).contains(&m);
    let c = compaction(&all, live, 4, 12).unwrap();
    assert_eq!(c.batch, vec![3, 5, 6, 7, 8, 9, 10, 11]);
    assert_eq!(c.map, vec![3, 5, 6, 7, 8, 9, 10, 11]);
    // from that batch, live 3, 10, 11: bucket 4, topped up with 8 (group 2 is live; row order)
    let c2 = compaction(&c.batch, |m| [3, 10, 11].contains(&m), 4, 12).unwrap();
    assert_eq!(c2.batch, vec![3, 8, 10, 11]);
    assert_eq!(c2.map, vec![0, 4, 6, 7]);
    // a dead sample of a group with no live one is taken only when the live groups run out
    let c3 = compaction(&[0, 1, 4, 5, 9, 10, 11, 12], |m| m == 9, 4, 16).unwrap();
    assert_eq!(c3.batch, vec![0, 9, 10, 11]);
    assert_eq!(c3.map, vec![0, 4, 5, 6]);
    // 9 live of 12: the bucket would not shrink
    assert!(compaction(&all, |m| m % 4 != 3, 4, 12).is_none());
    // every sample stopped: the smallest bucket
    let c4 = compaction(&all, |_| false, 4, 12).unwrap();
    assert_eq!(c4.batch.len(), 4);
}

/// Runs a whole decode of 3 groups of 4 (forced lengths: group 0's samples stop after 1, 2, 3
/// and 33 tokens, group 1's after 9-12, group 2's after 20-35) and returns (tokens, log-prob
/// bits, stop steps) of the live entries and the batch size of each step.
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
            0 if i == 3 => 33,
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
        if dd.step(gm, gpu, s, arena, step).unwrap().is_none() {
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
    // compactions, sample by sample: at step 16 (as of step 8) samples 0-2 and 4 have stopped
    // (8 live: 8 rows); at step 32 (as of 24) 3, 10 and 11 are live (4 rows, topped up with 8).
    // Whole groups would have kept 12 rows to step 24 and 8 to the end (sample 3 runs to 33).
    let want: Vec<usize> = [(12, 16), (8, 16), (4, 8)]
        .iter()
        .flat_map(|&(rows, steps)| std::iter::repeat_n(rows, steps))
        .collect();
    assert_eq!(graph.3, want);
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
