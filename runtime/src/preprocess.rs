//! Image and video-frame preprocessing, exactly as Hugging Face's Qwen2-VL processors do it.
//!
//! What this module knows: `smart_resize` (the target size: multiples of `patch*merge` = 28,
//! pixel count within `[min_pixels, max_pixels]`, Python's round-half-to-even included), the
//! resize itself, rescale by 1/255, normalisation with the OpenAI CLIP mean/std, temporal
//! grouping of frames by `temporal_patch_size` (the last frame repeated to fill the last group),
//! and patchify into `pixel_values` `[grid_t*grid_h*grid_w, C*tp*p*p]` in Hugging Face's row
//! order (merge-size interleaved: `t, h/m, w/m, m_h, m_w`) and column order (`c, tp, p_h, p_w`),
//! with `grid_thw = [grid_t, grid_h, grid_w]`.
//!
//! Resize: [`resize_pil`] is a port of Pillow's `ImagingResample` for 8-bit images (the code
//! `PIL.Image.resize` runs for `Qwen2VLImageProcessorPil`, transformers' numpy/PIL backend):
//! a separable two-pass convolution (pass order: see [`resize_pil`]), with the filter support
//! widened by the downscale factor (antialiasing), weights normalised per output pixel and
//! quantised to 22-bit fixed point, and each pass rounded and clamped to u8. Bicubic (a = -0.5,
//! what Qwen2-VL uses) is compared with Pillow and bit-identical; bilinear and box use the same
//! exact arithmetic but were not compared; lanczos and hamming use `sin`/`cos` from Rust's
//! libm, which may differ from C's in the last ulp. `tests/reference/preprocess_compare.py` measures
//! the whole pipeline against transformers 5.24 + Pillow 13.0: max abs error 0 (bit-identical
//! `pixel_values`) on 16 cases of images and videos from 28x28 to 2000x1500.
//!
//! Not reproduced: transformers' torchvision backends (`Qwen2VLImageProcessor` with torchvision
//! installed, and the torch-only `Qwen2VLVideoProcessor`) resize with
//! `torchvision.transforms.functional.resize(..., BICUBIC, antialias=True)` on float tensors,
//! whose output is not rounded to u8 between the passes; their pixel values differ from the
//! PIL path by up to a few 1/255 steps at edges. Frames given here are used as given (no frame
//! sampling by fps).
//!
//! Invariants: output depends only on the input pixels and the config (no global state);
//! every frame of a video is resized to the size `smart_resize` gives for frame 0, and all
//! frames must have frame 0's size (as in the stacked video tensor of transformers).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The OpenAI CLIP normalisation (transformers' `OPENAI_CLIP_MEAN` / `OPENAI_CLIP_STD`).
pub const OPENAI_CLIP_MEAN: [f64; 3] = [0.48145466, 0.4578275, 0.40821073];
pub const OPENAI_CLIP_STD: [f64; 3] = [0.26862954, 0.26130258, 0.27577711];

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum PreprocessError {
    #[error("cannot read image {path}: {msg}")]
    Image { path: PathBuf, msg: String },
    #[error("cannot read {path}: {msg}")]
    Config { path: PathBuf, msg: String },
    #[error("image of {height}x{width}: {msg}")]
    Size {
        height: u64,
        width: u64,
        msg: String,
    },
    #[error("frame {index} is {got_w}x{got_h} but frame 0 is {w}x{h}: all frames of a video must have one size")]
    FrameSize {
        index: usize,
        got_w: u32,
        got_h: u32,
        w: u32,
        h: u32,
    },
    #[error("a video needs at least one frame")]
    NoFrames,
    #[error("preprocess config: {0}")]
    Invalid(String),
}

pub type Result<T, E = PreprocessError> = std::result::Result<T, E>;

/// An 8-bit RGB image, rows top to bottom, pixels interleaved (`HWC`).
pub type RgbImage = image::RgbImage;

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

