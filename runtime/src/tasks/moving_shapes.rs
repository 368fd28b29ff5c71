//! Moving shapes: a synthetic video question-answering task with a checkable answer.
//!
//! Each sample is a short video of coloured shapes on a plain background. One of them, the
//! target, moves in a straight line by between 1/4 and 1/2 of the frame side (up to the room
//! left when it starts at the centre, [`ShapesConfig::centre_start`]); the question
//! asks which way it moved: `Which way did the red square move? A. left B. right C. up D. down`.
//! The answer is the option's letter (reward: `choice_letter`).
//!
//! What this module knows: drawing the frames, the question and answer, and writing a dataset
//! directory (`<split>.jsonl` plus PNG frames under `<split>/<id>/`) that [`crate::data`] loads.
//!
//! Invariants:
//! - Deterministic: the same (seed, split, index, config) gives the same frames, bit for bit.
//! - Train and test never share a sample seed: sample `i` of split `s` is drawn from
//!   `derive(seed, 2*i + s)`, and `derive` is injective in its key.
//! - The answer is determined by the frames: the target is drawn last (never hidden), moves at
//!   least a quarter of the frame side along one axis only, and no distractor has both its
//!   colour and its shape.
//! - Answers are balanced: every block of 4 consecutive samples uses each letter once.

use std::path::{Path, PathBuf};

use image::{Rgb, RgbImage};

use crate::data::rng::{derive, SplitMix64};
use crate::data::{Media, MediaSource, Sample};

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    #[error("cannot write {path}: {msg}")]
    Write { path: PathBuf, msg: String },
    #[error("moving_shapes: {0}")]
    Config(String),
}

pub type Result<T, E = TaskError> = std::result::Result<T, E>;

/// Which split a sample belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Split {
    Train,
    Test,
}

impl Split {
    pub fn name(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Test => "test",
        }
    }

    fn bit(self) -> u64 {
        matches!(self, Split::Test) as u64
    }
}

impl std::str::FromStr for Split {
    type Err = TaskError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "train" => Ok(Split::Train),
            "test" => Ok(Split::Test),
            _ => Err(TaskError::Config(format!(
                "unknown split {s:?} (train or test)"
            ))),
        }
    }
}

/// Directions, in the order of the default options (A. left B. right C. up D. down).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    Left,
    Right,
    Up,
    Down,
}

impl Direction {
    pub const ALL: [Direction; 4] = [
        Direction::Left,
        Direction::Right,
        Direction::Up,
        Direction::Down,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Direction::Left => "left",
            Direction::Right => "right",
            Direction::Up => "up",
            Direction::Down => "down",
        }
    }

    /// Unit step (dx, dy) in image coordinates (y grows downwards).
    fn step(self) -> (i64, i64) {
        match self {
            Direction::Left => (-1, 0),
            Direction::Right => (1, 0),
            Direction::Up => (0, -1),
            Direction::Down => (0, 1),
        }
    }
}

const COLOURS: [(&str, [u8; 3]); 8] = [
    ("red", [220, 40, 40]),
    ("green", [40, 180, 60]),
    ("blue", [50, 90, 230]),
    ("yellow", [230, 210, 40]),
    ("purple", [150, 60, 200]),
    ("orange", [240, 140, 30]),
    ("white", [245, 245, 245]),
    ("cyan", [40, 210, 220]),
];

const BACKGROUNDS: [[u8; 3]; 4] = [[0, 0, 0], [60, 60, 60], [30, 30, 70], [90, 80, 60]];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    Square,
    Circle,
    Triangle,
}

impl Shape {
    pub const ALL: [Shape; 3] = [Shape::Square, Shape::Circle, Shape::Triangle];

