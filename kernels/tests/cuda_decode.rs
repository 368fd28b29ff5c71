//! GPU tests of the decode path, each kernel against its CPU twin on fresh random inputs (as
//! `cuda_kernels.rs`): decode attention with a shared prefix, Philox and the sampler, the fused
//! decode ops and the device-side advance; and the properties the decode loop and the overlap
//! rely on: bitwise equality and event order across SM partitions, CUDA-graph replay. Each test
//! prints "skipped: no CUDA device" and passes where no GPU or driver is present (CI).
#![cfg(feature = "cuda")]

use half::bf16;
use rollplex_kernels::cpu;
use rollplex_kernels::cpu::{AttnDims, DecodeSeq};
use rollplex_kernels::cuda::attention::RowStrides;
use rollplex_kernels::cuda::green::Priority;
use rollplex_kernels::cuda::pointwise::add_fwd_bf16_inplace;
use rollplex_kernels::cuda::sampling::philox_fill;
use rollplex_kernels::cuda::*;

#[macro_use]
mod common;
use common::*;

/// The SIMT decode kernel is kept for timing only (feature `bench`).
#[cfg(feature = "bench")]
#[test]
fn attention_decode_simt_matches_cpu_with_shared_prefix() {
    decode_case(false);
}

#[test]
fn attention_decode_tensor_cores_matches_cpu_with_shared_prefix() {
    decode_case(true);
}

/// Decode attention of both kernels against the CPU twin: GRPO groups sharing a prefix, random
/// suffix lengths, gaps in the arena, GQA 8:1 and 7:1 and 12:1 (two head groups).
fn decode_case(tensor_cores: bool) {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    for (dims, groups, gsize, prefix_len) in [
        (
            AttnDims {
                num_heads: 16,
                num_kv_heads: 2,
                head_dim: 128,
            },
            3usize,
            4usize,
            700usize,
        ),
        (
            AttnDims {
                num_heads: 28,
                num_kv_heads: 4,
                head_dim: 128,
            },
            2,
            8,
            1500,
        ),
        (
            AttnDims {
                num_heads: 12,
                num_kv_heads: 1,
                head_dim: 64,
            },
            1,
            5,
            0,
        ),
    ] {
        let case = grouped_decode_case(&s, dims, groups, gsize, prefix_len);
        let b = case.b;

        let max_len = prefix_len + case.suffix_lens.iter().max().unwrap();
        // the planned split, and a plan made for a shorter length (the last split takes the rest)
        for (hint, tc) in [(max_len, tensor_cores), (max_len / 3 + 1, tensor_cores)] {
            let plan = decode_plan(b, dims, hint);
            #[cfg(feature = "bench")]
            let plan = DecodePlan {
                tensor_cores: tc,
                ..plan
            };
            assert_eq!(plan.uses_tensor_cores(), tc);
            let mut ws = poison_f32(&s, plan.workspace_len());
            let mut dout = poison_bf(&s, b * dims.q_width());
            let mut dlse = poison_f32(&s, b * dims.num_heads);
            let mut lv = dlse.as_view_mut();
            attention_decode_bf16(
                g,
                &s,
                &mut dout,
                Some(&mut lv),
                &mut ws,
                case.inputs(dims, &case.seqs),
                plan,
            )
            .unwrap();
            let label = format!(
                "{dims:?} B{b} prefix {prefix_len} splits {} chunk {} tensor_cores {tc}",
                plan.splits, plan.chunk
            );
            let got = to_f32(&down(&s, &dout));
            check(
                &format!("attention_decode_bf16 {label}"),
                &got,
                &case.want,
                1e-2,
            );
            check(
                &format!("attention_decode_bf16 lse {label}"),
                &down(&s, &dlse),
                &case.want_lse,
                1e-4,
            );
        }
    }
}