/// The processor's settings (the fields of a Qwen2-VL `preprocessor_config.json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PreprocessConfig {
    pub patch_size: u32,
    pub temporal_patch_size: u32,
    pub merge_size: u32,
    /// `size.shortest_edge` (a pixel count despite its name).
    pub min_pixels: u64,
    /// `size.longest_edge` (a pixel count).
    pub max_pixels: u64,
    pub do_resize: bool,
    pub resample: Resample,
    pub do_rescale: bool,
    pub rescale_factor: f64,
    pub do_normalize: bool,
    pub image_mean: [f64; 3],
    pub image_std: [f64; 3],
}

impl PreprocessConfig {
    /// `Qwen2VLImageProcessor`'s defaults (min 56*56, max 28*28*1280 pixels).
    pub fn qwen2_vl_image() -> Self {
        Self {
            patch_size: 14,
            temporal_patch_size: 2,
            merge_size: 2,
            min_pixels: 56 * 56,
            max_pixels: 28 * 28 * 1280,
            do_resize: true,
            resample: Resample::Bicubic,
            do_rescale: true,
            rescale_factor: 1.0 / 255.0,
            do_normalize: true,
            image_mean: OPENAI_CLIP_MEAN,
            image_std: OPENAI_CLIP_STD,
        }
    }

    /// `Qwen2VLVideoProcessor`'s defaults (min 128*28*28, max 28*28*768 pixels per frame).
    pub fn qwen2_vl_video() -> Self {
        Self {
            min_pixels: 128 * 28 * 28,
            max_pixels: 28 * 28 * 768,
            ..Self::qwen2_vl_image()
        }
    }

    /// For a model built from dimensions (no checkpoint): patch, temporal patch and merge sizes
    /// from the vision tower, and the given pixel bounds. Small media (the tiny task's 28x28 or
    /// 56x56 frames) need `min_pixels` at most their own size, else they are upscaled.
    pub fn for_vision(
        v: &rollplex_plan::spec::VisionDims,
        min_pixels: u64,
        max_pixels: u64,
    ) -> Self {
        Self {
            patch_size: v.patch_size,
            temporal_patch_size: v.temporal_patch_size,
            merge_size: v.spatial_merge_size,
            min_pixels,
            max_pixels,
            ..Self::qwen2_vl_image()
        }
    }

    /// `patch_size * merge_size`: both sides of a resized image are multiples of it.
    pub fn factor(&self) -> u32 {
        self.patch_size * self.merge_size
    }

    /// Columns of `pixel_values`: `C * temporal_patch_size * patch_size^2`.
    pub fn row_len(&self) -> usize {
        3 * (self.temporal_patch_size * self.patch_size * self.patch_size) as usize
    }

