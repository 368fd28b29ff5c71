//! Prompt sources backed by data (a JSONL/Parquet dataset, or the built-in moving-shapes task)
//! as the loops consume them, and the held-out evaluations ([`HeldOut`]: the moving-shapes
//! task's test split, or a held-out file built into prompts as the training data is).
//!
//! A prompt goes through what a Hugging Face processor does: the chat template renders the
//! user turn, the tokenizer encodes it, each media placeholder expands to `t*h*w / merge^2`
//! pad tokens, and the frames are resized, normalised and patchified.
//!
//! Invariant: the prompts of iteration `i` are a function of (dataset, seed, i) only: the
//! sampler permutes each epoch with a key derived from the seed and the epoch.

use rollplex_plan::spec::{DatasetSpec, JobSpec, MediaSpec, WeightsSource};

use super::prompts::PromptSource;
use super::{ExecError, MediaData, PromptData};
use crate::chat::{prompt_ids, ChatTemplate, MediaGrid, MediaKind as ChatMedia};
use crate::data::sampler::Sampler;
use crate::data::{Dataset, Media, Sample};
use crate::model::MediaKind;
use crate::preprocess::{preprocess_image, preprocess_video, PreprocessConfig, RgbImage};
use crate::reward::{Reward, RewardRequest};
use crate::tasks::moving_shapes::{render, ShapesConfig, Split};
use crate::tokenizer::TextTokenizer;

/// Turns samples (text + media + answer) into model prompts.
pub struct PromptBuilder {
    tokenizer: TextTokenizer,
    template: ChatTemplate,
    image_cfg: PreprocessConfig,
    video_cfg: PreprocessConfig,
    merge: u32,
}

impl PromptBuilder {
    /// The checkpoint's tokenizer, template and processor config, or the built-in tiny ones.
    pub fn for_spec(spec: &JobSpec) -> Result<Self, ExecError> {
        let v = &spec.actor.vision;
        let data = |e: String| ExecError::Data(e);
        let (tokenizer, template, image_cfg, video_cfg) = match &spec.actor.weights {
            WeightsSource::Checkpoint { path } => {
                let dir = std::path::Path::new(path);
                let tok = TextTokenizer::from_file(dir.join("tokenizer.json"))
                    .map_err(|e| data(e.to_string()))?;
                let tpl = ChatTemplate::from_checkpoint(dir).map_err(|e| data(e.to_string()))?;
                let (img, vid) =
                    PreprocessConfig::from_checkpoint(dir).map_err(|e| data(e.to_string()))?;
                (tok, tpl, img, vid)
            }
            WeightsSource::Random { .. } => {
                // No checkpoint: the built-in tiny tokenizer when the vocabulary is small, and
                // processor bounds that keep small frames at their own size.
                let tok = TextTokenizer::tiny().map_err(|e| data(e.to_string()))?;
                if tok.vocab_size() > spec.actor.text.vocab_size as usize {
                    return Err(ExecError::Data(format!(
                        "a dataset needs a tokenizer: the built-in one has {} ids but the model's vocabulary is {}; \
                         give the model a checkpoint with tokenizer.json, or use dataset = synthetic",
                        tok.vocab_size(),
                        spec.actor.text.vocab_size
                    )));
                }
                let f = (v.patch_size * v.spatial_merge_size) as u64;
                let cfg = PreprocessConfig::for_vision(v, f * f, 28 * 28 * 1280);
                (tok, ChatTemplate::qwen2_vl(), cfg.clone(), cfg)
            }
        };
        check_tokens(spec, &tokenizer)?;
        Ok(PromptBuilder {
            tokenizer,
            template,
            image_cfg,
            video_cfg,
            merge: v.spatial_merge_size,
        })
    }

    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    /// One prompt from a sample whose media are already decoded to frames.
    pub fn build(
        &self,
        sample: &Sample,
        images: &[RgbImage],
        video: Option<&[RgbImage]>,
    ) -> Result<PromptData, ExecError> {
        let mut media = Vec::new();
        let mut grids = Vec::new();
        for img in images {
            let p = preprocess_image(img, &self.image_cfg)
                .map_err(|e| ExecError::Data(format!("sample {}: {e}", sample.id)))?;
            grids.push(MediaGrid {
                kind: ChatMedia::Image,
                grid_thw: p.grid_thw,
            });
            media.push(MediaData {
                kind: MediaKind::Image,
                pixels: p.pixel_values,
                grid: p.grid_thw,
            });
        }
        if let Some(frames) = video {
            let p = preprocess_video(frames, &self.video_cfg)
                .map_err(|e| ExecError::Data(format!("sample {}: {e}", sample.id)))?;
            grids.push(MediaGrid {
                kind: ChatMedia::Video,
                grid_thw: p.grid_thw,
            });
            media.push(MediaData {
                kind: MediaKind::Video {
                    second_per_grid_t: None,
                },
                pixels: p.pixel_values,
                grid: p.grid_thw,
            });
        }
        let messages = sample
            .messages()
            .map_err(|e| ExecError::Data(e.to_string()))?;
        let ids = prompt_ids(
            &self.tokenizer,
            &self.template,
            &messages,
            &grids,
            self.merge,
        )
        .map_err(|e| ExecError::Data(format!("sample {}: {e}", sample.id)))?;
        Ok(PromptData {
            id: sample.id.clone(),
            text: sample.prompt.clone(),
            ids: ids.ids,
            media,
            answer: sample.answer.clone(),
        })
    }

