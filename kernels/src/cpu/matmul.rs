//! GEMM on the CPU: `matmul` (general, with transposes and accumulation) and `linear_fwd`
//! (`y = x W^T + b`, Hugging Face's `nn.Linear` with weights `[out, in]`).
//!
//! The inner product runs on `matrixmultiply`'s packed SIMD micro-kernel (AVX-512/AVX2+FMA found
//! at run time). Work is split over rayon tasks by blocks of output rows, or by blocks of output
//! columns when there are few rows (decode). Neither split changes the arithmetic of any output
//! element: each one is the same sequence of FMAs over `k` (in fixed blocks of 256), whatever
//! the number of rows, their position in the batch or the number of threads.
//!
//! Invariant (tested): row `i` of `matmul(A, B)` is bitwise equal to `matmul(A[i..i+1], B)`.
//! The model's batch-composition independence (a sample scored alone or in its group gives the
//! same bits) rests on it.

use rayon::prelude::*;

use crate::{check_len, shape_err, Result};

/// Sizes and layout of one GEMM: `C[m, n] (= or +=) op(A)[m, k] * op(B)[k, n]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gemm {
    pub m: usize,
    pub k: usize,
    pub n: usize,
    /// A is stored `[k, m]` (row-major) and used transposed.
    pub trans_a: bool,
    /// B is stored `[n, k]` (row-major) and used transposed (the `nn.Linear` weight layout).
    pub trans_b: bool,
    /// `C += A B` instead of `C = A B` (gradient accumulation).
    pub accumulate: bool,
}

impl Gemm {
    /// `C[m, n] = A[m, k] B[k, n]`.
    pub fn nn(m: usize, k: usize, n: usize) -> Self {
        Gemm {
            m,
            k,
            n,
            trans_a: false,
            trans_b: false,
            accumulate: false,
        }
    }
    /// `C[m, n] = A[m, k] B[n, k]^T` (activations times `nn.Linear` weights).
    pub fn nt(m: usize, k: usize, n: usize) -> Self {
        Gemm {
            trans_b: true,
            ..Self::nn(m, k, n)
        }
    }
    /// `C[m, n] = A[k, m]^T B[k, n]` (weight gradients).
    pub fn tn(m: usize, k: usize, n: usize) -> Self {
        Gemm {
            trans_a: true,
            ..Self::nn(m, k, n)
        }
    }
    pub fn accumulate(self) -> Self {
        Gemm {
            accumulate: true,
            ..self
        }
    }
}

/// Row blocks are a multiple of this (every micro-kernel's MR divides it).
const ROW_ALIGN: usize = 16;
/// Column blocks are a multiple of this (every micro-kernel's NR divides it).
const COL_ALIGN: usize = 64;
/// Below this many multiply-adds one thread does the whole GEMM.
const PAR_MIN_WORK: usize = 1 << 18;

struct SendPtr(*mut f32);
// SAFETY: the pointer is only used to write disjoint column blocks of C, one block per task.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