#[test]
fn philox_matches_host() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    let n = 4096;
    let (c, key) = ([3u32, 77, 0xdead_beef], [0x1234_5678u32, 0x9abc_def0]);
    let mut d = up(&s, &vec![0u32; 4 * n]);
    philox_fill(g, &s, &mut d, n, c, key).unwrap();
    let got = down(&s, &d);
    for i in 0..n {
        assert_eq!(
            &got[4 * i..4 * i + 4],
            &philox4x32_10([i as u32, c[0], c[1], c[2]], key)[..],
            "block {i}"
        );
    }
    println!("philox_fill: {n} blocks bitwise equal to the host");
}

#[test]
fn sampling_matches_cpu_twin() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    let rows = 64usize;
    // (vocab, params): the draw without top-k / top-p (one pass over the row) at temperature 1
    // and not, with an odd vocabulary (rows not 8-byte aligned) too; then top-k and top-p
    let settings = [
        SampleParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 1,
            iteration: 0,
        },
        SampleParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: fresh_seed(),
            iteration: 3,
        },
        SampleParams {
            temperature: 0.7,
            top_k: 0,
            top_p: 1.0,
            seed: fresh_seed(),
            iteration: 4,
        },
        SampleParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: fresh_seed(),
            iteration: 5,
        },
        SampleParams {
            temperature: 0.7,
            top_k: 50,
            top_p: 1.0,
            seed: fresh_seed(),
            iteration: 1,
        },
        SampleParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.9,
            seed: fresh_seed(),
            iteration: 2,
        },
        SampleParams {
            temperature: 1.2,
            top_k: 1000,
            top_p: 0.5,
            seed: fresh_seed(),
            iteration: 9,
        },
    ];
    for (n, p) in settings.into_iter().enumerate() {
        let vocab = if n == 3 { 1_001 } else { 151_936 };
        let (x, _) = rand_bf(rows * vocab, 6.0);
        let sample_ids: Vec<u32> = (0..rows as u32).map(|r| r * 3 + 1).collect();
        let steps: Vec<u32> = (0..rows as u32).map(|r| 100 + r % 7).collect();
        let (dx, dsid, dst) = (up(&s, &x), up(&s, &sample_ids), up(&s, &steps));
        let mut dtok = up(&s, &vec![u32::MAX; rows]);
        sample_bf16(
            g, &s, &mut dtok, &dx, &dsid, &dst, rows, vocab, vocab, &p, None,
        )
        .unwrap();
        let got = down(&s, &dtok);
        let mut same = 0;
        for r in 0..rows {
            let want = sample_ref(&x[r * vocab..(r + 1) * vocab], &p, sample_ids[r], steps[r]);
            assert!(
                (got[r] as usize) < vocab,
                "row {r}: token {} out of range",
                got[r]
            );
            same += (want == got[r]) as usize;
        }
        println!("sample_bf16 {p:?}: {same}/{rows} rows pick the CPU twin's token");
        assert!(
            same + 1 >= rows,
            "at most one rounding-level disagreement allowed, got {}",
            rows - same
        );
    }
}