    /// Decodes response tokens to text (special tokens dropped).
    pub fn decode(&self, tokens: &[u32]) -> Result<String, ExecError> {
        self.tokenizer
            .decode(tokens, true)
            .map_err(|e| ExecError::Data(e.to_string()))
    }
}

/// The model's special token ids must be the tokenizer's.
fn check_tokens(spec: &JobSpec, tok: &TextTokenizer) -> Result<(), ExecError> {
    let (m, t) = (&spec.actor.tokens, tok.special_tokens());
    let pairs = [
        ("image_token_id", m.image_token_id, t.image_token_id),
        ("video_token_id", m.video_token_id, t.video_token_id),
        (
            "vision_start_token_id",
            m.vision_start_token_id,
            t.vision_start_token_id,
        ),
        (
            "vision_end_token_id",
            m.vision_end_token_id,
            t.vision_end_token_id,
        ),
    ];
    for (name, model, tokenizer) in pairs {
        if model != tokenizer {
            return Err(ExecError::Data(format!(
                "the model's {name} is {model} but the tokenizer's is {tokenizer}: the pipeline's model tokens and its tokenizer disagree"
            )));
        }
    }
    Ok(())
}

/// The moving-shapes task drawn in memory (train split), `size` examples per epoch.
pub struct ShapesSource {
    builder: PromptBuilder,
    cfg: ShapesConfig,
    seed: u64,
    sampler: Sampler,
}

impl ShapesSource {
    pub fn new(spec: &JobSpec, size: u32) -> Result<Self, ExecError> {
        let (frames, side) = match spec.rollout.media {
            rollplex_plan::spec::MediaSpec::Video { frames, height, width } if height == width => (frames, height),
            ref m => {
                return Err(ExecError::Data(format!(
                    "the moving_shapes task draws square videos: set rollout media = video(frames = N, size = SxS) (got {m:?})"
                )))
            }
        };
        let sampler = Sampler::new(
            size as usize,
            spec.rollout.prompts_per_iter,
            spec.seed,
            true,
        )
        .map_err(|e| ExecError::Data(e.to_string()))?;
        Ok(ShapesSource {
            builder: PromptBuilder::for_spec(spec)?,
            cfg: ShapesConfig::for_size(frames, side),
            seed: spec.seed,
            sampler,
        })
    }

    /// Example `index` of `split` as a prompt.
    pub fn prompt(&self, split: Split, index: u64) -> Result<PromptData, ExecError> {
        let s = render(&self.cfg, self.seed, split, index)
            .map_err(|e| ExecError::Data(e.to_string()))?;
        let sample = Sample {
            id: format!("{}-{index}", split.name()),
            system: None,
            prompt: format!("<video>{}", s.prompt),
            media: Media::Video(Vec::new()),
            answer: s.answer.to_string(),
        };
        self.builder.build(&sample, &[], Some(&s.frames))
    }

    pub fn builder(&self) -> &PromptBuilder {
        &self.builder
    }
}

impl PromptSource for ShapesSource {
    fn prompts(&mut self, iteration: u32, count: usize) -> Result<Vec<PromptData>, ExecError> {
        let (_, idx) = self.sampler.batch(iteration as u64);
        if idx.len() != count {
            return Err(ExecError::Data(format!(
                "the sampler gave {} prompts, the plan needs {count}",
                idx.len()
            )));
        }
        idx.into_iter()
            .map(|i| self.prompt(Split::Train, i as u64))
            .collect()
    }
}