    /// Reads a `preprocessor_config.json` / `video_preprocessor_config.json`, starting from
    /// `defaults` for fields it does not set. Both spellings of the pixel bounds are read
    /// (`min_pixels`/`max_pixels` and `size: {shortest_edge, longest_edge}`).
    pub fn from_file(path: impl AsRef<Path>, defaults: Self) -> Result<Self> {
        let path = path.as_ref();
        let err = |msg: String| PreprocessError::Config {
            path: path.into(),
            msg,
        };
        let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| err(e.to_string()))?;
        let mut c = defaults;
        let uint = |key: &str, v: &serde_json::Value| {
            v.as_u64().ok_or_else(|| {
                err(format!(
                    "field `{key}` must be a non-negative integer, got {v}"
                ))
            })
        };
        let float = |key: &str, v: &serde_json::Value| {
            v.as_f64()
                .ok_or_else(|| err(format!("field `{key}` must be a number, got {v}")))
        };
        let boolean = |key: &str, v: &serde_json::Value| {
            v.as_bool()
                .ok_or_else(|| err(format!("field `{key}` must be true or false, got {v}")))
        };
        let triple = |key: &str, v: &serde_json::Value| -> Result<[f64; 3]> {
            match v
                .as_array()
                .map(|a| a.iter().map(|x| x.as_f64()).collect::<Option<Vec<_>>>())
            {
                Some(Some(a)) if a.len() == 3 => Ok([a[0], a[1], a[2]]),
                _ => Err(err(format!(
                    "field `{key}` must be a list of 3 numbers, got {v}"
                ))),
            }
        };
        let u32_of = |key: &str, v: &serde_json::Value| -> Result<u32> {
            let n = uint(key, v)?;
            u32::try_from(n)
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| err(format!("field `{key}` must be in 1..2^32, got {n}")))
        };
        if let Some(size) = v.get("size") {
            if let Some(x) = size.get("shortest_edge") {
                c.min_pixels = uint("size.shortest_edge", x)?;
            }
            if let Some(x) = size.get("longest_edge") {
                c.max_pixels = uint("size.longest_edge", x)?;
            }
        }
        for (key, x) in v.as_object().into_iter().flatten() {
            match key.as_str() {
                "min_pixels" => c.min_pixels = uint(key, x)?,
                "max_pixels" => c.max_pixels = uint(key, x)?,
                "patch_size" => c.patch_size = u32_of(key, x)?,
                "temporal_patch_size" => c.temporal_patch_size = u32_of(key, x)?,
                "merge_size" => c.merge_size = u32_of(key, x)?,
                "do_resize" => c.do_resize = boolean(key, x)?,
                "do_rescale" => c.do_rescale = boolean(key, x)?,
                "do_normalize" => c.do_normalize = boolean(key, x)?,
                "rescale_factor" => c.rescale_factor = float(key, x)?,
                "image_mean" => c.image_mean = triple(key, x)?,
                "image_std" => c.image_std = triple(key, x)?,
                "resample" => {
                    c.resample =
                        Resample::from_pil(uint(key, x)?).map_err(|e| err(e.to_string()))?
                }
                _ => {}
            }
        }
        if c.min_pixels > c.max_pixels {
            return Err(err(format!(
                "min_pixels {} > max_pixels {}",
                c.min_pixels, c.max_pixels
            )));
        }
        Ok(c)
    }

    /// The image and video configs of a checkpoint directory: `preprocessor_config.json` for
    /// images (and for videos when there is no `video_preprocessor_config.json`, as older
    /// transformers did), over the Qwen2-VL defaults of each.
    pub fn from_checkpoint(dir: impl AsRef<Path>) -> Result<(Self, Self)> {
        let dir = dir.as_ref();
        let image_path = dir.join("preprocessor_config.json");
        if !image_path.is_file() {
            return Err(PreprocessError::Config {
                path: image_path,
                msg: "no such file".into(),
            });
        }
        let image = Self::from_file(&image_path, Self::qwen2_vl_image())?;
        let video_path = dir.join("video_preprocessor_config.json");
        let video = if video_path.is_file() {
            Self::from_file(&video_path, Self::qwen2_vl_video())?
        } else {
            image.clone()
        };
        Ok((image, video))
    }
}

/// Python's `round` on a non-negative float: halves go to the even neighbour.
fn py_round(x: f64) -> u64 {
    x.round_ties_even() as u64
}