/// General matrix product on f32, `C[m, n] (= or +=) op(A) op(B)`.
///
/// Shapes: `a` is `[m, k]` (`[k, m]` if `g.trans_a`), `b` is `[k, n]` (`[n, k]` if `g.trans_b`),
/// `c` is `[m, n]`. All row-major and contiguous.
pub fn matmul(c: &mut [f32], a: &[f32], b: &[f32], g: Gemm) -> Result<()> {
    const OP: &str = "matmul";
    let Gemm {
        m,
        k,
        n,
        trans_a,
        trans_b,
        accumulate,
    } = g;
    check_len(OP, "a", a.len(), m * k)?;
    check_len(OP, "b", b.len(), k * n)?;
    check_len(OP, "c", c.len(), m * n)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if !accumulate {
            c.fill(0.0);
        }
        return Ok(());
    }
    // Element (i, p) of op(A) is at i*rsa + p*csa; element (p, j) of op(B) at p*rsb + j*csb.
    let (rsa, csa) = if trans_a {
        (1isize, m as isize)
    } else {
        (k as isize, 1isize)
    };
    let (rsb, csb) = if trans_b {
        (1isize, k as isize)
    } else {
        (n as isize, 1isize)
    };
    let beta = if accumulate { 1.0f32 } else { 0.0f32 };
    let threads = rayon::current_num_threads();
    let work = m * n * k;
    if threads <= 1 || work < PAR_MIN_WORK {
        // SAFETY: the strides describe exactly the buffers checked above; c is exclusively borrowed.
        unsafe {
            matrixmultiply::sgemm(
                m,
                k,
                n,
                1.0,
                a.as_ptr(),
                rsa,
                csa,
                b.as_ptr(),
                rsb,
                csb,
                beta,
                c.as_mut_ptr(),
                n as isize,
                1,
            );
        }
        return Ok(());
    }
    // One block per thread: each sgemm call packs its whole operand panel once, so fewer,
    // larger blocks waste less packing. The split never changes an element's arithmetic.
    if m >= 2 * ROW_ALIGN || m >= n {
        let row_block = m.div_ceil(threads).div_ceil(ROW_ALIGN) * ROW_ALIGN;
        c.par_chunks_mut(row_block * n)
            .enumerate()
            .for_each(|(blk, c_blk)| {
                let r0 = blk * row_block;
                let rows = c_blk.len() / n;
                // SAFETY: rows r0..r0+rows of op(A) lie inside `a` (checked lengths); c_blk is this
                // task's own contiguous block of C rows.
                unsafe {
                    matrixmultiply::sgemm(
                        rows,
                        k,
                        n,
                        1.0,
                        a.as_ptr().offset(r0 as isize * rsa),
                        rsa,
                        csa,
                        b.as_ptr(),
                        rsb,
                        csb,
                        beta,
                        c_blk.as_mut_ptr(),
                        n as isize,
                        1,
                    );
                }
            });
    } else {
        let cp = SendPtr(c.as_mut_ptr());
        let col_block = n.div_ceil(threads).div_ceil(COL_ALIGN) * COL_ALIGN;
        let blocks = n.div_ceil(col_block);
        (0..blocks).into_par_iter().for_each(|blk| {
            let j0 = blk * col_block;
            let cols = col_block.min(n - j0);
            let cp = &cp;
            // SAFETY: columns j0..j0+cols of C are written by this task only; op(B)'s columns
            // j0..j0+cols lie inside `b`.
            unsafe {
                matrixmultiply::sgemm(
                    m,
                    k,
                    cols,
                    1.0,
                    a.as_ptr(),
                    rsa,
                    csa,
                    b.as_ptr().offset(j0 as isize * csb),
                    rsb,
                    csb,
                    beta,
                    cp.0.add(j0),
                    n as isize,
                    1,
                );
            }
        });
    }
    Ok(())
}

