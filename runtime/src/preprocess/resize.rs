//! Pillow's resize for 8-bit RGB images ([`resize_pil`]) and its filters ([`Resample`]): the
//! separable two-pass convolution of `ImagingResample` (see the parent module's doc for what
//! was compared with Pillow and how closely).

use serde::{Deserialize, Serialize};

use super::{PreprocessError, Result, RgbImage};

/// Pillow's resampling filters, numbered as `PIL.Image.Resampling` (the `resample` field of a
/// `preprocessor_config.json`). Nearest (0) is not supported.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Resample {
    Lanczos,
    Bilinear,
    Bicubic,
    Box,
    Hamming,
}

impl Resample {
    pub fn from_pil(code: u64) -> Result<Self> {
        Ok(match code {
            1 => Resample::Lanczos,
            2 => Resample::Bilinear,
            3 => Resample::Bicubic,
            4 => Resample::Box,
            5 => Resample::Hamming,
            _ => {
                return Err(PreprocessError::Invalid(format!(
                "resample {code} is not supported (1-5: lanczos, bilinear, bicubic, box, hamming)"
            )))
            }
        })
    }

    fn support(self) -> f64 {
        match self {
            Resample::Box => 0.5,
            Resample::Bilinear | Resample::Hamming => 1.0,
            Resample::Bicubic => 2.0,
            Resample::Lanczos => 3.0,
        }
    }

    /// The filter kernels of Pillow's `Resample.c`.
    fn filter(self, x: f64) -> f64 {
        fn sinc(x: f64) -> f64 {
            if x == 0.0 {
                return 1.0;
            }
            let x = x * std::f64::consts::PI;
            x.sin() / x
        }
        match self {
            Resample::Box => {
                if x > -0.5 && x <= 0.5 {
                    1.0
                } else {
                    0.0
                }
            }
            Resample::Bilinear => {
                let x = x.abs();
                if x < 1.0 {
                    1.0 - x
                } else {
                    0.0
                }
            }
            Resample::Hamming => {
                let x = x.abs();
                if x == 0.0 {
                    1.0
                } else if x >= 1.0 {
                    0.0
                } else {
                    let x = x * std::f64::consts::PI;
                    x.sin() / x * (0.54 + 0.46 * x.cos())
                }
            }
            Resample::Bicubic => {
                const A: f64 = -0.5;
                let x = x.abs();
                if x < 1.0 {
                    ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * A
                } else {
                    0.0
                }
            }
            Resample::Lanczos => {
                if (-3.0..3.0).contains(&x) {
                    sinc(x) * sinc(x / 3.0)
                } else {
                    0.0
                }
            }
        }
    }
}

/// Pillow's fixed-point precision for 8-bit resampling (`32 - 8 - 2`).
const PRECISION_BITS: u32 = 22;

/// Per output pixel: first input index, number of taps; and the taps, `ksize` per pixel.
struct Coeffs {
    ksize: usize,
    bounds: Vec<(usize, usize)>,
    kk: Vec<i64>,
}

/// Pillow's `precompute_coeffs` followed by `normalize_coeffs_8bpc`.
fn precompute_coeffs(in_size: usize, out_size: usize, filter: Resample) -> Coeffs {
    let (in0, in1) = (0.0f64, in_size as f64);
    let scale = (in1 - in0) / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = filter.support() * filterscale;
    let ksize = support.ceil() as usize * 2 + 1;
    let mut bounds = Vec::with_capacity(out_size);
    let mut kk = vec![0i64; out_size * ksize];
    let mut k = vec![0f64; ksize];
    for xx in 0..out_size {
        let center = in0 + (xx as f64 + 0.5) * scale;
        let ss = 1.0 / filterscale;
        // C's (int) cast truncates toward zero.
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize - xmin;
        let mut ww = 0.0;
        for (x, kx) in k.iter_mut().enumerate().take(xmax) {
            let w = filter.filter(((x + xmin) as f64 - center + 0.5) * ss);
            *kx = w;
            ww += w;
        }
        for (x, kx) in k.iter().enumerate().take(xmax) {
            let w = if ww != 0.0 { kx / ww } else { *kx };
            let q = w * (1u64 << PRECISION_BITS) as f64;
            kk[xx * ksize + x] = if w < 0.0 {
                (-0.5 + q) as i32 as i64
            } else {
                (0.5 + q) as i32 as i64
            };
        }
        bounds.push((xmin, xmax));
    }
    Coeffs { ksize, bounds, kk }
}