/// The target `(height, width)` of transformers' `smart_resize`: both multiples of `factor`,
/// pixels within `[min_pixels, max_pixels]`, aspect ratio kept as closely as possible.
pub fn smart_resize(
    height: u64,
    width: u64,
    factor: u64,
    min_pixels: u64,
    max_pixels: u64,
) -> Result<(u64, u64)> {
    let size_err = |msg: String| PreprocessError::Size { height, width, msg };
    if height == 0 || width == 0 || factor == 0 {
        return Err(size_err(format!(
            "sides and factor ({factor}) must be positive"
        )));
    }
    let (hf, wf, ff) = (height as f64, width as f64, factor as f64);
    let ratio = hf.max(wf) / hf.min(wf);
    if ratio > 200.0 {
        return Err(size_err(format!(
            "absolute aspect ratio must be smaller than 200, got {ratio}"
        )));
    }
    let mut h_bar = py_round(hf / ff) * factor;
    let mut w_bar = py_round(wf / ff) * factor;
    if h_bar * w_bar > max_pixels {
        let beta = ((height * width) as f64 / max_pixels as f64).sqrt();
        h_bar = factor.max((hf / beta / ff).floor() as u64 * factor);
        w_bar = factor.max((wf / beta / ff).floor() as u64 * factor);
    } else if h_bar * w_bar < min_pixels {
        let beta = (min_pixels as f64 / (height * width) as f64).sqrt();
        h_bar = (hf * beta / ff).ceil() as u64 * factor;
        w_bar = (wf * beta / ff).ceil() as u64 * factor;
    }
    if h_bar == 0 || w_bar == 0 {
        return Err(size_err(format!("resizes to {h_bar}x{w_bar}")));
    }
    Ok((h_bar, w_bar))
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

/// Opens an image file (PNG or JPEG) as RGB. Alpha is dropped and grey is replicated, as
/// `PIL.Image.convert("RGB")` does.
pub fn load_image(path: impl AsRef<Path>) -> Result<RgbImage> {
    let path = path.as_ref();
    let img = image::ImageReader::open(path)
        .map_err(|e| PreprocessError::Image {
            path: path.into(),
            msg: e.to_string(),
        })?
        .with_guessed_format()
        .map_err(|e| PreprocessError::Image {
            path: path.into(),
            msg: e.to_string(),
        })?
        .decode()
        .map_err(|e| PreprocessError::Image {
            path: path.into(),
            msg: e.to_string(),
        })?;
    Ok(img.to_rgb8())
}

/// One media item's patches.
#[derive(Clone, Debug, PartialEq)]
pub struct Patches {
    /// Row-major `[grid_t*grid_h*grid_w, row_len]`.
    pub pixel_values: Vec<f32>,
    pub grid_thw: [u32; 3],
    /// `C * temporal_patch_size * patch_size^2`.
    pub row_len: usize,
}

impl Patches {
    pub fn rows(&self) -> usize {
        self.pixel_values.len() / self.row_len
    }
}

/// One image: `grid_t = 1`, the image fills every temporal slot of its patches.
pub fn preprocess_image(img: &RgbImage, cfg: &PreprocessConfig) -> Result<Patches> {
    preprocess_frames(std::slice::from_ref(img), cfg)
}

/// A video's frames (already sampled): all resized to frame 0's target size, grouped by
/// `temporal_patch_size` with the last frame repeated to fill the last group.
pub fn preprocess_video(frames: &[RgbImage], cfg: &PreprocessConfig) -> Result<Patches> {
    preprocess_frames(frames, cfg)
}

fn preprocess_frames(frames: &[RgbImage], cfg: &PreprocessConfig) -> Result<Patches> {
    let first = frames.first().ok_or(PreprocessError::NoFrames)?;
    for (i, f) in frames.iter().enumerate() {
        if f.dimensions() != first.dimensions() {
            return Err(PreprocessError::FrameSize {
                index: i,
                got_w: f.width(),
                got_h: f.height(),
                w: first.width(),
                h: first.height(),
            });
        }
    }
    let (p, m, tp) = (
        cfg.patch_size as usize,
        cfg.merge_size as usize,
        cfg.temporal_patch_size as usize,
    );
    if p == 0 || m == 0 || tp == 0 {
        return Err(PreprocessError::Invalid(
            "patch_size, merge_size and temporal_patch_size must be positive".into(),
        ));
    }
    let (h, w) = if cfg.do_resize {
        smart_resize(
            first.height() as u64,
            first.width() as u64,
            (p * m) as u64,
            cfg.min_pixels,
            cfg.max_pixels,
        )?
    } else {
        (first.height() as u64, first.width() as u64)
    };
    let (h, w) = (h as usize, w as usize);
    if h % (p * m) != 0 || w % (p * m) != 0 {
        return Err(PreprocessError::Size {
            height: h as u64,
            width: w as u64,
            msg: format!(
                "sides must be multiples of patch_size*merge_size = {} (do_resize is off)",
                p * m
            ),
        });
    }
    // Each frame as normalised channel planes [3][h*w].
    let mean = cfg.image_mean.map(|x| x as f32);
    let std = cfg.image_std.map(|x| x as f32);
    let mut planes: Vec<Vec<f32>> = Vec::with_capacity(frames.len());
    for f in frames {
        let resized;
        let f = if (f.height() as usize, f.width() as usize) != (h, w) {
            resized = resize_pil(f, w as u32, h as u32, cfg.resample)?;
            &resized
        } else {
            f
        };
        let mut plane = vec![0f32; 3 * h * w];
        for (i, px) in f.as_raw().chunks_exact(3).enumerate() {
            for c in 0..3 {
                // transformers: uint8 -> float64 * scale -> float32; then (x - mean) / std in float32.
                let mut v = if cfg.do_rescale {
                    (px[c] as f64 * cfg.rescale_factor) as f32
                } else {
                    px[c] as f32
                };
                if cfg.do_normalize {
                    v = (v - mean[c]) / std[c];
                }
                plane[c * h * w + i] = v;
            }
        }
        planes.push(plane);
    }
    let grid_t = frames.len().div_ceil(tp);
    let (gh, gw) = (h / p, w / p);
    let row_len = 3 * tp * p * p;
    let mut out = vec![0f32; grid_t * gh * gw * row_len];
    let mut row = 0;
    for t in 0..grid_t {
        for bh in 0..gh / m {
            for bw in 0..gw / m {
                for mh in 0..m {
                    for mw in 0..m {
                        let dst = &mut out[row * row_len..][..row_len];
                        let (y0, x0) = ((bh * m + mh) * p, (bw * m + mw) * p);
                        let mut col = 0;
                        for c in 0..3 {
                            for k in 0..tp {
                                let frame = &planes[(t * tp + k).min(frames.len() - 1)];
                                for py in 0..p {
                                    let src = &frame[c * h * w + (y0 + py) * w + x0..][..p];
                                    dst[col..col + p].copy_from_slice(src);
                                    col += p;
                                }
                            }
                        }
                        row += 1;
                    }
                }
            }
        }
    }
    Ok(Patches {
        pixel_values: out,
        grid_thw: [grid_t as u32, gh as u32, gw as u32],
        row_len,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noise(w: u32, h: u32, seed: u64) -> RgbImage {
        let mut s = seed;
        RgbImage::from_fn(w, h, |_, _| {
            let mut b = [0u8; 3];
            for v in &mut b {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                *v = (s >> 56) as u8;
            }
            image::Rgb(b)
        })
    }

    #[test]
    fn smart_resize_matches_transformers_cases() {
        // Values computed with transformers 5.24's smart_resize.
        let f = 28;
        assert_eq!(
            smart_resize(28, 28, f, 56 * 56, 28 * 28 * 1280).unwrap(),
            (56, 56)
        );
        assert_eq!(
            smart_resize(56, 56, f, 28 * 28, 28 * 28 * 1280).unwrap(),
            (56, 56)
        );
        // round-half-to-even: 42/28 = 1.5 -> 2, 70/28 = 2.5 -> 2.
        assert_eq!(smart_resize(42, 70, f, 28 * 28, 1 << 30).unwrap(), (56, 56));
        assert_eq!(
            smart_resize(480, 640, f, 56 * 56, 28 * 28 * 1280).unwrap(),
            (476, 644)
        );
        assert_eq!(
            smart_resize(2000, 3000, f, 56 * 56, 28 * 28 * 1280).unwrap(),
            (812, 1204)
        );
        assert_eq!(
            smart_resize(10, 300, f, 56 * 56, 28 * 28 * 1280).unwrap(),
            (28, 308)
        );
        assert!(smart_resize(1, 300, f, 56 * 56, 1 << 30)
            .unwrap_err()
            .to_string()
            .contains("aspect ratio"));
        assert!(smart_resize(0, 3, f, 1, 1 << 30).is_err());
    }

    #[test]
    fn resize_identity_and_constant_images() {
        let img = noise(30, 20, 1);
        assert_eq!(resize_pil(&img, 30, 20, Resample::Bicubic).unwrap(), img);
        // A constant image stays constant under any normalised filter, up and down.
        let flat = RgbImage::from_pixel(37, 23, image::Rgb([200, 13, 77]));
        for (w, h) in [(56, 56), (10, 7), (37, 50), (80, 23)] {
            let r = resize_pil(&flat, w, h, Resample::Bicubic).unwrap();
            assert_eq!(r.dimensions(), (w, h));
            assert!(r.pixels().all(|p| p.0 == [200, 13, 77]), "{w}x{h}");
        }
    }

    #[test]
    fn resize_matches_pillow_on_a_pinned_case() {
        // Pillow 13.0: Image.fromarray(a).resize((3, 2), BICUBIC) of the 4x3 ramp below.
        let a: Vec<u8> = (0..4 * 3 * 3).map(|i| (i * 7 % 256) as u8).collect();
        let img = RgbImage::from_raw(4, 3, a).unwrap();
        let r = resize_pil(&img, 3, 2, Resample::Bicubic).unwrap();
        let want: [u8; 18] = [
            30, 37, 44, 58, 65, 72, 85, 92, 99, 146, 153, 160, 174, 181, 188, 201, 208, 215,
        ];
        assert_eq!(r.as_raw().as_slice(), &want);
        // Wider and shorter: Pillow 13 runs the vertical pass first here.
        let a: Vec<u8> = (0..4 * 3 * 3).map(|i| (i * 37 % 256) as u8).collect();
        let img = RgbImage::from_raw(4, 3, a).unwrap();
        let r = resize_pil(&img, 5, 2, Resample::Bicubic).unwrap();
        let want: [u8; 30] = [
            69, 105, 38, 68, 125, 134, 151, 100, 143, 166, 71, 111, 39, 83, 131, 151, 195, 127,
            163, 68, 77, 134, 83, 137, 109, 166, 156, 129, 165, 29,
        ];
        assert_eq!(r.as_raw().as_slice(), &want);
    }

    #[test]
    fn patch_order_is_hf_merge_interleaved() {
        // No resize/normalise: pixel value encodes (frame, y, x, c) so we can read it back.
        let cfg = PreprocessConfig {
            do_resize: false,
            do_rescale: false,
            do_normalize: false,
            ..PreprocessConfig::qwen2_vl_image()
        };
        let (w, h) = (56u32, 28u32);
        let frames: Vec<RgbImage> = (0..3)
            .map(|f| {
                RgbImage::from_fn(w, h, |x, y| {
                    image::Rgb([(f * 50 + y) as u8, x as u8, (c_mark(x, y)) as u8])
                })
            })
            .collect();
        fn c_mark(x: u32, y: u32) -> u32 {
            (x + y) % 251
        }
        let p = preprocess_video(&frames, &cfg).unwrap();
        // 3 frames -> grid_t 2 (frame 2 repeated), grid 2 x 4.
        assert_eq!(p.grid_thw, [2, 2, 4]);
        assert_eq!(p.row_len, 3 * 2 * 14 * 14);
        assert_eq!(p.rows(), 16);
        let at = |row: usize, c: usize, k: usize, py: usize, px: usize| {
            p.pixel_values[row * p.row_len + ((c * 2 + k) * 14 + py) * 14 + px]
        };
        // Row order: t, bh, bw, mh, mw. Row 3 = t0, bh0, bw0, mh1, mw1 -> patch (y 14.., x 14..).
        assert_eq!(at(3, 0, 0, 2, 5), (14 + 2) as f32);
        assert_eq!(at(3, 1, 1, 2, 5), (14 + 5) as f32);
        // Row 4 = t0, bh0, bw1, mh0, mw0 -> x from 28.
        assert_eq!(at(4, 1, 0, 0, 0), 28.0);
        // Temporal slot k=1 of t0 is frame 1; t1's slot 1 repeats frame 2.
        assert_eq!(at(0, 0, 1, 0, 0), 50.0);
        assert_eq!(at(8, 0, 0, 0, 0), 100.0);
        assert_eq!(at(8, 0, 1, 0, 0), 100.0);
        assert_eq!(at(9, 2, 0, 3, 4), c_mark(14 + 4, 3) as f32);
    }

    #[test]
    fn normalisation_follows_transformers_dtype_steps() {
        let img = RgbImage::from_pixel(28, 28, image::Rgb([0, 128, 255]));
        let cfg = PreprocessConfig {
            min_pixels: 28 * 28,
            ..PreprocessConfig::qwen2_vl_image()
        };
        let p = preprocess_image(&img, &cfg).unwrap();
        assert_eq!(p.grid_thw, [1, 2, 2]);
        let first = |c: usize| p.pixel_values[c * 2 * 14 * 14];
        let want = |v: u8, c: usize| {
            ((v as f64 / 255.0) as f32 - OPENAI_CLIP_MEAN[c] as f32) / OPENAI_CLIP_STD[c] as f32
        };
        assert_eq!(first(0), want(0, 0));
        assert_eq!(first(1), want(128, 1));
        assert_eq!(first(2), want(255, 2));
        // Default min_pixels (56*56) upscales a 28x28 image to 56x56.
        let p = preprocess_image(&img, &PreprocessConfig::qwen2_vl_image()).unwrap();
        assert_eq!(p.grid_thw, [1, 4, 4]);
    }

    #[test]
    fn frames_of_different_sizes_are_refused() {
        let frames = [noise(28, 28, 1), noise(28, 56, 2)];
        let err = preprocess_video(&frames, &PreprocessConfig::qwen2_vl_video())
            .unwrap_err()
            .to_string();
        assert!(err.contains("frame 1 is 28x56"), "{err}");
        assert!(preprocess_video(&[], &PreprocessConfig::qwen2_vl_video()).is_err());
    }

    /// Used by `tests/reference/preprocess_compare.py`: reads the cases it wrote
    /// (`$ROLLPLEX_PREPROCESS_CASES/cases.json`) and writes our `pixel_values` next to them.
    #[test]
    #[ignore = "driven by tests/reference/preprocess_compare.py"]
    fn dump_for_reference() {
        #[derive(Deserialize)]
        struct Case {
            name: String,
            kind: String,
            frames: Vec<PathBuf>,
            config: PreprocessConfig,
        }
        let dir = PathBuf::from(
            std::env::var("ROLLPLEX_PREPROCESS_CASES").expect("ROLLPLEX_PREPROCESS_CASES"),
        );
        let cases: Vec<Case> =
            serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap())
                .unwrap();
        for c in cases {
            let frames: Vec<RgbImage> = c
                .frames
                .iter()
                .map(|p| load_image(dir.join(p)).unwrap())
                .collect();
            let t = std::time::Instant::now();
            let p = match c.kind.as_str() {
                "image" => preprocess_image(&frames[0], &c.config).unwrap(),
                _ => preprocess_video(&frames, &c.config).unwrap(),
            };
            let us = t.elapsed().as_micros();
            let bytes: Vec<u8> = p
                .pixel_values
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect();
            std::fs::write(dir.join(format!("{}.rust.f32", c.name)), bytes).unwrap();
            let meta =
                serde_json::json!({"grid_thw": p.grid_thw, "row_len": p.row_len, "micros": us});
            std::fs::write(dir.join(format!("{}.rust.json", c.name)), meta.to_string()).unwrap();
        }
    }

    #[test]
    fn config_files_and_missing_image_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("preprocessor_config.json");
        std::fs::write(
            &path,
            r#"{"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "resample": 3,
            "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "Qwen2VLImageProcessor"}"#,
        )
        .unwrap();
        let (img, vid) = PreprocessConfig::from_checkpoint(dir.path()).unwrap();
        assert_eq!(img.max_pixels, 12845056);
        assert_eq!(img.image_mean, [0.5; 3]);
        assert_eq!(vid, img);
        std::fs::write(
            dir.path().join("video_preprocessor_config.json"),
            r#"{"size": {"shortest_edge": 100, "longest_edge": 1000}}"#,
        )
        .unwrap();
        let (_, vid) = PreprocessConfig::from_checkpoint(dir.path()).unwrap();
        assert_eq!((vid.min_pixels, vid.max_pixels), (100, 1000));
        std::fs::write(&path, r#"{"patch_size": "14"}"#).unwrap();
        let err = PreprocessConfig::from_checkpoint(dir.path())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("preprocessor_config.json") && err.contains("patch_size"),
            "{err}"
        );
        let err = load_image(dir.path().join("missing.png"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing.png"), "{err}");
    }
}