/// `nn.Linear` forward: `y[m, n] = x[m, k] w[n, k]^T + b[n]` (bias optional).
pub fn linear_fwd(
    y: &mut [f32],
    x: &[f32],
    w: &[f32],
    b: Option<&[f32]>,
    m: usize,
    k: usize,
    n: usize,
) -> Result<()> {
    matmul(y, x, w, Gemm::nt(m, k, n))?;
    if let Some(b) = b {
        if b.len() != n {
            return Err(shape_err(
                "linear_fwd",
                format!("bias has {} elements, expected {n}", b.len()),
            ));
        }
        y.par_chunks_mut(n.max(1)).for_each(|row| {
            for (o, bi) in row.iter_mut().zip(b) {
                *o += bi;
            }
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{rand_vec, rel_err};

    fn naive(a: &[f32], b: &[f32], c0: &[f32], g: Gemm) -> Vec<f64> {
        let mut c = vec![0f64; g.m * g.n];
        for i in 0..g.m {
            for j in 0..g.n {
                let mut s = if g.accumulate {
                    c0[i * g.n + j] as f64
                } else {
                    0.0
                };
                for p in 0..g.k {
                    let av = if g.trans_a {
                        a[p * g.m + i]
                    } else {
                        a[i * g.k + p]
                    };
                    let bv = if g.trans_b {
                        b[j * g.k + p]
                    } else {
                        b[p * g.n + j]
                    };
                    s += av as f64 * bv as f64;
                }
                c[i * g.n + j] = s;
            }
        }
        c
    }

    #[test]
    fn matmul_matches_f64_reference_all_layouts() {
        let mut seed = 1;
        for &(m, k, n) in &[
            (1, 7, 5),
            (3, 300, 17),
            (130, 65, 33),
            (5, 129, 1100),
            (70, 513, 90),
        ] {
            for &(ta, tb, acc) in &[
                (false, false, false),
                (false, true, false),
                (true, false, false),
                (true, true, true),
                (false, true, true),
            ] {
                seed += 1;
                let g = Gemm {
                    m,
                    k,
                    n,
                    trans_a: ta,
                    trans_b: tb,
                    accumulate: acc,
                };
                let a = rand_vec(m * k, seed);
                let b = rand_vec(k * n, seed + 100);
                let c0 = rand_vec(m * n, seed + 200);
                let mut c = c0.clone();
                matmul(&mut c, &a, &b, g).unwrap();
                let r = naive(&a, &b, &c0, g);
                let e = rel_err(&c, &r);
                assert!(e < 1e-5, "{g:?}: rel err {e}");
            }
        }
    }

    #[test]
    fn matmul_rows_are_batch_invariant_bitwise() {
        // Row i of a big GEMM equals the same row computed alone, for row and column splits.
        for &(m, k, n) in &[(200, 300, 96), (9, 700, 3000)] {
            let a = rand_vec(m * k, 7);
            let w = rand_vec(n * k, 8);
            let mut c = vec![0f32; m * n];
            matmul(&mut c, &a, &w, Gemm::nt(m, k, n)).unwrap();
            for i in [0, m / 2, m - 1] {
                let mut ci = vec![0f32; n];
                matmul(&mut ci, &a[i * k..(i + 1) * k], &w, Gemm::nt(1, k, n)).unwrap();
                assert_eq!(&c[i * n..(i + 1) * n], &ci[..], "row {i} of ({m},{k},{n})");
            }
        }
    }

    #[test]
    fn matmul_is_independent_of_thread_count_bitwise() {
        for &(m, k, n) in &[(300, 200, 130), (7, 400, 2000)] {
            let a = rand_vec(m * k, 21);
            let w = rand_vec(n * k, 22);
            let run = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let mut c = vec![0f32; m * n];
                pool.install(|| matmul(&mut c, &a, &w, Gemm::nt(m, k, n)).unwrap());
                c
            };
            let one = run(1);
            for t in [2, 3, 5] {
                assert_eq!(run(t), one, "({m},{k},{n}) with {t} threads");
            }
        }
    }

    #[test]
    fn linear_fwd_adds_bias_and_rejects_bad_shapes() {
        let (m, k, n) = (4, 9, 6);
        let x = rand_vec(m * k, 1);
        let w = rand_vec(n * k, 2);
        let b = rand_vec(n, 3);
        let mut y = vec![0f32; m * n];
        linear_fwd(&mut y, &x, &w, Some(&b), m, k, n).unwrap();
        let r = naive(&x, &w, &[], Gemm::nt(m, k, n));
        let r: Vec<f64> = r
            .iter()
            .enumerate()
            .map(|(i, v)| v + b[i % n] as f64)
            .collect();
        assert!(rel_err(&y, &r) < 1e-6);
        assert!(linear_fwd(&mut y, &x, &w, Some(&b[..n - 1]), m, k, n).is_err());
        assert!(linear_fwd(&mut y[..5], &x, &w, None, m, k, n).is_err());
    }
}