/// The split draw (each row's vocabulary over several blocks, [`SampleScratch`]) picks the same
/// tokens as one block a row: greedy, plain draws at T = 1 and 0.7, and top-k (which keeps one
/// block a row), over rows with ties, NaN, +-inf and -0 logits, at batch sizes that give each
/// row from 1 to many blocks; the scratch is zero after each launch and reused.
#[test]
fn split_draw_picks_the_one_block_tokens() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    let vocab = 151_936;
    let special = |r: usize, x: &mut [bf16]| match r % 6 {
        0 => x.iter_mut().for_each(|v| *v = bf16::from_f32(0.5)), // all tied
        1 => x.iter_mut().for_each(|v| *v = bf16::NAN),           // nothing drawable
        2 => {
            x[77] = bf16::INFINITY;
            x[150_001] = bf16::INFINITY;
        }
        3 => x
            .iter_mut()
            .step_by(3)
            .for_each(|v| *v = bf16::NEG_INFINITY),
        4 => x
            .iter_mut()
            .step_by(2)
            .for_each(|v| *v = bf16::from_f32(-0.0)),
        _ => {}
    };
    let mut scratch = SampleScratch::new(&s, 96).unwrap();
    // 96 rows: still split on a 132-SM GPU (`split_pays`)
    for rows in [1usize, 5, 96] {
        let (mut x, _) = rand_bf(rows * vocab, 6.0);
        for r in 0..rows {
            special(r, &mut x[r * vocab..(r + 1) * vocab]);
        }
        let sample_ids: Vec<u32> = (0..rows as u32).map(|r| r * 5 + 2).collect();
        let steps: Vec<u32> = (0..rows as u32).map(|r| 7 + r % 3).collect();
        let (dx, dsid, dst) = (up(&s, &x), up(&s, &sample_ids), up(&s, &steps));
        for (temperature, top_k) in [(0.0f32, 0u32), (1.0, 0), (0.7, 0), (1.0, 40)] {
            let p = SampleParams {
                temperature,
                top_k,
                top_p: 1.0,
                seed: fresh_seed(),
                iteration: 3,
            };
            let mut dtok = up(&s, &vec![u32::MAX; rows]);
            sample_bf16(
                g, &s, &mut dtok, &dx, &dsid, &dst, rows, vocab, vocab, &p, None,
            )
            .unwrap();
            let want = down(&s, &dtok);
            for rep in 0..2 {
                let mut dtok = up(&s, &vec![u32::MAX; rows]);
                let sc = Some(&mut scratch);
                sample_bf16(
                    g, &s, &mut dtok, &dx, &dsid, &dst, rows, vocab, vocab, &p, sc,
                )
                .unwrap();
                assert_eq!(
                    down(&s, &dtok),
                    want,
                    "rows {rows} T {temperature} top-k {top_k} run {rep}: split draw differs"
                );
                assert!(
                    scratch.to_host(&s).unwrap().iter().all(|&w| w == 0),
                    "scratch left nonzero"
                );
            }
        }
    }
}

/// A -inf logit whose Philox word rounds u to 1 scores -inf - (-inf) = NaN; the split draw, like
/// the one-block draw and `sample_ref`, never draws it (it once did: its order key put NaN above
/// +inf). The seed is searched on the host so that such a word falls on a -inf logit of the row.
#[test]
fn split_draw_never_draws_a_nan_score() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    let vocab = 151_936usize;
    let (sample, step, iteration) = (167u32, 7u32, 3u32);
    // the first seed with a word of all-ones high 24 bits (u = 1 after rounding)
    let (seed, hit) = (1u64..)
        .find_map(|seed| {
            let key = [seed as u32, (seed >> 32) as u32];
            (0..vocab.div_ceil(4)).find_map(|grp| {
                let r = philox4x32_10([grp as u32, step, sample, iteration], key);
                (0..4)
                    .find(|&w| r[w] >> 8 == 0x00ff_ffff && grp * 4 + w < vocab)
                    .map(|w| (seed, grp * 4 + w))
            })
        })
        .expect("a seed with u = 1 somewhere in the row");
    let mut x: Vec<bf16> = (0..vocab)
        .map(|i| bf16::from_f32(((i * 7919) % 1000) as f32 / 1000.0 - 0.5))
        .collect();
    x[hit] = bf16::NEG_INFINITY;
    let p = SampleParams {
        temperature: 0.7,
        top_k: 0,
        top_p: 1.0,
        seed,
        iteration,
    };
    let want = sample_ref(&x, &p, sample, step);
    assert_ne!(want as usize, hit, "the reference drew a -inf logit");
    let (dx, dsid, dst) = (up(&s, &x), up(&s, &[sample]), up(&s, &[step]));
    let mut scratch = SampleScratch::new(&s, 1).unwrap();
    for split in [false, true] {
        let mut dtok = up(&s, &[u32::MAX]);
        let sc = split.then_some(&mut scratch);
        sample_bf16(g, &s, &mut dtok, &dx, &dsid, &dst, 1, vocab, vocab, &p, sc).unwrap();
        assert_eq!(
            down(&s, &dtok),
            vec![want],
            "split {split}: seed {seed:#x}, u = 1 at {hit}"
        );
    }
}