    pub fn name(self) -> &'static str {
        match self {
            Shape::Square => "square",
            Shape::Circle => "circle",
            Shape::Triangle => "triangle",
        }
    }

    /// Whether pixel (px, py) of a `side`-pixel box at its origin is inside the shape.
    fn covers(self, px: u32, py: u32, side: u32) -> bool {
        let (x, y, s) = (px as f64 + 0.5, py as f64 + 0.5, side as f64);
        match self {
            Shape::Square => true,
            Shape::Circle => {
                let r = s / 2.0;
                (x - r).powi(2) + (y - r).powi(2) <= r * r
            }
            // Apex at the top middle, base along the bottom.
            Shape::Triangle => {
                let half = s / 2.0 * (y / s);
                (x - s / 2.0).abs() <= half
            }
        }
    }
}

/// How samples are drawn.
#[derive(Clone, Debug, PartialEq)]
pub struct ShapesConfig {
    /// Frames per video (at least 2).
    pub frames: u32,
    /// Frame side in pixels (square frames; at least 16).
    pub size: u32,
    /// Object side as a fraction of the frame side.
    pub object_frac: f64,
    /// Other shapes in the frame (they move in random directions or stand still).
    pub distractors: u32,
    /// Ask about any colour/shape; otherwise the target is always the red square.
    pub vary_target: bool,
    /// Pick the background from a palette; otherwise black.
    pub vary_background: bool,
    /// Put the four options in a random order per sample (the letter stays balanced).
    pub shuffle_options: bool,
    /// The target starts at the centre of the frame along its axis of motion (moving by 1/4 of
    /// the side up to the room left to the edge), and across that axis sits on even pixel
    /// offsets in the train split, odd ones in the test split (no test video is a train video);
    /// otherwise it starts anywhere it fits.
    pub centre_start: bool,
}

impl ShapesConfig {
    /// The CPU job's task: one red square on black that starts at the centre of the frame along
    /// its axis of motion (anywhere across it), fixed option order. The centred start is what
    /// makes the task learnable by the random-init tiny model in minutes: with a random start
    /// the answer is a relation between two positions, which its frozen random vision features
    /// do not expose (docs/perf.md, "tiny CPU run", has the measurements).
    pub fn tiny(frames: u32, size: u32) -> Self {
        Self {
            frames,
            size,
            object_frac: 0.25,
            distractors: 0,
            vary_target: false,
            vary_background: false,
            shuffle_options: false,
            centre_start: true,
        }
    }

    /// The GPU task: any colour/shape as the target, two distractors, varied backgrounds.
    pub fn full(frames: u32, size: u32) -> Self {
        Self {
            frames,
            size,
            object_frac: 0.125,
            distractors: 2,
            vary_target: true,
            vary_background: true,
            shuffle_options: false,
            centre_start: false,
        }
    }

    /// [`tiny`](Self::tiny) for frames up to 64 pixels, else [`full`](Self::full).
    pub fn for_size(frames: u32, size: u32) -> Self {
        if size <= 64 {
            Self::tiny(frames, size)
        } else {
            Self::full(frames, size)
        }
    }

    fn check(&self) -> Result<()> {
        if self.frames < 2 {
            return Err(TaskError::Config(format!(
                "needs at least 2 frames to show motion, got {}",
                self.frames
            )));
        }
        if self.size < 16 {
            return Err(TaskError::Config(format!(
                "frame size must be at least 16 pixels, got {}",
                self.size
            )));
        }
        if !(self.object_frac > 0.0 && self.object_frac <= 0.25) {
            return Err(TaskError::Config(format!(
                "object_frac must be in (0, 0.25], got {}",
                self.object_frac
            )));
        }
        Ok(())
    }

    fn object_side(&self) -> u32 {
        ((self.size as f64 * self.object_frac).round() as u32).max(3)
    }
}

/// One moving object: where it is in every frame.
#[derive(Clone, Debug, PartialEq)]
pub struct Track {
    pub colour: &'static str,
    pub rgb: [u8; 3],
    pub shape: Shape,
    pub side: u32,
    /// Top-left corner per frame.
    pub positions: Vec<(u32, u32)>,
}

