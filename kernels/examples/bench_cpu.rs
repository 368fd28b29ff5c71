//! Workbench for the CPU ops: times variants side by side and prints GFLOP/s and ratios.
//!   cargo run --release -p rollplex-kernels --example bench_cpu
//! Shapes are a small model's (hidden 1024, MLP 2816, head dim 64) at prefill (512 rows) and
//! decode (16 rows) batch sizes.

use std::time::Instant;

use rollplex_kernels::cpu::{attention_fwd, matmul, AttnDims, AttnMask, AttnSeq, Gemm};

fn rand(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect()
}

/// Best of `reps` runs, seconds.
fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn naive_nt(c: &mut [f32], a: &[f32], w: &[f32], m: usize, k: usize, n: usize) {
    for i in 0..m {
        for j in 0..n {
            let mut s = 0f32;
            for p in 0..k {
                s += a[i * k + p] * w[j * k + p];
            }
            c[i * n + j] = s;
        }
    }
}

fn main() {
    println!("threads: {}", rayon::current_num_threads());
    for &(m, k, n) in &[(512, 1024, 2816), (16, 1024, 2816), (512, 2816, 1024)] {
        let a = rand(m * k, 1);
        let w = rand(n * k, 2);
        let mut c = vec![0f32; m * n];
        let flops = 2.0 * (m * k * n) as f64;
        let t_par = time(5, || matmul(&mut c, &a, &w, Gemm::nt(m, k, n)).unwrap());
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let t_one = time(5, || {
            pool.install(|| matmul(&mut c, &a, &w, Gemm::nt(m, k, n)).unwrap())
        });
        let t_naive =
            time(1, || naive_nt(&mut c, &a, &w, m.min(64), k, n)) * m as f64 / m.min(64) as f64;
        println!(
            "matmul_nt {m}x{k}x{n}: {:.1} GFLOP/s all threads, {:.1} one thread, naive loop {:.1} ({:.1}x)",
            flops / t_par / 1e9,
            flops / t_one / 1e9,
            flops / t_naive / 1e9,
            t_naive / t_par
        );
    }
    let dims = AttnDims {
        num_heads: 16,
        num_kv_heads: 4,
        head_dim: 64,
    };
    let t = 1024;
    let q = rand(t * dims.q_width(), 3);
    let k = rand(t * dims.kv_width(), 4);
    let v = rand(t * dims.kv_width(), 5);
    let mut o = vec![0f32; q.len()];
    let seqs = AttnSeq::from_cu_seqlens(&[0, t as u32]);
    let s = time(3, || {
        attention_fwd(
            &mut o,
            None,
            &q,
            &k,
            &v,
            &[],
            &[],
            &seqs,
            dims,
            AttnMask::Causal,
            0.125,
        )
        .unwrap()
    });
    let flops = 4.0 * (t * t / 2 * dims.q_width()) as f64;
    println!(
        "attention_fwd causal T={t} heads 16/4 hd 64: {:.2} ms, {:.1} GFLOP/s",
        s * 1e3,
        flops / s / 1e9
    );
}