/// A JSONL/Parquet dataset's records as prompts of a job: the training data ([`DatasetSource`]
/// draws from it) and a held-out file ([`HeldOut::file`]) are loaded, checked and built the
/// same way.
pub struct DatasetPrompts {
    builder: PromptBuilder,
    data: Dataset,
    /// What each prompt must fit ([`check_prompt`]).
    spec: JobSpec,
}

impl DatasetPrompts {
    /// Loads the file `path` for `spec`'s plan: every record parsed and its media checked
    /// against the plan's ([`check_media_shape`]), an error naming `file:line` or `file:row N`.
    pub fn load(spec: &JobSpec, path: &std::path::Path) -> Result<Self, ExecError> {
        let data = Dataset::load(path).map_err(|e| ExecError::Data(e.to_string()))?;
        for (i, s) in data.samples.iter().enumerate() {
            check_media_shape(spec, s)
                .map_err(|msg| ExecError::Data(format!("{}: {msg}", data.at(i))))?;
        }
        Ok(DatasetPrompts {
            builder: PromptBuilder::for_spec(spec)?,
            data,
            spec: spec.clone(),
        })
    }

    pub fn len(&self) -> usize {
        self.data.len()
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The dataset file.
    pub fn path(&self) -> &std::path::Path {
        &self.data.path
    }

    /// Record `i` as a prompt: its media decoded, the chat template applied, checked against
    /// the plan ([`check_prompt`]); an error names the record's line or row.
    pub fn prompt(&self, i: usize) -> Result<PromptData, ExecError> {
        let s = &self.data.samples[i];
        // a media item that does not decode is the record's error, located
        let load = |what: &str, list: &[crate::data::MediaSource]| {
            list.iter()
                .enumerate()
                .map(|(k, m)| {
                    m.load().map_err(|e| {
                        ExecError::Data(format!("{}: {what} {k}: {e}", self.data.at(i)))
                    })
                })
                .collect::<Result<Vec<_>, _>>()
        };
        let (prompt, sizes) = match &s.media {
            Media::None => (self.builder.build(s, &[], None)?, Vec::new()),
            Media::Images(v) => {
                let imgs = load("image", v)?;
                (self.builder.build(s, &imgs, None)?, sizes_of(&imgs))
            }
            Media::Video(v) => {
                let frames = load("video frame", v)?;
                (
                    self.builder.build(s, &[], Some(&frames))?,
                    sizes_of(&frames),
                )
            }
        };
        check_prompt(&self.spec, &prompt, &sizes)
            .map_err(|msg| ExecError::Data(format!("{}: {msg}", self.data.at(i))))?;
        Ok(prompt)
    }

    pub fn builder(&self) -> &PromptBuilder {
        &self.builder
    }
}

/// A JSONL/Parquet dataset drawn in the sampler's order.
pub struct DatasetSource {
    prompts: DatasetPrompts,
    sampler: Sampler,
}

/// The plan's media in words: `video(frames = 4, size = 56x56)`, `2 images of 448x448`.
fn planned_media(spec: &JobSpec) -> String {
    match spec.rollout.media {
        MediaSpec::None => "no media".into(),
        MediaSpec::Image {
            count,
            height,
            width,
        } => format!(
            "{count} image{} of {width}x{height} per prompt (media = image(size = {width}x{height}, count = {count}))",
            if count == 1 { "" } else { "s" }
        ),
        MediaSpec::Video {
            frames,
            height,
            width,
        } => format!(
            "one video of {frames} frames of {width}x{height} per prompt (media = video(frames = {frames}, size = {width}x{height}))"
        ),
    }
}

/// Whether a record's media are of the kind and number the plan was compiled for (checked for
/// every record when the dataset is loaded, before any media is decoded). The error names the
/// field, what the plan has and what the record has.
fn check_media_shape(spec: &JobSpec, s: &Sample) -> Result<(), String> {
    let plan = || planned_media(spec);
    match (&spec.rollout.media, &s.media) {
        (MediaSpec::None, Media::None) => Ok(()),
        (MediaSpec::None, Media::Images(v)) => Err(format!(
            "field `images`: the record has {} image(s), the plan has {}",
            v.len(),
            plan()
        )),
        (MediaSpec::None, Media::Video(_)) => Err(format!(
            "field `video`: the record has a video, the plan has {}",
            plan()
        )),
        (MediaSpec::Image { count, .. }, Media::Images(v)) if v.len() == *count as usize => Ok(()),
        (MediaSpec::Image { .. }, Media::Images(v)) => Err(format!(
            "field `images`: the record has {} image(s), the plan has {}",
            v.len(),
            plan()
        )),
        (MediaSpec::Video { frames, .. }, Media::Video(v)) if v.len() == *frames as usize => Ok(()),
        (MediaSpec::Video { .. }, Media::Video(v)) => Err(format!(
            "field `video`: the record has {} frames, the plan has {}",
            v.len(),
            plan()
        )),
        (MediaSpec::Image { .. }, Media::Video(_)) => Err(format!(
            "field `video`: the record has a video, the plan has {}; give `images`",
            plan()
        )),
        (MediaSpec::Video { .. }, Media::Images(_)) => Err(format!(
            "field `images`: the record has images, the plan has {}; give `video`",
            plan()
        )),
        (_, Media::None) => Err(format!(
            "field `{}` is missing: the record is text only, the plan has {}",
            if matches!(spec.rollout.media, MediaSpec::Video { .. }) {
                "video"
            } else {
                "images"
            },
            plan()
        )),
    }
}

/// `(width, height)` of each image.
fn sizes_of(images: &[RgbImage]) -> Vec<(u32, u32)> {
    images.iter().map(|i| i.dimensions()).collect()
}

/// Whether a built prompt fits the plan: its media grids are the plan's (the plan's buffers and
/// tasks are sized by them) and its text (chat template included, media tokens aside) is at
/// most the plan's `text_tokens`. `sizes` are the record's image or frame sizes, for the
/// message.
fn check_prompt(spec: &JobSpec, p: &PromptData, sizes: &[(u32, u32)]) -> Result<(), String> {
    let merge = spec.actor.vision.spatial_merge_size.max(1);
    if let Some((kind, grid, _)) = super::prompts::media_grid(spec) {
        for m in &p.media {
            if m.grid != grid {
                let field = if matches!(kind, MediaKind::Image) {
                    "images"
                } else {
                    "video"
                };
                let (w, h) = sizes.first().copied().unwrap_or((0, 0));
                return Err(format!(
                    "field `{field}`: media of {w}x{h} give a grid of {:?} patches, the plan's is {grid:?} ({}); resize the media to the plan's size",
                    m.grid,
                    planned_media(spec)
                ));
            }
        }
    }
    let media_tokens: usize = p
        .media
        .iter()
        .map(|m| (m.grid.iter().product::<u32>() / (merge * merge)) as usize + 2)
        .sum();
    let text = p.ids.len().saturating_sub(media_tokens);
    let limit = spec.rollout.prompt_text_tokens as usize;
    if text > limit {
        return Err(format!(
            "field `prompt`: {text} text tokens with the chat template, above the plan's text_tokens = {limit}; shorten the prompt or raise text_tokens"
        ));
    }
    Ok(())
}

impl PromptSource for DatasetSource {
    fn prompts(&mut self, iteration: u32, count: usize) -> Result<Vec<PromptData>, ExecError> {
        let (_, idx) = self.sampler.batch(iteration as u64);
        if idx.len() != count {
            return Err(ExecError::Data(format!(
                "the sampler gave {} prompts, the plan needs {count}",
                idx.len()
            )));
        }
        idx.into_iter().map(|i| self.prompts.prompt(i)).collect()
    }
}

/// The prompt source a job's dataset spec names.
pub fn data_source(
    spec: &JobSpec,
    dataset: &DatasetSpec,
) -> Result<Box<dyn PromptSource>, ExecError> {
    match dataset {
        DatasetSpec::Synthetic => Ok(Box::new(super::prompts::SyntheticPrompts::new(spec))),
        DatasetSpec::Generated { name, size } if name == "moving_shapes" => {
            Ok(Box::new(ShapesSource::new(spec, *size)?))
        }
        DatasetSpec::Generated { name, .. } => Err(ExecError::Data(format!(
            "unknown generated dataset {name:?} (known: moving_shapes)"
        ))),
        DatasetSpec::File { path } => {
            let prompts = DatasetPrompts::load(spec, std::path::Path::new(path))?;
            let sampler = Sampler::new(
                prompts.len(),
                spec.rollout.prompts_per_iter,
                spec.seed,
                true,
            )
            .map_err(|e| ExecError::Data(format!("{path}: {e}")))?;
            Ok(Box::new(DatasetSource { prompts, sampler }))
        }
    }
}

/// The prompts an evaluation scores: a split of the moving-shapes task (drawn in memory, as
/// many as asked), or a held-out dataset file in the training data's format (JSONL or Parquet),
/// loaded, checked and turned into prompts as the training data is ([`DatasetPrompts`]).
pub enum HeldOut {
    // boxed: each holds a tokenizer, some 2 KiB
    Shapes {
        source: Box<ShapesSource>,
        split: Split,
    },
    File(Box<DatasetPrompts>),
}

impl HeldOut {
    /// `split` of the job's moving-shapes task; `None` when the job's data is not that task.
    pub fn split(spec: &JobSpec, split: Split) -> Result<Option<Self>, ExecError> {
        match &spec.rollout.dataset {
            DatasetSpec::Generated { name, size } if name == "moving_shapes" => {
                Ok(Some(HeldOut::Shapes {
                    source: Box::new(ShapesSource::new(spec, *size)?),
                    split,
                }))
            }
            _ => Ok(None),
        }
    }

