//! GPU tests of the training step's gradient kernels (`cuda::grad`) against their CPU twins
//! (`cpu::grad`) on fresh random inputs, outputs poisoned with NaN first where the kernel writes
//! them whole. Each test prints "skipped: no CUDA device" and passes where no GPU is present.
#![cfg(feature = "cuda")]

use half::bf16;
use rollplex_kernels::cpu;
use rollplex_kernels::cuda::*;

#[macro_use]
mod common;
use common::*;

#[test]
fn sumsq_partials_match_cpu() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    // shorter than the grid, around its four-stride steps, and far past them
    for n in [1, 1000, 4 * SUMSQ_BLOCKS * 256 + 5, 3_000_017] {
        let seed = fresh_seed();
        println!("n {n} seed {seed}");
        let x: Vec<f32> = rand_vec(n, seed).iter().map(|v| v * 3.0).collect();
        let want = cpu::grad::sumsq_partial(&x, SUMSQ_BLOCKS);
        let dx = up(&s, &x);
        let mut out = up(&s, &vec![f64::NAN; SUMSQ_BLOCKS]);
        sumsq_partial_f32(g, &s, &dx, n, &mut out).unwrap();
        let got = down(&s, &out);
        let e = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs() / b.abs().max(1e-300))
            .fold(0f64, f64::max);
        println!("sumsq_partial_f32 n {n}: max rel err {e:.2e}");
        assert!(e <= 1e-12, "sumsq_partial_f32 n {n}: max rel err {e:.3e}");
        // the launch's partials are a function of the input alone
        let mut again = up(&s, &vec![f64::NAN; SUMSQ_BLOCKS]);
        sumsq_partial_f32(g, &s, &dx, n, &mut again).unwrap();
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            down(&s, &again)
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>()
        );
    }
}

#[test]
fn scale_matches_cpu() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    for n in [1, 257, 1_500_001] {
        let seed = fresh_seed();
        println!("n {n} seed {seed}");
        let mut want = rand_vec(n, seed);
        let mut dx = up(&s, &want);
        let c = 0.3711f32;
        scale_f32(g, &s, &mut dx, n, c).unwrap();
        cpu::grad::scale(&mut want, c);
        check(&format!("scale_f32 n {n}"), &down(&s, &dx), &want, 1e-7);
    }
}

#[test]
fn add_f32_into_bf16_matches_cpu() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    for n in [1, 300, 1_048_583] {
        let (x, mut want) = rand_bf(n, 1.0);
        let seed = fresh_seed();
        println!("n {n} seed {seed}");
        let y: Vec<f32> = rand_vec(n, seed).iter().map(|v| v * 0.01).collect();
        let (mut dx, dy) = (up(&s, &x), up(&s, &y));
        add_f32_into_bf16(g, &s, &mut dx, &dy, n).unwrap();
        cpu::grad::add_into(&mut want, &y);
        check(
            &format!("add_f32_into_bf16 n {n}"),
            &to_f32(&down(&s, &dx)),
            &want,
            8e-3,
        );
    }
    // buffers shorter than the count are refused
    let (mut dx, dy) = (up(&s, &[bf16::ONE; 4]), up(&s, &[0f32; 3]));
    assert!(add_f32_into_bf16(g, &s, &mut dx, &dy, 4).is_err());
}

#[test]
fn gather_sum_rows_matches_cpu() {
    let g = gpu_or_skip!();
    let s = g.stream(0).unwrap();
    let (width, src_rows, dst_n) = (2048 + 56, 97, 40);
    let (src, srcf) = rand_bf(src_rows * width, 1.0);
    let (dst0, dst0f) = rand_bf(dst_n * width, 1.0);
    // some rows summed from several sources (repeats included), one from none, others untouched
    let dst_rows: Vec<u32> = vec![39, 0, 17, 5];
    let lists: Vec<Vec<u32>> = vec![
        vec![3, 96, 3, 50, 7],
        vec![0],
        vec![],
        (0..src_rows as u32).rev().collect(),
    ];
    let mut want = dst0f.clone();
    cpu::grad::gather_sum_rows(&mut want, &dst_rows, &srcf, &lists, width);
    let (mut dd, ds) = (up(&s, &dst0), up(&s, &src));
    gather_sum_rows_bf16(g, &s, &mut dd, &dst_rows, &ds, &lists, width).unwrap();
    let got = to_f32(&down(&s, &dd));
    check("gather_sum_rows_bf16", &got, &want, 8e-3);
    // rows not named keep their bits
    for r in (0..dst_n).filter(|r| !dst_rows.contains(&(*r as u32))) {
        assert_eq!(
            got[r * width..(r + 1) * width],
            dst0f[r * width..(r + 1) * width]
        );
    }
    // a row outside either buffer is refused before any launch
    let bad = gather_sum_rows_bf16(g, &s, &mut dd, &[dst_n as u32], &ds, &[vec![0]], width);
    assert!(bad.is_err());
    let bad = gather_sum_rows_bf16(g, &s, &mut dd, &[0], &ds, &[vec![src_rows as u32]], width);
    assert!(bad.is_err());
    // the tables uploaded by the caller: the same bits; tables checked against more rows than
    // the buffers hold are refused
    let t = RowGather::new(&dst_rows, &lists, dst_n, src_rows).unwrap();
    let (td, to, ti) = (up(&s, &t.dst), up(&s, &t.off), up(&s, &t.idx));
    let mut dd2 = up(&s, &dst0);
    gather_sum_rows_dev(
        g,
        &s,
        &mut dd2,
        &ds,
        &t.on_device(&td, &to, &ti).unwrap(),
        width,
    )
    .unwrap();
    assert_eq!(down(&s, &dd2), down(&s, &dd));
    let big = RowGather::new(&dst_rows, &lists, dst_n + 1, src_rows).unwrap();
    let dev = big.on_device(&td, &to, &ti).unwrap();
    assert!(gather_sum_rows_dev(g, &s, &mut dd2, &ds, &dev, width).is_err());
    assert!(
        t.on_device(&td, &td, &ti).is_err(),
        "a short table accepted"
    );
}