/// A drawn sample, before it is written anywhere.
#[derive(Clone, Debug)]
pub struct ShapesSample {
    pub frames: Vec<RgbImage>,
    pub prompt: String,
    /// The correct option's letter.
    pub answer: char,
    pub direction: Direction,
    /// The target is `tracks[0]`.
    pub tracks: Vec<Track>,
}

/// The seed of sample `index` of `split` (distinct for every (split, index) under one seed).
pub fn sample_seed(seed: u64, split: Split, index: u64) -> u64 {
    derive(seed, (index << 1) | split.bit())
}

/// The answer letter of sample `index`: each block of 4 samples is a permutation of A-D.
fn balanced_letter(seed: u64, split: Split, index: u64) -> usize {
    let mut perm = [0usize, 1, 2, 3];
    SplitMix64::new(derive(
        seed ^ 0x5eed_b10c_5eed_b10c,
        ((index / 4) << 1) | split.bit(),
    ))
    .shuffle(&mut perm);
    perm[(index % 4) as usize]
}

/// Draws sample `index` of `split`.
pub fn render(cfg: &ShapesConfig, seed: u64, split: Split, index: u64) -> Result<ShapesSample> {
    cfg.check()?;
    let mut rng = SplitMix64::new(sample_seed(seed, split, index));
    let letter = balanced_letter(seed, split, index);
    let mut order = Direction::ALL;
    if cfg.shuffle_options {
        rng.shuffle(&mut order);
    }
    let direction = order[letter];
    let (tc, ts) = if cfg.vary_target {
        (
            rng.below(COLOURS.len() as u64) as usize,
            Shape::ALL[rng.below(3) as usize],
        )
    } else {
        (0, Shape::Square)
    };
    let side = cfg.object_side();
    let size = cfg.size;
    let mut tracks = vec![moving_track(
        &mut rng,
        cfg,
        COLOURS[tc],
        ts,
        side,
        direction,
        Some(split),
    )];
    for _ in 0..cfg.distractors {
        // Any (colour, shape) but the target's.
        let (c, s) = loop {
            let c = rng.below(COLOURS.len() as u64) as usize;
            let s = Shape::ALL[rng.below(3) as usize];
            if (c, s) != (tc, ts) {
                break (c, s);
            }
        };
        let t = if rng.below(3) == 0 {
            let (x, y) = (
                rng.range(0, (size - side) as u64) as u32,
                rng.range(0, (size - side) as u64) as u32,
            );
            Track {
                colour: COLOURS[c].0,
                rgb: COLOURS[c].1,
                shape: s,
                side,
                positions: vec![(x, y); cfg.frames as usize],
            }
        } else {
            let d = Direction::ALL[rng.below(4) as usize];
            moving_track(&mut rng, cfg, COLOURS[c], s, side, d, None)
        };
        tracks.push(t);
    }
    let bg = if cfg.vary_background {
        BACKGROUNDS[rng.below(BACKGROUNDS.len() as u64) as usize]
    } else {
        [0, 0, 0]
    };
    let mut frames = Vec::with_capacity(cfg.frames as usize);
    for f in 0..cfg.frames as usize {
        let mut img = RgbImage::from_pixel(size, size, Rgb(bg));
        // Distractors first, the target last so it is never hidden.
        for t in tracks.iter().skip(1).chain(tracks.iter().take(1)) {
            let (x0, y0) = t.positions[f];
            for py in 0..t.side {
                for px in 0..t.side {
                    if t.shape.covers(px, py, t.side) {
                        img.put_pixel(x0 + px, y0 + py, Rgb(t.rgb));
                    }
                }
            }
        }
        frames.push(img);
    }
    let options: Vec<String> = order
        .iter()
        .zip(['A', 'B', 'C', 'D'])
        .map(|(d, l)| format!("{l}. {}", d.name()))
        .collect();
    let prompt = format!(
        "Which way did the {} {} move? {}",
        COLOURS[tc].0,
        ts.name(),
        options.join(" ")
    );
    Ok(ShapesSample {
        frames,
        prompt,
        answer: (b'A' + letter as u8) as char,
        direction,
        tracks,
    })
}