#[test]
fn green_partitions_give_identical_bits_and_events_order_them() {
    let g = gpu_or_skip!();
    let set = StreamSet::new(g).unwrap();
    let rest = g.sm_count() - set.granted(40, Priority::High).unwrap();
    println!(
        "StreamSet: green {}, layout {:?}, warning {:?}, driver {}",
        set.green(),
        set.layout(),
        set.warning(),
        rollplex_kernels::cuda::green::driver_version().unwrap()
    );
    let full = g.stream(0).unwrap();
    let (a, b) = (
        set.partition(40, Priority::High).unwrap(),
        set.partition(rest, Priority::Normal).unwrap(),
    );
    let (a_s, b_s) = (&a, &b);
    for st in [&full, a_s, b_s] {
        g.prepare_stream(st).unwrap();
    }
    // GEMM: same bits on the full GPU, on 40 SMs and on the rest.
    let (m, k, n) = (512usize, 4096usize, 4096usize);
    let (x, _) = rand_bf(m * k, 1.0);
    let (w, _) = rand_bf(n * k, 0.05);
    let (dx, dw) = (up(&full, &x), up(&full, &w));
    let mut outs = Vec::new();
    for st in [&full, a_s, b_s] {
        let mut dy = poison_bf(&full, m * n);
        full.synchronize().unwrap();
        linear_fwd_bf16(g, st, &mut dy, &dx, &dw, None, m, k, n).unwrap();
        st.synchronize().unwrap();
        outs.push(down(&full, &dy));
    }
    assert_eq!(
        outs[0], outs[1],
        "GEMM bits differ between the full GPU and a 40-SM partition"
    );
    assert_eq!(
        outs[0], outs[2],
        "GEMM bits differ between the full GPU and the remainder partition"
    );
    // Decode attention: same bits on the full GPU and on a partition.
    let dims = AttnDims {
        num_heads: 16,
        num_kv_heads: 2,
        head_dim: 128,
    };
    let (b, len) = (16usize, 1000usize);
    let (kc, _) = rand_bf(b * len * dims.kv_width(), 1.0);
    let (vc, _) = rand_bf(b * len * dims.kv_width(), 1.0);
    let (q, _) = rand_bf(b * dims.q_width(), 1.0);
    let seqs: Vec<AttnSeqGpu> = (0..b)
        .map(|i| {
            AttnSeqGpu::from_decode(
                i as u32,
                &DecodeSeq {
                    prefix_offset: 0,
                    prefix_len: 0,
                    suffix_offset: (i * len) as u32,
                    suffix_len: len as u32,
                },
            )
        })
        .collect();
    let (dk, dv, dq, ds) = (
        up(&full, &kc),
        up(&full, &vc),
        up(&full, &q),
        up(&full, &seqs),
    );
    // Both decode kernels: the same bits on the whole GPU and on a partition.
    // (the SIMT kernel only with the feature `bench`, which keeps it for timing)
    let kernels: &[bool] = if cfg!(feature = "bench") {
        &[false, true]
    } else {
        &[true]
    };
    for &tc in kernels {
        let plan = decode_plan(b, dims, len);
        #[cfg(feature = "bench")]
        let plan = DecodePlan {
            tensor_cores: tc,
            ..plan
        };
        let mut att = Vec::new();
        for st in [&full, a_s] {
            let mut ws = poison_f32(&full, plan.workspace_len());
            let mut o = poison_bf(&full, b * dims.q_width());
            full.synchronize().unwrap();
            let strides = RowStrides::contiguous(dims);
            attention_decode_bf16(
                g,
                st,
                &mut o,
                None,
                &mut ws,
                DecodeInputs {
                    q: &dq,
                    k_cache: &dk,
                    v_cache: &dv,
                    seqs: &ds,
                    dims,
                    scale: 0.088,
                    strides,
                },
                plan,
            )
            .unwrap();
            st.synchronize().unwrap();
            att.push(down(&full, &o));
        }
        assert_eq!(
            att[0], att[1],
            "decode attention (tensor_cores {tc}) bits differ between streams"
        );
    }
    // Events: a GEMM on partition A, then a copy on partition B that waits on A's event.
    let mut y = poison_bf(&full, m * n);
    let zero = up(&full, &vec![bf16::ZERO; m * n]);
    let mut z = poison_bf(&full, m * n);
    full.synchronize().unwrap();
    let ev = g.event().unwrap();
    for _ in 0..3 {
        linear_fwd_bf16(g, a_s, &mut y, &dx, &dw, None, m, k, n).unwrap();
    }
    ev.record(a_s).unwrap();
    b_s.wait(&ev).unwrap();
    add_fwd_bf16(g, b_s, &mut z, &y, &zero, m * n).unwrap();
    b_s.synchronize().unwrap();
    a_s.synchronize().unwrap();
    assert_eq!(
        down(&full, &z),
        outs[0],
        "partition B ran before partition A's event"
    );
    println!(
        "green partitions: GEMM and decode bits identical across partitions; event ordering holds"
    );
}