    /// The dataset file `path` for `spec`'s plan; a record that does not parse or whose media
    /// are not the plan's is an error naming its line or row.
    pub fn file(spec: &JobSpec, path: &std::path::Path) -> Result<Self, ExecError> {
        Ok(HeldOut::File(Box::new(DatasetPrompts::load(spec, path)?)))
    }

    /// How many prompts an evaluation of `n` scores: `n`, or every record of a file that holds
    /// fewer.
    pub fn count(&self, n: u32) -> u32 {
        match self {
            HeldOut::Shapes { .. } => n,
            HeldOut::File(d) => n.min(u32::try_from(d.len()).unwrap_or(u32::MAX)),
        }
    }

    /// The prompts in words, for messages: `the moving-shapes task's test split`, or the file.
    pub fn describe(&self) -> String {
        match self {
            HeldOut::Shapes { split, .. } => {
                format!("the moving-shapes task's {} split", split.name())
            }
            HeldOut::File(d) => d.path().display().to_string(),
        }
    }

    /// Builds the first `count(n)` prompts and drops them: a record whose media do not decode
    /// or whose prompt does not fit the plan is an error (naming its line or row) before any
    /// evaluation, not in the middle of a run.
    pub fn check(&self, n: u32) -> Result<(), ExecError> {
        (0..self.count(n)).try_for_each(|i| self.prompt(i).map(drop))
    }