/// A track moving `d` by 1/4 to 1/2 of the frame (capped so it stays inside), linearly. With
/// `centre_start`, the target (`split` given) sits on even offsets across its axis of motion in
/// the train split and on odd ones in the test split, so no test video is a train video.
fn moving_track(
    rng: &mut SplitMix64,
    cfg: &ShapesConfig,
    (colour, rgb): (&'static str, [u8; 3]),
    shape: Shape,
    side: u32,
    d: Direction,
    split: Option<Split>,
) -> Track {
    let size = cfg.size as u64;
    let room = size - side as u64;
    let min = size.div_ceil(4).min(room);
    let (dist, along) = if cfg.centre_start {
        // Starts at the centre along its axis; `along` counts from the far edge when moving
        // left/up (see below), so both cases start at room / 2.
        let dist = rng.range(min, (room / 2).max(min));
        let forward = d.step().0 + d.step().1 > 0;
        (dist, if forward { room / 2 } else { room - room / 2 })
    } else {
        let dist = rng.range(min, (size / 2).clamp(min, room));
        (dist, rng.range(0, room - dist))
    };
    let across = match split {
        Some(split) if cfg.centre_start => {
            let bit = split.bit().min(room);
            2 * rng.range(0, (room - bit) / 2) + bit
        }
        _ => rng.range(0, room),
    };
    let (dx, dy) = d.step();
    let last = (cfg.frames - 1) as u64;
    let positions = (0..cfg.frames as u64)
        .map(|f| {
            // Position along the axis at frame f, in the direction of motion.
            let moved = (dist * f + last / 2) / last;
            let a = if dx + dy > 0 {
                along + moved
            } else {
                room - along - moved
            };
            if dx != 0 {
                (a as u32, across as u32)
            } else {
                (across as u32, a as u32)
            }
        })
        .collect();
    Track {
        colour,
        rgb,
        shape,
        side,
        positions,
    }
}

/// What [`generate`] wrote.
#[derive(Clone, Debug)]
pub struct Generated {
    /// `<out_dir>/<split>.jsonl`.
    pub jsonl: PathBuf,
    pub samples: Vec<Sample>,
    /// Samples per answer letter A-D.
    pub letters: [usize; 4],
}

/// Writes `n` samples of `split` to `out_dir` with [`ShapesConfig::for_size`]`(frames, size)`:
/// frames as `<out_dir>/<split>/<id>/f<k>.png`, samples as `<out_dir>/<split>.jsonl` with
/// frame paths relative to `out_dir`.
pub fn generate(
    out_dir: &Path,
    n: usize,
    split: Split,
    seed: u64,
    frames: u32,
    size: u32,
) -> Result<Generated> {
    generate_with(
        out_dir,
        n,
        split,
        seed,
        &ShapesConfig::for_size(frames, size),
    )
}

/// [`generate`] with an explicit config.
pub fn generate_with(
    out_dir: &Path,
    n: usize,
    split: Split,
    seed: u64,
    cfg: &ShapesConfig,
) -> Result<Generated> {
    cfg.check()?;
    let write_err = |path: &Path, e: &dyn std::fmt::Display| TaskError::Write {
        path: path.into(),
        msg: e.to_string(),
    };
    let mut samples = Vec::with_capacity(n);
    let mut letters = [0usize; 4];
    for i in 0..n {
        let s = render(cfg, seed, split, i as u64)?;
        let id = format!("{}-{i:06}", split.name());
        let dir = out_dir.join(split.name()).join(&id);
        std::fs::create_dir_all(&dir).map_err(|e| write_err(&dir, &e))?;
        let mut paths = Vec::with_capacity(s.frames.len());
        for (k, f) in s.frames.iter().enumerate() {
            let p = dir.join(format!("f{k}.png"));
            f.save_with_format(&p, image::ImageFormat::Png)
                .map_err(|e| write_err(&p, &e))?;
            paths.push(MediaSource::Path(p));
        }
        letters[(s.answer as u8 - b'A') as usize] += 1;
        samples.push(Sample {
            id,
            system: None,
            prompt: s.prompt,
            media: Media::Video(paths),
            answer: s.answer.to_string(),
        });
    }
    let jsonl = out_dir.join(format!("{}.jsonl", split.name()));
    crate::data::jsonl::write(&jsonl, &samples).map_err(|e| write_err(&jsonl, &e))?;
    Ok(Generated {
        jsonl,
        samples,
        letters,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Centroid of the pixels of colour `rgb`.
    fn centroid(img: &RgbImage, rgb: [u8; 3]) -> (f64, f64) {
        let (mut sx, mut sy, mut n) = (0.0, 0.0, 0.0);
        for (x, y, p) in img.enumerate_pixels() {
            if p.0 == rgb {
                sx += x as f64;
                sy += y as f64;
                n += 1.0;
            }
        }
        assert!(n > 0.0, "target not visible");
        (sx / n, sy / n)
    }

    #[test]
    fn the_frames_determine_the_answer_on_tiny_frames() {
        for size in [28, 56] {
            let cfg = ShapesConfig::tiny(4, size);
            for i in 0..64 {
                let s = render(&cfg, 7, Split::Train, i).unwrap();
                assert_eq!(s.frames.len(), 4);
                let (x0, y0) = centroid(&s.frames[0], [220, 40, 40]);
                let (x1, y1) = centroid(&s.frames[3], [220, 40, 40]);
                let (dx, dy) = (x1 - x0, y1 - y0);
                let quarter = size as f64 / 4.0;
                let seen = if dx.abs() > dy.abs() {
                    if dx < 0.0 {
                        Direction::Left
                    } else {
                        Direction::Right
                    }
                } else if dy < 0.0 {
                    Direction::Up
                } else {
                    Direction::Down
                };
                assert_eq!(seen, s.direction, "size {size} sample {i}");
                assert!(
                    dx.abs().max(dy.abs()) >= quarter - 1e-9,
                    "moved {dx},{dy} in {size}"
                );
                assert_eq!(dx.abs().min(dy.abs()), 0.0, "moves along one axis");
                let letter = ['A', 'B', 'C', 'D'][Direction::ALL
                    .iter()
                    .position(|d| *d == s.direction)
                    .unwrap()];
                assert_eq!(s.answer, letter);
                assert!(s.prompt.starts_with(
                    "Which way did the red square move? A. left B. right C. up D. down"
                ));
            }
        }
    }

    #[test]
    fn centre_start_starts_at_the_centre_and_keeps_test_videos_out_of_train() {
        for size in [28, 56] {
            let cfg = ShapesConfig::tiny(4, size);
            assert!(cfg.centre_start);
            let room = size - cfg.object_side();
            let train: std::collections::HashSet<Vec<u8>> = (0..2000)
                .map(|i| {
                    let s = render(&cfg, 1, Split::Train, i).unwrap();
                    s.frames.iter().flat_map(|f| f.as_raw().clone()).collect()
                })
                .collect();
            for i in 0..200 {
                let s = render(&cfg, 1, Split::Test, i).unwrap();
                let (x0, y0) = s.tracks[0].positions[0];
                let (along, across) = match s.direction {
                    Direction::Left | Direction::Right => (x0, y0),
                    Direction::Up | Direction::Down => (y0, x0),
                };
                assert_eq!(
                    along,
                    room / 2,
                    "size {size} sample {i} starts at the centre"
                );
                assert_eq!(across % 2, 1, "test samples sit on odd offsets");
                let video: Vec<u8> = s.frames.iter().flat_map(|f| f.as_raw().clone()).collect();
                assert!(!train.contains(&video), "test sample {i} is a train video");
            }
            // The train split covers the even offsets, so the sets above are not trivially apart.
            assert!(train.len() > 100, "{} distinct train videos", train.len());
        }
    }

    #[test]
    fn answers_are_balanced_per_block_of_four() {
        for cfg in [
            ShapesConfig::tiny(4, 28),
            ShapesConfig {
                shuffle_options: true,
                ..ShapesConfig::full(8, 112)
            },
        ] {
            for split in [Split::Train, Split::Test] {
                for block in 0..20 {
                    let mut letters: Vec<char> = (0..4)
                        .map(|k| render(&cfg, 3, split, block * 4 + k).unwrap().answer)
                        .collect();
                    letters.sort();
                    assert_eq!(letters, vec!['A', 'B', 'C', 'D']);
                }
            }
        }
    }

    #[test]
    fn full_config_keeps_the_target_visible_and_unique() {
        let cfg = ShapesConfig::full(8, 112);
        for i in 0..40 {
            let s = render(&cfg, 11, Split::Test, i).unwrap();
            let t = &s.tracks[0];
            assert!(s
                .prompt
                .contains(&format!("the {} {} move?", t.colour, t.shape.name())));
            for d in &s.tracks[1..] {
                assert!((d.colour, d.shape) != (t.colour, t.shape));
            }
            // The target is drawn last: its whole shape is visible in every frame.
            for (f, img) in s.frames.iter().enumerate() {
                let (x0, y0) = t.positions[f];
                for py in 0..t.side {
                    for px in 0..t.side {
                        if t.shape.covers(px, py, t.side) {
                            assert_eq!(img.get_pixel(x0 + px, y0 + py).0, t.rgb);
                        }
                    }
                }
            }
            let (a, b) = (t.positions[0], t.positions[7]);
            let moved = (a.0 as i64 - b.0 as i64)
                .abs()
                .max((a.1 as i64 - b.1 as i64).abs());
            assert!(moved >= 28, "moved {moved}");
        }
    }

    #[test]
    fn deterministic_and_splits_differ() {
        let cfg = ShapesConfig::full(4, 64);
        let a = render(&cfg, 5, Split::Train, 9).unwrap();
        let b = render(&cfg, 5, Split::Train, 9).unwrap();
        assert_eq!(a.frames, b.frames);
        assert_eq!(a.prompt, b.prompt);
        let seeds: std::collections::HashSet<u64> = (0..1000)
            .flat_map(|i| {
                [
                    sample_seed(5, Split::Train, i),
                    sample_seed(5, Split::Test, i),
                ]
            })
            .collect();
        assert_eq!(seeds.len(), 2000, "no seed shared between or within splits");
        let t = render(&cfg, 5, Split::Test, 9).unwrap();
        assert_ne!(a.frames, t.frames);
    }

    #[test]
    fn generate_writes_a_loadable_dataset() {
        let dir = tempfile::tempdir().unwrap();
        let g = generate(dir.path(), 8, Split::Train, 1, 4, 28).unwrap();
        assert_eq!(g.letters, [2, 2, 2, 2]);
        let d = crate::data::Dataset::load(&g.jsonl).unwrap();
        assert_eq!(d.samples, g.samples);
        let Media::Video(frames) = &d.samples[0].media else {
            panic!("video")
        };
        assert_eq!(frames.len(), 4);
        let img = frames[0].load().unwrap();
        assert_eq!(img.dimensions(), (28, 28));
        assert_eq!(
            img,
            render(&ShapesConfig::tiny(4, 28), 1, Split::Train, 0)
                .unwrap()
                .frames[0]
        );
        // Bytes on disk are the same on a second run.
        let again = tempfile::tempdir().unwrap();
        generate(again.path(), 8, Split::Train, 1, 4, 28).unwrap();
        for name in ["train.jsonl", "train/train-000003/f2.png"] {
            assert_eq!(
                std::fs::read(dir.path().join(name)).unwrap(),
                std::fs::read(again.path().join(name)).unwrap()
            );
        }
        assert!(generate(dir.path(), 1, Split::Train, 1, 1, 28)
            .unwrap_err()
            .to_string()
            .contains("at least 2 frames"));
    }
}