#[test]
fn graph_capture_replays_a_layer_slice() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    g.prepare_stream(&s).unwrap();
    let (m, k, n) = (64usize, 2048usize, 2560usize);
    let (x, _) = rand_bf(m * k, 2.0);
    let (w, _) = rand_bf(n * k, 0.05);
    let (nw, _) = rand_bf(k, 1.0);
    let (dx, dw, dnw) = (up(&s, &x), up(&s, &w), up(&s, &nw));
    let mut h = poison_bf(&s, m * k);
    let mut y = poison_bf(&s, m * n);
    // eager
    rmsnorm_fwd_bf16(g, &s, &mut h, None, &dx, &dnw, m, k, 1e-6).unwrap();
    linear_fwd_bf16(g, &s, &mut y, &h, &dw, None, m, k, n).unwrap();
    let eager = down(&s, &y);
    // captured
    let mut y2 = poison_bf(&s, m * n);
    s.begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    rmsnorm_fwd_bf16(g, &s, &mut h, None, &dx, &dnw, m, k, 1e-6).unwrap();
    linear_fwd_bf16(g, &s, &mut y2, &h, &dw, None, m, k, n).unwrap();
    let graph = s
        .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a graph");
    graph.launch().unwrap();
    graph.launch().unwrap();
    assert_eq!(
        down(&s, &y2),
        eager,
        "graph replay differs from eager launches"
    );
    println!("graph capture: rmsnorm + cuBLASLt GEMM replay bitwise equal to eager");
}