    /// Prompt `i`.
    fn prompt(&self, i: u32) -> Result<PromptData, ExecError> {
        match self {
            HeldOut::Shapes { source, split } => source.prompt(*split, i as u64),
            HeldOut::File(d) => d.prompt(i as usize),
        }
    }

    fn builder(&self) -> &PromptBuilder {
        match self {
            HeldOut::Shapes { source, .. } => source.builder(),
            HeldOut::File(d) => d.builder(),
        }
    }
}

/// Held-out accuracy: the mean reward of greedy answers to the first `n` test-split prompts of
/// the moving-shapes task. `None` when the job's data has no test split.
pub fn evaluate(
    spec: &JobSpec,
    model: &crate::model::Qwen25VL,
    n: u32,
) -> Result<Option<f64>, ExecError> {
    evaluate_split(spec, model, Split::Test, n)
}

/// The mean reward of greedy answers to the first `n` prompts of `split` of the moving-shapes
/// task (the train split measures fitting, the test split generalisation). `None` when the
/// job's data is not the moving-shapes task or `n` is 0.
pub fn evaluate_split(
    spec: &JobSpec,
    model: &crate::model::Qwen25VL,
    split: Split,
    n: u32,
) -> Result<Option<f64>, ExecError> {
    evaluate_split_with(spec, split, n, &mut cpu_generate(model))
}

/// A generator for [`score_held_out`]: the prompt's response by `model` on the CPU, decoded
/// as the config says.
pub fn cpu_generate(
    model: &crate::model::Qwen25VL,
) -> impl FnMut(&PromptData, u32, &crate::model::GenerateConfig) -> Result<Vec<u32>, ExecError> + '_
{
    use crate::model::{EncodedMedia, MediaInput, Prompt};
    move |p, i, cfg| {
        let inputs: Vec<MediaInput<'_>> = p
            .media
            .iter()
            .map(|m| MediaInput {
                kind: m.kind,
                pixels: &m.pixels,
                grid: m.grid,
            })
            .collect();
        let media = model.encode_media(&inputs, None)?;
        let refs: Vec<&EncodedMedia> = media.iter().collect();
        let prefix = model
            .prefill(
                &[Prompt {
                    ids: &p.ids,
                    media: &refs,
                }],
                None,
            )?
            .remove(0);
        Ok(model.generate_group(&prefix, &[i], cfg)?.remove(0).tokens)
    }
}

/// [`evaluate_split`] with any backend's greedy generation: `generate(prompt, index, cfg)`
/// returns the response tokens of prompt `index` of `split` under `cfg` (greedy sampling).
pub fn evaluate_split_with(
    spec: &JobSpec,
    split: Split,
    n: u32,
    generate: &mut Generate<'_>,
) -> Result<Option<f64>, ExecError> {
    if n == 0 {
        return Ok(None);
    }
    HeldOut::split(spec, split)?
        .map(|held| score_held_out(spec, &held, n, Decoding::Greedy, generate))
        .transpose()
}

/// How an evaluation decodes its answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decoding {
    /// Argmax at every step: the model's one most likely answer.
    Greedy,
    /// The job's sampling (temperature, top-k, top-p) under a fixed key: (the job's seed,
    /// iteration `u32::MAX - 1`, which no training iteration reaches, the prompt's index,
    /// step). Every evaluation draws the same random numbers, so two evaluations of a run differ
    /// by the weights only.
    Sampled,
}

