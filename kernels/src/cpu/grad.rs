//! CPU twins of the training step's gradient kernels (`cuda::grad`): the grad-norm's partial
//! sums in the device's order, the clip's scaling, fixed-order row sums and the fp32 add. Values
//! are f32 (a bf16 buffer's values widened); where the device stores bf16 it rounds these once.

/// Threads per block of the device's partial-sum kernel.
const THREADS: usize = 256;

/// The partial sums of squares of `g` over `blocks` blocks of 256 threads, in the device
/// kernel's order (`sumsq_partial_f32`): thread `t` of block `b` starts at `b * 256 + t` and
/// strides by `blocks * 256`, four accumulators taking four strides at a time, added as
/// `(a0 + a1) + (a2 + a3)`; then each block's threads are added by halving (`s[i] += s[i + w]`,
/// `w` = 128, 64, ..., 1). All in f64 with one rounding per operation.
pub fn sumsq_partial(g: &[f32], blocks: usize) -> Vec<f64> {
    let n = g.len();
    let stride = blocks * THREADS;
    let sq = |i: usize| {
        let x = g[i] as f64;
        x * x
    };
    (0..blocks)
        .map(|b| {
            let mut s: Vec<f64> = (0..THREADS)
                .map(|t| {
                    let mut i = b * THREADS + t;
                    let (mut a0, mut a1, mut a2, mut a3) = (0f64, 0f64, 0f64, 0f64);
                    while i + 3 * stride < n {
                        a0 += sq(i);
                        a1 += sq(i + stride);
                        a2 += sq(i + 2 * stride);
                        a3 += sq(i + 3 * stride);
                        i += 4 * stride;
                    }
                    while i < n {
                        a0 += sq(i);
                        i += stride;
                    }
                    (a0 + a1) + (a2 + a3)
                })
                .collect();
            let mut w = THREADS / 2;
            while w > 0 {
                for i in 0..w {
                    s[i] += s[i + w];
                }
                w /= 2;
            }
            s[0]
        })
        .collect()
}

/// `g *= c`, one rounding per element.
pub fn scale(g: &mut [f32], c: f32) {
    for x in g {
        *x *= c;
    }
}

/// Row `dst_rows[d]` of `dst` (`[_, width]`) = the f32 sum, in list order, of the rows
/// `lists[d]` of `src` (`[_, width]`); rows not named are left as they are.
///
/// # Panics
/// When a named row lies outside its buffer or `lists` and `dst_rows` differ in length (the
/// device launcher refuses those).
pub fn gather_sum_rows(
    dst: &mut [f32],
    dst_rows: &[u32],
    src: &[f32],
    lists: &[Vec<u32>],
    width: usize,
) {
    assert_eq!(dst_rows.len(), lists.len(), "one list per destination row");
    for (&d, list) in dst_rows.iter().zip(lists) {
        let d = d as usize;
        for c in 0..width {
            let mut acc = 0f32;
            for &r in list {
                acc += src[r as usize * width + c];
            }
            dst[d * width + c] = acc;
        }
    }
}

/// `x = x + y` elementwise (f32; the device rounds the sum once to bf16).
pub fn add_into(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partials_add_up_to_the_sum_of_squares() {
        // lengths around the grid's stride and its four-stride steps, and one far past them
        for (n, blocks) in [(0, 4), (1, 4), (1023, 4), (1024, 4), (4097, 4), (70_001, 8)] {
            let g: Vec<f32> = (0..n)
                .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 250.0)
                .collect();
            let p = sumsq_partial(&g, blocks);
            assert_eq!(p.len(), blocks);
            let want: f64 = g.iter().map(|&x| (x as f64) * (x as f64)).sum();
            let got: f64 = p.iter().sum();
            assert!(
                (got - want).abs() <= 1e-12 * want.max(1.0),
                "n {n}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn partials_follow_the_grid() {
        // one block sees every element its threads' strides reach, no other
        let g = vec![1f32; 2 * 256 * 4 + 3];
        let p = sumsq_partial(&g, 2);
        assert_eq!(p, vec![1027.0, 1024.0]);
    }

    #[test]
    fn row_sums_follow_their_lists() {
        let width = 3;
        let src: Vec<f32> = (0..12).map(|x| x as f32).collect(); // 4 rows
        let mut dst = vec![-1f32; 9]; // 3 rows
        gather_sum_rows(&mut dst, &[2, 0], &src, &[vec![0, 3], vec![]], width);
        assert_eq!(dst, vec![0.0, 0.0, 0.0, -1.0, -1.0, -1.0, 9.0, 11.0, 13.0]);
    }

    #[test]
    fn scale_and_add() {
        let mut g = vec![1.5f32, -2.0];
        scale(&mut g, 0.5);
        assert_eq!(g, vec![0.75, -1.0]);
        add_into(&mut g, &[0.25, 1.0]);
        assert_eq!(g, vec![1.0, 0.0]);
    }
}
