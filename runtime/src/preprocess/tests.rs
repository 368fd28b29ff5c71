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
        69, 105, 38, 68, 125, 134, 151, 100, 143, 166, 71, 111, 39, 83, 131, 151, 195, 127, 163,
        68, 77, 134, 83, 137, 109, 166, 156, 129, 165, 29,
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
/// `ROLLPLEX_PREPROCESS_CASES` is a switch of this test only (ignored unless the script runs
/// it); nothing outside the tests reads it.
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
        serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap();
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
        let meta = serde_json::json!({"grid_thw": p.grid_thw, "row_len": p.row_len, "micros": us});
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