/// The mean reward (the job's reward, each answer against its prompt's reference answer) of
/// the answers to the first [`HeldOut::count`]`(n)` prompts of `held`, decoded as `decoding`
/// says, with any backend's generation: `generate(prompt, index, cfg)` returns the response
/// tokens of prompt `index` under `cfg`, whose sampling it honours. An error when that is no
/// prompt.
pub fn score_held_out(
    spec: &JobSpec,
    held: &HeldOut,
    n: u32,
    decoding: Decoding,
    generate: &mut Generate<'_>,
) -> Result<f64, ExecError> {
    let n = held.count(n);
    if n == 0 {
        return Err(ExecError::Data(format!(
            "an evaluation of no prompts of {}",
            held.describe()
        )));
    }
    let cfg = eval_config(spec, decoding);
    let mut reward =
        Reward::from_spec(&spec.reward).map_err(|e| ExecError::Reward(e.to_string()))?;
    // answers are generated and scored EVAL_CHUNK at a time, so memory does not grow with n;
    // the sum runs in prompt order as one sum over all the scores would
    let mut sum = 0.0;
    for start in (0..n).step_by(EVAL_CHUNK as usize) {
        let batch = answers(held, &cfg, start..n.min(start + EVAL_CHUNK), generate)?;
        let scores = reward
            .score(&batch)
            .map_err(|e| ExecError::Reward(e.to_string()))?;
        sum = scores.iter().fold(sum, |acc, s| acc + s);
    }
    Ok(sum / n as f64)
}

/// How many answers an evaluation holds at once (see [`score_held_out`]).
const EVAL_CHUNK: u32 = 64;

/// Generation of one prompt's answer under a config (see [`score_held_out`]).
pub type Generate<'a> =
    dyn FnMut(&PromptData, u32, &crate::model::GenerateConfig) -> Result<Vec<u32>, ExecError> + 'a;

/// The greedy responses to the first `n` prompts of `split`, as (index, decoded text), for
/// looking at what a model answers. Empty when the job's data is not the moving-shapes task.
pub fn greedy_answers(
    spec: &JobSpec,
    model: &crate::model::Qwen25VL,
    split: Split,
    n: u32,
) -> Result<Vec<(Split, u32, String)>, ExecError> {
    let Some(held) = HeldOut::split(spec, split)? else {
        return Ok(Vec::new());
    };
    let cfg = eval_config(spec, Decoding::Greedy);
    Ok(answers(&held, &cfg, 0..n, &mut cpu_generate(model))?
        .into_iter()
        .enumerate()
        .map(|(i, req)| (split, i as u32, req.response))
        .collect())
}