#[inline]
fn clip8(ss: i64) -> u8 {
    (ss >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Horizontal pass over rows `first..first+rows` of `src` (`in_w` wide, RGB).
fn pass_horizontal(src: &[u8], in_w: usize, first: usize, rows: usize, k: &Coeffs) -> Vec<u8> {
    let out_w = k.bounds.len();
    let mut out = vec![0u8; rows * out_w * 3];
    for yy in 0..rows {
        let row = &src[(yy + first) * in_w * 3..][..in_w * 3];
        for (xx, &(xmin, xmax)) in k.bounds.iter().enumerate() {
            let taps = &k.kk[xx * k.ksize..][..xmax];
            for c in 0..3 {
                let mut ss: i64 = 1 << (PRECISION_BITS - 1);
                for (x, &kx) in taps.iter().enumerate() {
                    ss += row[(x + xmin) * 3 + c] as i64 * kx;
                }
                out[(yy * out_w + xx) * 3 + c] = clip8(ss);
            }
        }
    }
    out
}

/// Vertical pass over `src` (`w` wide, RGB); `k`'s bounds index rows of `src`.
fn pass_vertical(src: &[u8], w: usize, k: &Coeffs) -> Vec<u8> {
    let out_h = k.bounds.len();
    let mut out = vec![0u8; out_h * w * 3];
    for (yy, &(ymin, ymax)) in k.bounds.iter().enumerate() {
        let taps = &k.kk[yy * k.ksize..][..ymax];
        for xx in 0..w {
            for c in 0..3 {
                let mut ss: i64 = 1 << (PRECISION_BITS - 1);
                for (y, &ky) in taps.iter().enumerate() {
                    ss += src[((y + ymin) * w + xx) * 3 + c] as i64 * ky;
                }
                out[(yy * w + xx) * 3 + c] = clip8(ss);
            }
        }
    }
    out
}

/// Resizes `img` to `width` x `height` as `PIL.Image.resize(..., resample)` does for an RGB
/// image (see the module doc). Pass order: vertical first when the height shrinks and the
/// width grows, else horizontal first. Pillow's published `Resample.c` always runs the
/// horizontal pass first, but the Pillow 13.0 wheel measured here ran the vertical pass first
/// in every such mixed case (and in some shrink-both cases, by a rule not identified); the
/// order changes the u8 rounding between passes, so it decides exactness.
pub fn resize_pil(img: &RgbImage, width: u32, height: u32, filter: Resample) -> Result<RgbImage> {
    let (in_w, in_h) = (img.width() as usize, img.height() as usize);
    let (out_w, out_h) = (width as usize, height as usize);
    if out_w == 0 || out_h == 0 || in_w == 0 || in_h == 0 {
        return Err(PreprocessError::Size {
            height: in_h as u64,
            width: in_w as u64,
            msg: format!("cannot resize to {out_h}x{out_w}"),
        });
    }
    let need_h = out_w != in_w;
    let need_v = out_h != in_h;
    let src = img.as_raw();
    let out = match (need_h, need_v) {
        (false, false) => return Ok(img.clone()),
        (true, false) => {
            pass_horizontal(src, in_w, 0, in_h, &precompute_coeffs(in_w, out_w, filter))
        }
        (false, true) => pass_vertical(src, in_w, &precompute_coeffs(in_h, out_h, filter)),
        (true, true) if out_h < in_h && out_w > in_w => {
            let tmp = pass_vertical(src, in_w, &precompute_coeffs(in_h, out_h, filter));
            pass_horizontal(
                &tmp,
                in_w,
                0,
                out_h,
                &precompute_coeffs(in_w, out_w, filter),
            )
        }
        (true, true) => {
            // Horizontal pass over just the rows the vertical pass reads.
            let horiz = precompute_coeffs(in_w, out_w, filter);
            let mut vert = precompute_coeffs(in_h, out_h, filter);
            let first = vert.bounds[0].0;
            let (lmin, lcount) = vert.bounds[out_h - 1];
            for b in vert.bounds.iter_mut() {
                b.0 -= first;
            }
            let tmp = pass_horizontal(src, in_w, first, lmin + lcount - first, &horiz);
            pass_vertical(&tmp, out_w, &vert)
        }
    };
    Ok(RgbImage::from_raw(out_w as u32, out_h as u32, out).expect("buffer of the right size"))
}