#[test]
fn fused_decode_ops_equal_their_parts() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    // add_rmsnorm = add then rmsnorm, bitwise; and near the CPU twins.
    let (rows, d) = (64usize, 2048usize);
    let (h, hf) = rand_bf(rows * d, 2.0);
    let (dl, dlf) = rand_bf(rows * d, 2.0);
    let (w, wf) = rand_bf(d, 1.0);
    let (ddl, dw) = (up(&s, &dl), up(&s, &w));
    let mut h1 = up(&s, &h);
    let mut y1 = poison_bf(&s, rows * d);
    add_fwd_bf16_inplace(g, &s, &mut h1, &ddl, rows * d).unwrap();
    rmsnorm_fwd_bf16(g, &s, &mut y1, None, &h1, &dw, rows, d, 1e-6).unwrap();
    let mut h2 = up(&s, &h);
    let mut y2 = poison_bf(&s, rows * d);
    add_rmsnorm_fwd_bf16(g, &s, &mut y2, None, &mut h2, &ddl, &dw, rows, d, 1e-6).unwrap();
    assert_eq!(
        down(&s, &h2),
        down(&s, &h1),
        "add_rmsnorm: residual differs from add_fwd_bf16"
    );
    assert_eq!(
        down(&s, &y2),
        down(&s, &y1),
        "add_rmsnorm: output differs from rmsnorm_fwd_bf16"
    );
    let mut hsum = hf.clone();
    cpu::add_fwd(&mut hsum, &dlf).unwrap();
    let mut want = vec![0f32; rows * d];
    cpu::rmsnorm_fwd(&mut want, None, &hsum, &wf, rows, d, 1e-6).unwrap();
    check(
        "add_rmsnorm_fwd_bf16 vs CPU",
        &to_f32(&down(&s, &y2)),
        &want,
        8e-3,
    );

    // rope_kv_append = rope + two kv appends, bitwise.
    let (t, hq, hk, hd) = (16usize, 16usize, 2usize, 128usize);
    let row = (hq + 2 * hk) * hd;
    let kvw = hk * hd;
    let (x, _) = rand_bf(t * row, 2.0);
    let ang: Vec<f32> = rand_vec(t * hd, fresh_seed())
        .iter()
        .map(|v| v * 30.0)
        .collect();
    let cos: Vec<f32> = ang.iter().map(|a| a.cos()).collect();
    let sin: Vec<f32> = ang.iter().map(|a| a.sin()).collect();
    let slots: Vec<u32> = (0..t as u32).map(|i| (i * 7) % 40).collect();
    let n_slots = 40;
    let (dc, ds, dsl) = (up(&s, &cos), up(&s, &sin), up(&s, &slots));
    let mut x1 = up(&s, &x);
    let (mut k1, mut v1) = (poison_bf(&s, n_slots * kvw), poison_bf(&s, n_slots * kvw));
    rope_fwd_bf16(g, &s, &mut x1, &dc, &ds, t, row, hq + hk, hd, true).unwrap();
    kv_append_bf16(g, &s, &mut k1, &x1.slice(hq * hd..), &dsl, t, kvw, row, kvw).unwrap();
    kv_append_bf16(
        g,
        &s,
        &mut v1,
        &x1.slice((hq + hk) * hd..),
        &dsl,
        t,
        kvw,
        row,
        kvw,
    )
    .unwrap();
    let mut x2 = up(&s, &x);
    let (mut k2, mut v2) = (poison_bf(&s, n_slots * kvw), poison_bf(&s, n_slots * kvw));
    rope_kv_append_bf16(
        g, &s, &mut x2, &mut k2, &mut v2, &dc, &ds, &dsl, t, hq, hk, hd, true,
    )
    .unwrap();
    let bits = |v: Vec<bf16>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(down(&s, &x2)),
        bits(down(&s, &x1)),
        "rope_kv_append: rotated rows differ"
    );
    assert_eq!(
        bits(down(&s, &k2)),
        bits(down(&s, &k1)),
        "rope_kv_append: k cache differs"
    );
    assert_eq!(
        bits(down(&s, &v2)),
        bits(down(&s, &v1)),
        "rope_kv_append: v cache differs"
    );
    println!("add_rmsnorm_fwd_bf16 and rope_kv_append_bf16: bitwise equal to their parts");
}

/// `decode_advance` against its CPU twin, bitwise: live rows that go on, stop on a stop id, stop
/// at max_new, stop at a forced length (drawing a stop id that must not stop them), and rows
/// already done (which only get the padding inputs); then `decode_gather_rows`.
#[test]
fn decode_advance_matches_its_twin() {
    let g = gpu_or_skip!();
    for keep_prefix in [false, true] {
        decode_advance_case(g, keep_prefix);
    }
}