/// The generation settings of an evaluation.
fn eval_config(spec: &JobSpec, decoding: Decoding) -> crate::model::GenerateConfig {
    use crate::model::{GenerateConfig, SamplingParams};
    let mut stop_ids = spec.actor.tokens.eos_token_ids.clone();
    stop_ids.extend(&spec.rollout.sampling.stop_token_ids);
    let (sampling, iteration) = match decoding {
        Decoding::Greedy => (SamplingParams::greedy(), u32::MAX),
        Decoding::Sampled => (
            SamplingParams::from_spec(&spec.rollout.sampling),
            u32::MAX - 1,
        ),
    };
    GenerateConfig {
        sampling,
        max_new_tokens: spec.rollout.max_new_tokens,
        stop_ids,
        seed: spec.seed,
        iteration,
    }
}

/// The answers to the prompts `range` of `held` as reward requests.
fn answers(
    held: &HeldOut,
    cfg: &crate::model::GenerateConfig,
    range: std::ops::Range<u32>,
    generate: &mut Generate<'_>,
) -> Result<Vec<RewardRequest>, ExecError> {
    let mut out = Vec::with_capacity(range.len());
    for i in range {
        let p = held.prompt(i)?;
        let tokens = generate(&p, i, cfg)?;
        out.push(RewardRequest {
            id: p.id.clone(),
            prompt: p.text.clone(),
            response: held.builder().decode(&tokens)?,
            answer: p.answer.clone(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tiny example's job (video of 4 frames of 56x56, text_tokens = 40), 2 prompts a
    /// step, drawn from the JSONL file `lines` (frames `f.png` of 56x56 and `big.png` of 112x112
    /// beside it).
    fn source(lines: &[&str]) -> (tempfile::TempDir, Result<Box<dyn PromptSource>, ExecError>) {
        let (tmp, spec, _) = job(lines);
        let source = data_source(&spec, &spec.rollout.dataset);
        (tmp, source)
    }

    /// [`source`]'s job and its JSONL file.
    fn job(lines: &[&str]) -> (tempfile::TempDir, JobSpec, std::path::PathBuf) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        image::RgbImage::new(56, 56)
            .save(dir.join("f.png"))
            .unwrap();
        image::RgbImage::new(112, 112)
            .save(dir.join("big.png"))
            .unwrap();
        let path = dir.join("d.jsonl");
        std::fs::write(&path, lines.join("\n")).unwrap();
        let src = include_str!("../../../examples/tiny.rpx")
            .replacen("const PROMPTS = 8 ", "const PROMPTS = 2 ", 1)
            .replacen(
                "generated(\"moving_shapes\", 4096)",
                &format!("file({:?})", path.display().to_string()),
                1,
            );
        let spec = rollplex_dsl::compile_source("t.rpx", &src, &rollplex_dsl::NoFiles)
            .unwrap()
            .spec;
        (tmp, spec, path)
    }

    const GOOD: &str = r#"{"prompt": "<video> Which way?", "video": ["f.png", "f.png", "f.png", "f.png"], "answer": "A"}"#;

    #[track_caller]
    fn refused_at_load(bad: &str, needles: &[&str]) {
        let (_dir, s) = source(&[GOOD, bad]);
        let e = s.err().expect("refused").to_string();
        assert!(e.contains("d.jsonl:2: "), "{e}");
        for n in needles {
            assert!(e.contains(n), "{n:?} not in: {e}");
        }
    }

    #[track_caller]
    fn refused_when_drawn(bad: &str, needles: &[&str]) {
        let (_dir, s) = source(&[GOOD, bad]);
        let mut s = s.expect("loads");
        let e = s.prompts(0, 2).unwrap_err().to_string();
        assert!(e.contains("d.jsonl:2: "), "{e}");
        for n in needles {
            assert!(e.contains(n), "{n:?} not in: {e}");
        }
    }

    /// An evaluation of more prompts than one chunk generates each prompt once, in order, and
    /// scores as one pass over all the answers would.
    #[test]
    fn evaluation_in_chunks_is_one_pass_over_the_prompts() {
        let spec = rollplex_dsl::compile_source(
            "t.rpx",
            include_str!("../../../examples/tiny.rpx"),
            &rollplex_dsl::NoFiles,
        )
        .unwrap()
        .spec;
        let n = 2 * EVAL_CHUNK + 3;
        let seen = std::cell::RefCell::new(Vec::new());
        // some answers are the prompt itself (which may name a letter), some empty
        let mut answer = |p: &PromptData, i: u32, _: &crate::model::GenerateConfig| {
            seen.borrow_mut().push(i);
            Ok(if i.is_multiple_of(3) {
                p.ids.clone()
            } else {
                Vec::new()
            })
        };
        let mean = evaluate_split_with(&spec, Split::Test, n, &mut answer)
            .unwrap()
            .unwrap();
        assert_eq!(*seen.borrow(), (0..n).collect::<Vec<_>>());
        let held = HeldOut::split(&spec, Split::Test).unwrap().unwrap();
        let cfg = eval_config(&spec, Decoding::Greedy);
        let all = answers(&held, &cfg, 0..n, &mut answer).unwrap();
        let scores = Reward::from_spec(&spec.reward)
            .unwrap()
            .score(&all)
            .unwrap();
        assert_eq!(
            mean.to_bits(),
            (scores.iter().sum::<f64>() / n as f64).to_bits()
        );
        assert_eq!(
            evaluate_split_with(&spec, Split::Test, 0, &mut answer).unwrap(),
            None
        );
    }

    /// A held-out file is loaded and built as the training data is: an evaluation of more
    /// prompts than it holds scores each of its records once, in order, each answer against
    /// its own record's; a record that does not fit the plan is named by its line.
    #[test]
    fn a_held_out_file_is_scored_against_each_records_answer() {
        let record =
            |answer: &str| GOOD.replace(r#""answer": "A""#, &format!(r#""answer": "{answer}""#));
        let (c, b) = (record("C"), record("B"));
        let (_dir, spec, path) = job(&[GOOD, &b, &c]);
        let held = HeldOut::file(&spec, &path).unwrap();
        assert_eq!((held.count(2), held.count(10)), (2, 3));
        held.check(10).unwrap();
        let seen = std::cell::RefCell::new(Vec::new());
        // every answer is `B`: right for the second record only
        let mut answer = |p: &PromptData, i: u32, _: &crate::model::GenerateConfig| {
            seen.borrow_mut().push((i, p.answer.clone()));
            Ok(held.builder().tokenizer().encode("B").unwrap())
        };
        for decoding in [Decoding::Greedy, Decoding::Sampled] {
            seen.borrow_mut().clear();
            let mean = score_held_out(&spec, &held, 10, decoding, &mut answer).unwrap();
            assert_eq!(mean, 1.0 / 3.0);
            assert_eq!(
                *seen.borrow(),
                [(0, "A".into()), (1, "B".into()), (2, "C".into())]
            );
        }

        let big = r#"{"prompt": "<video> x", "video": ["big.png", "big.png", "big.png", "big.png"], "answer": "A"}"#;
        let (_dir, spec, path) = job(&[GOOD, GOOD, big]);
        let held = HeldOut::file(&spec, &path).expect("loads: the frames decode when built");
        held.check(2).expect("the first two records fit");
        let e = held.check(3).unwrap_err().to_string();
        assert!(e.contains("d.jsonl:3: field `video`"), "{e}");
        let (_dir, spec, path) = job(&[GOOD, r#"{"prompt": "<video> x", "answer": "A"}"#]);
        let e = HeldOut::file(&spec, &path)
            .err()
            .expect("refused")
            .to_string();
        assert!(e.contains("d.jsonl:2: field `video` is missing"), "{e}");
    }

    #[test]
    fn records_that_do_not_fit_the_plan_are_errors_naming_line_and_field() {
        let (_dir, good) = source(&[GOOD, GOOD]);
        assert_eq!(good.unwrap().prompts(0, 2).unwrap().len(), 2);
        refused_at_load(
            r#"{"prompt": "<video> x", "video": ["f.png", "f.png", "f.png"], "answer": "A"}"#,
            &[
                "field `video`",
                "3 frames",
                "video(frames = 4, size = 56x56)",
            ],
        );
        refused_at_load(
            r#"{"prompt": "<image> x", "images": ["f.png"], "answer": "A"}"#,
            &["field `images`", "give `video`"],
        );
        refused_at_load(
            r#"{"prompt": "x", "answer": "A"}"#,
            &["field `video` is missing", "text only"],
        );
        refused_when_drawn(
            r#"{"prompt": "<video> x", "video": ["big.png", "big.png", "big.png", "big.png"], "answer": "A"}"#,
            &["field `video`", "112x112", "the plan's is [2, 4, 4]"],
        );
        let long = format!(
            r#"{{"prompt": "<video> {}", "video": ["f.png", "f.png", "f.png", "f.png"], "answer": "A"}}"#,
            "left right ".repeat(40)
        );
        refused_when_drawn(
            &long,
            &["field `prompt`", "above the plan's text_tokens = 40"],
        );
    }
}
