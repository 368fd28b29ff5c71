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

mod resize;

pub use resize::{resize_pil, Resample};

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
        let text = rollplex_plan::files::read_to_string(path, rollplex_plan::files::TEXT_CAP)
            .map_err(|e| err(e.to_string()))?;
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

/// Cap on an image file's size: far above any frame a vision model takes, far below memory.
pub const IMAGE_CAP: u64 = 256 << 20;

/// Opens an image file (PNG or JPEG) as RGB. Alpha is dropped and grey is replicated, as
/// `PIL.Image.convert("RGB")` does.
pub fn load_image(path: impl AsRef<Path>) -> Result<RgbImage> {
    let path = path.as_ref();
    let (file, _) = rollplex_plan::files::open_regular(path, IMAGE_CAP).map_err(|e| {
        PreprocessError::Image {
            path: path.into(),
            msg: e.to_string(),
        }
    })?;
    let img = image::ImageReader::new(std::io::BufReader::new(file))
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
mod tests;