fn decode_advance_case(g: &Gpu, keep_prefix: bool) {
    use rollplex_kernels::cuda::decode_loop::DecodeAdvanceRef;
    let s = g.stream(0).unwrap();
    let (n, samples, max_new, hd, table_rows) = (9usize, 12usize, 6usize, 8usize, 20usize);
    let stop_ids = [7u32, 3];
    let rows: Vec<DecodeRow> = (0..n)
        .map(|r| DecodeRow {
            sample: (r * 5 % samples) as u32,
            key: 100 + r as u32,
            prefix_offset: 10 * r as u32,
            prefix_len: 3 + r as u32,
            suffix_offset: 200 + 8 * r as u32,
            suffix_len: (r % 4) as u32,
            rope_row: (r % 5) as u32,
            forced: (r % 3 == 2) as u32,
            stop_len: if r % 3 == 2 { (r % 4) as u32 + 1 } else { 0 },
            done: (r == 4) as u32,
            step: (r % 4) as u32 + if r == 5 { 1 } else { 0 },
        })
        .collect();
    // row 0 draws a stop id; row 5 reaches max_new; forced rows 2 and 8 draw a stop id
    let tokens: Vec<u32> = (0..n as u32)
        .map(|r| match r {
            0 | 2 | 8 => 7,
            _ => 20 + r,
        })
        .collect();
    let mut rows = rows;
    rows[5].step = max_new as u32 - 1;
    let logprobs: Vec<f32> = (0..n).map(|r| -0.25 * r as f32).collect();
    let cos_t: Vec<f32> = (0..table_rows * hd)
        .map(|i| (i as f32 * 0.37).cos())
        .collect();
    let sin_t: Vec<f32> = (0..table_rows * hd)
        .map(|i| (i as f32 * 0.37).sin())
        .collect();
    // host twin
    let mut h_rows = rows.clone();
    let (mut h_ot, mut h_ol, mut h_done) = (
        vec![u32::MAX; samples * max_new],
        vec![f32::NAN; samples * max_new],
        vec![u32::MAX; samples],
    );
    let (mut h_feed, mut h_cos, mut h_sin) = (
        vec![9u32; n],
        vec![f32::NAN; n * hd],
        vec![f32::NAN; n * hd],
    );
    let mut h_seqs = vec![AttnSeqGpu::default(); n];
    let (mut h_w, mut h_ids, mut h_steps) = (vec![1u32; n], vec![1u32; n], vec![1u32; n]);
    decode_advance_ref(DecodeAdvanceRef {
        rows: &mut h_rows,
        tokens: &tokens,
        logprobs: &logprobs,
        stop_ids: &stop_ids,
        max_new,
        keep_prefix,
        out_tokens: &mut h_ot,
        out_logprobs: &mut h_ol,
        done_step: &mut h_done,
        cos_table: &cos_t,
        sin_table: &sin_t,
        head_dim: hd,
        feed: &mut h_feed,
        cos: &mut h_cos,
        sin: &mut h_sin,
        seqs: &mut h_seqs,
        write_rows: &mut h_w,
        sample_ids: &mut h_ids,
        steps: &mut h_steps,
    });
    // device, outputs poisoned the same way
    let mut d_rows = s.clone_htod(&rows).unwrap();
    let (d_tok, d_lp, d_stop) = (
        s.clone_htod(&tokens).unwrap(),
        s.clone_htod(&logprobs).unwrap(),
        s.clone_htod(&stop_ids).unwrap(),
    );
    let mut d_ot = s.clone_htod(&vec![u32::MAX; samples * max_new]).unwrap();
    let mut d_ol = s.clone_htod(&vec![f32::NAN; samples * max_new]).unwrap();
    let mut d_done = s.clone_htod(&vec![u32::MAX; samples]).unwrap();
    let (d_ct, d_st) = (s.clone_htod(&cos_t).unwrap(), s.clone_htod(&sin_t).unwrap());
    let mut d_feed = s.clone_htod(&vec![9u32; n]).unwrap();
    let mut d_cos = s.clone_htod(&vec![f32::NAN; n * hd]).unwrap();
    let mut d_sin = s.clone_htod(&vec![f32::NAN; n * hd]).unwrap();
    let mut d_seqs = s.clone_htod(&vec![AttnSeqGpu::default(); n]).unwrap();
    let mut d_w = s.clone_htod(&vec![1u32; n]).unwrap();
    let mut d_ids = s.clone_htod(&vec![1u32; n]).unwrap();
    let mut d_steps = s.clone_htod(&vec![1u32; n]).unwrap();
    decode_advance(
        g,
        &s,
        DecodeAdvance {
            rows: &mut d_rows,
            n_rows: n,
            tokens: &d_tok,
            logprobs: &d_lp,
            stop_ids: &d_stop,
            n_stop: stop_ids.len(),
            max_new,
            keep_prefix,
            out_tokens: &mut d_ot,
            out_logprobs: &mut d_ol,
            done_step: &mut d_done,
            samples,
            cos_table: &d_ct,
            sin_table: &d_st,
            head_dim: hd,
            feed: &mut d_feed,
            cos: &mut d_cos,
            sin: &mut d_sin,
            seqs: &mut d_seqs,
            write_rows: &mut d_w,
            sample_ids: &mut d_ids,
            steps: &mut d_steps,
        },
    )
    .unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(s.clone_dtoh(&d_rows).unwrap(), h_rows);
    assert_eq!(s.clone_dtoh(&d_ot).unwrap(), h_ot);
    assert_eq!(bits(&s.clone_dtoh(&d_ol).unwrap()), bits(&h_ol));
    assert_eq!(s.clone_dtoh(&d_done).unwrap(), h_done);
    assert_eq!(s.clone_dtoh(&d_feed).unwrap(), h_feed);
    assert_eq!(bits(&s.clone_dtoh(&d_cos).unwrap()), bits(&h_cos));
    assert_eq!(bits(&s.clone_dtoh(&d_sin).unwrap()), bits(&h_sin));
    assert_eq!(s.clone_dtoh(&d_seqs).unwrap(), h_seqs);
    assert_eq!(s.clone_dtoh(&d_w).unwrap(), h_w);
    assert_eq!(s.clone_dtoh(&d_ids).unwrap(), h_ids);
    assert_eq!(s.clone_dtoh(&d_steps).unwrap(), h_steps);
    // what the cases mean, on the twin: stop id, max length, forced (stop id ignored), done
    assert_eq!(h_rows[0].done, 1);
    assert_eq!(h_rows[5].done, 1);
    assert_eq!(h_rows[4].step, rows[4].step, "a done row does not advance");
    assert_eq!(h_w[4], u32::MAX);
    let want_p = if keep_prefix { rows[4].prefix_len } else { 1 };
    assert_eq!(h_seqs[4].p_len, want_p);
    assert_eq!(
        h_rows[8].done,
        u32::from(rows[8].step + 1 >= rows[8].stop_len)
    );
    assert_eq!(h_rows[1].suffix_len, rows[1].suffix_len + 1);
    // gather: rows reversed, keys follow
    let map: Vec<u32> = (0..n as u32).rev().collect();
    let d_map = s.clone_htod(&map).unwrap();
    let mut d_dst = s.clone_htod(&vec![DecodeRow::default(); n]).unwrap();
    decode_gather_rows(
        g,
        &s,
        &mut d_dst,
        &d_rows,
        &d_map,
        n,
        &mut d_ids,
        &mut d_steps,
    )
    .unwrap();
    let got = s.clone_dtoh(&d_dst).unwrap();
    let want: Vec<DecodeRow> = map.iter().map(|&i| h_rows[i as usize]).collect();
    assert_eq!(got, want);
    let keys: Vec<u32> = want.iter().map(|r| r.key).collect();
    assert_eq!(s.clone_dtoh(&d_ids).unwrap(), keys);
}
