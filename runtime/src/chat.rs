//! Chat templates and prompt token ids with media placeholders expanded.
//!
//! What this module knows: the chat template as a checkpoint defines it (a Jinja template in
//! `chat_template.jinja`, `chat_template.json` or `tokenizer_config.json`), rendered with
//! minijinja the way Hugging Face renders it (`trim_blocks` and `lstrip_blocks` on,
//! `raise_exception`, `tojson`), and the Qwen2-VL processor's expansion of each
//! `<|image_pad|>` / `<|video_pad|>` into `grid_t*grid_h*grid_w / merge^2` copies.
//!
//! Invariants:
//! - The expansion is done on token ids, after tokenizing the rendered text. It gives the same
//!   ids as Hugging Face's string-level expansion because the pad tokens are special tokens that
//!   the tokenizer never merges with neighbours (a test checks both ways on the tiny tokenizer).
//! - Images and videos are numbered separately, in order of appearance, as in
//!   `Qwen2VLProcessor`; a placeholder without a media item, or a media item without a
//!   placeholder, is an error.

use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::tokenizer::TextTokenizer;

/// The chat template of Qwen2-VL and Qwen2.5-VL (their `chat_template.json`).
pub const QWEN2_VL_CHAT_TEMPLATE: &str = "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("cannot read {path}: {msg}")]
    Read { path: PathBuf, msg: String },
    #[error("{dir} has no chat template (looked in chat_template.jinja, chat_template.json and tokenizer_config.json)")]
    NoTemplate { dir: PathBuf },
    #[error("chat template{origin}: {msg}")]
    Template { origin: String, msg: String },
    #[error(
        "prompt has {placeholders} {kind} placeholder(s) but {items} {kind} item(s) were given"
    )]
    MediaCount {
        kind: &'static str,
        placeholders: usize,
        items: usize,
    },
    #[error("media grid {grid:?} of {kind} {index}: grid_h and grid_w must be positive multiples of merge size {merge}")]
    BadGrid {
        kind: &'static str,
        index: usize,
        grid: [u32; 3],
        merge: u32,
    },
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
}

pub type Result<T, E = ChatError> = std::result::Result<T, E>;

/// One part of a message's content, serialised as the template expects
/// (`{"type": "image"}`, `{"type": "text", "text": ...}`).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Part {
    Text { text: String },
    Image,
    Video,
}

/// A message's content: plain text or a list of parts.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Message {
    pub role: String,
    pub content: Content,
}

impl Message {
    pub fn text(role: &str, text: &str) -> Self {
        Self {
            role: role.into(),
            content: Content::Text(text.into()),
        }
    }
}

/// A user message for `prompt` with `images` images and `videos` videos, built as veRL builds
/// it: `<image>` / `<video>` markers in the prompt text become media parts in place; with no
/// markers at all, the media parts come first (images, then videos) and the text after them.
pub fn user_message(prompt: &str, images: usize, videos: usize) -> Result<Message> {
    let marked_images = prompt.matches("<image>").count();
    let marked_videos = prompt.matches("<video>").count();
    let mut parts = Vec::new();
    if marked_images == 0 && marked_videos == 0 {
        parts.extend(std::iter::repeat_n(Part::Image, images));
        parts.extend(std::iter::repeat_n(Part::Video, videos));
        if !prompt.is_empty() {
            parts.push(Part::Text {
                text: prompt.into(),
            });
        }
        return Ok(Message {
            role: "user".into(),
            content: Content::Parts(parts),
        });
    }
    if marked_images != images {
        return Err(ChatError::MediaCount {
            kind: "<image>",
            placeholders: marked_images,
            items: images,
        });
    }
    if marked_videos != videos {
        return Err(ChatError::MediaCount {
            kind: "<video>",
            placeholders: marked_videos,
            items: videos,
        });
    }
    let mut rest = prompt;
    while !rest.is_empty() {
        let next = [("<image>", Part::Image), ("<video>", Part::Video)]
            .into_iter()
            .filter_map(|(m, p)| rest.find(m).map(|i| (i, m.len(), p)))
            .min_by_key(|(i, _, _)| *i);
        match next {
            Some((i, len, part)) => {
                if i > 0 {
                    parts.push(Part::Text {
                        text: rest[..i].into(),
                    });
                }
                parts.push(part);
                rest = &rest[i + len..];
            }
            None => {
                parts.push(Part::Text { text: rest.into() });
                rest = "";
            }
        }
    }
    Ok(Message {
        role: "user".into(),
        content: Content::Parts(parts),
    })
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    origin: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .finish()
    }
}

impl ChatTemplate {
    /// The Qwen2-VL template (what the tiny model uses).
    pub fn qwen2_vl() -> Self {
        Self::from_source(QWEN2_VL_CHAT_TEMPLATE, "built-in Qwen2-VL")
            .expect("the built-in template compiles")
    }

    /// Compiles `source`; `origin` names where it came from in error messages.
    pub fn from_source(source: &str, origin: &str) -> Result<Self> {
        let mut env = minijinja::Environment::new();
        // Hugging Face renders chat templates with these two options on.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        let origin = if origin.is_empty() {
            String::new()
        } else {
            format!(" ({origin})")
        };
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| ChatError::Template {
                origin: origin.clone(),
                msg: describe(&e),
            })?;
        Ok(Self {
            env,
            origin,
            bos_token: None,
            eos_token: None,
        })
    }

    /// The template of a checkpoint directory, looked up where Hugging Face looks:
    /// `chat_template.jinja`, then `chat_template.json` (`{"chat_template": ...}`), then the
    /// `chat_template` field of `tokenizer_config.json` (a string, or a list of named templates
    /// of which `default` is used). `bos_token`/`eos_token` come from `tokenizer_config.json`.
    pub fn from_checkpoint(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let read_json = |name: &str| -> Result<Option<(PathBuf, serde_json::Value)>> {
            let path = dir.join(name);
            if !path.is_file() {
                return Ok(None);
            }
            let text = rollplex_plan::files::read_to_string(&path, rollplex_plan::files::TEXT_CAP)
                .map_err(|e| ChatError::Read {
                    path: path.clone(),
                    msg: e.to_string(),
                })?;
            let v = serde_json::from_str(&text).map_err(|e| ChatError::Read {
                path: path.clone(),
                msg: e.to_string(),
            })?;
            Ok(Some((path, v)))
        };
        let tok_config = read_json("tokenizer_config.json")?;
        let mut found: Option<(String, PathBuf)> = None;
        let jinja = dir.join("chat_template.jinja");
        if jinja.is_file() {
            let text = rollplex_plan::files::read_to_string(&jinja, rollplex_plan::files::TEXT_CAP)
                .map_err(|e| ChatError::Read {
                    path: jinja.clone(),
                    msg: e.to_string(),
                })?;
            found = Some((text, jinja));
        }
        if found.is_none() {
            if let Some((path, v)) = read_json("chat_template.json")? {
                match v.get("chat_template").and_then(|t| t.as_str()) {
                    Some(t) => found = Some((t.to_string(), path)),
                    None => {
                        return Err(ChatError::Read {
                            path,
                            msg: "field `chat_template` is missing or not a string".into(),
                        })
                    }
                }
            }
        }
        if found.is_none() {
            if let Some((path, v)) = &tok_config {
                match v.get("chat_template") {
                    Some(serde_json::Value::String(t)) => found = Some((t.clone(), path.clone())),
                    Some(serde_json::Value::Array(list)) => {
                        let default = list
                            .iter()
                            .find(|e| e.get("name").and_then(|n| n.as_str()) == Some("default"));
                        match default
                            .and_then(|e| e.get("template"))
                            .and_then(|t| t.as_str())
                        {
                            Some(t) => found = Some((t.to_string(), path.clone())),
                            None => return Err(ChatError::Read {
                                path: path.clone(),
                                msg: "`chat_template` is a list without a template named `default`"
                                    .into(),
                            }),
                        }
                    }
                    _ => {}
                }
            }
        }
        let Some((source, path)) = found else {
            return Err(ChatError::NoTemplate { dir: dir.into() });
        };
        let mut t = Self::from_source(&source, &path.display().to_string())?;
        if let Some((_, v)) = &tok_config {
            // Tokens are strings or AddedToken objects ({"content": ...}).
            let token = |key: &str| match v.get(key) {
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                Some(serde_json::Value::Object(o)) => {
                    o.get("content").and_then(|c| c.as_str()).map(String::from)
                }
                _ => None,
            };
            t.bos_token = token("bos_token");
            t.eos_token = token("eos_token");
        }
        Ok(t)
    }

    /// Renders `messages` to the prompt text.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| ChatError::Template {
                origin: self.origin.clone(),
                msg: describe(&e),
            })?;
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            add_vision_id => false,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
        };
        tmpl.render(ctx).map_err(|e| ChatError::Template {
            origin: self.origin.clone(),
            msg: describe(&e),
        })
    }
}

fn describe(e: &minijinja::Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(&format!(": {inner}"));
        src = inner.source();
    }
    s
}

/// Which placeholder a media item fills.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MediaKind {
    Image,
    Video,
}

/// One media item's patch grid (`grid_thw` of the preprocessor).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MediaGrid {
    pub kind: MediaKind,
    pub grid_thw: [u32; 3],
}

impl MediaGrid {
    /// Tokens the item takes in the prompt: `t*h*w / merge^2`.
    pub fn tokens(&self, merge: u32) -> usize {
        let [t, h, w] = self.grid_thw;
        (t as usize * h as usize * w as usize) / (merge as usize * merge as usize)
    }
}

/// Prompt token ids with media placeholders expanded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PromptIds {
    pub ids: Vec<u32>,
    /// For each media item, in the order of the `grids` given: its token range in `ids`.
    pub media_spans: Vec<Range<usize>>,
}

/// Replaces the `i`-th image (video) pad id with `grids`' `i`-th image (video) token count.
/// `grids` lists all items; images and videos are matched to placeholders separately.
pub fn expand_media_tokens(
    ids: &[u32],
    image_token_id: u32,
    video_token_id: u32,
    grids: &[MediaGrid],
    merge: u32,
) -> Result<PromptIds> {
    let mut by_kind: [Vec<usize>; 2] = [Vec::new(), Vec::new()];
    for (i, g) in grids.iter().enumerate() {
        let [t, h, w] = g.grid_thw;
        let kind = if g.kind == MediaKind::Image {
            "image"
        } else {
            "video"
        };
        if merge == 0 || t == 0 || h == 0 || w == 0 || h % merge != 0 || w % merge != 0 {
            return Err(ChatError::BadGrid {
                kind,
                index: i,
                grid: g.grid_thw,
                merge,
            });
        }
        by_kind[(g.kind == MediaKind::Video) as usize].push(i);
    }
    let pads = [
        ids.iter().filter(|&&t| t == image_token_id).count(),
        ids.iter().filter(|&&t| t == video_token_id).count(),
    ];
    for (k, kind) in ["<|image_pad|>", "<|video_pad|>"].into_iter().enumerate() {
        if pads[k] != by_kind[k].len() {
            return Err(ChatError::MediaCount {
                kind,
                placeholders: pads[k],
                items: by_kind[k].len(),
            });
        }
    }
    let extra: usize = grids.iter().map(|g| g.tokens(merge)).sum::<usize>();
    let mut out = Vec::with_capacity(ids.len() + extra);
    let mut spans = vec![0..0; grids.len()];
    let mut next = [0usize; 2];
    for &t in ids {
        let k = if t == image_token_id {
            0
        } else if t == video_token_id {
            1
        } else {
            out.push(t);
            continue;
        };
        let item = by_kind[k][next[k]];
        next[k] += 1;
        let n = grids[item].tokens(merge);
        spans[item] = out.len()..out.len() + n;
        out.extend(std::iter::repeat_n(t, n));
    }
    Ok(PromptIds {
        ids: out,
        media_spans: spans,
    })
}

/// Renders `messages` (generation prompt added), tokenizes, and expands media placeholders.
pub fn prompt_ids(
    tok: &TextTokenizer,
    template: &ChatTemplate,
    messages: &[Message],
    grids: &[MediaGrid],
    merge: u32,
) -> Result<PromptIds> {
    let text = template.render(messages, true)?;
    let ids = tok.encode(&text)?;
    let sp = tok.special_tokens();
    expand_media_tokens(&ids, sp.image_token_id, sp.video_token_id, grids, merge)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tiny;

    #[test]
    fn qwen2_vl_template_renders_video_prompt() {
        let m = user_message("Which way?", 0, 1).unwrap();
        let text = ChatTemplate::qwen2_vl().render(&[m], true).unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n\
             <|vision_start|><|video_pad|><|vision_end|>Which way?<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn template_with_system_and_string_content() {
        let msgs = [
            Message::text("system", "Be brief."),
            Message::text("user", "hi"),
        ];
        let text = ChatTemplate::qwen2_vl().render(&msgs, false).unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        );
    }

    #[test]
    fn markers_place_media_in_text_as_verl_does() {
        let m = user_message("Look: <image> and <video>. Then <image>?", 2, 1).unwrap();
        let Content::Parts(parts) = m.content else {
            panic!()
        };
        assert_eq!(
            parts,
            vec![
                Part::Text {
                    text: "Look: ".into()
                },
                Part::Image,
                Part::Text {
                    text: " and ".into()
                },
                Part::Video,
                Part::Text {
                    text: ". Then ".into()
                },
                Part::Image,
                Part::Text { text: "?".into() },
            ]
        );
        let err = user_message("<image>", 2, 0).unwrap_err().to_string();
        assert!(err.contains("1 <image> placeholder(s) but 2"), "{err}");
    }

    #[test]
    fn video_pad_expands_to_thw_over_merge_squared() {
        let tok = TextTokenizer::tiny().unwrap();
        let m = user_message("Which way did the red square move?", 0, 1).unwrap();
        // 4 frames of 56x56: grid (2, 4, 4) -> 32 patches -> 8 tokens.
        let grids = [MediaGrid {
            kind: MediaKind::Video,
            grid_thw: [2, 4, 4],
        }];
        let p = prompt_ids(&tok, &ChatTemplate::qwen2_vl(), &[m], &grids, 2).unwrap();
        assert_eq!(p.media_spans[0].len(), 8);
        let span = p.media_spans[0].clone();
        assert!(p.ids[span.clone()].iter().all(|&t| t == tiny::VIDEO_PAD));
        assert_eq!(p.ids[span.start - 1], tiny::VISION_START);
        assert_eq!(p.ids[span.end], tiny::VISION_END);
        assert_eq!(p.ids.iter().filter(|&&t| t == tiny::VIDEO_PAD).count(), 8);
    }

    #[test]
    fn id_level_expansion_equals_string_level_expansion() {
        // Hugging Face expands the placeholder in the text, then tokenizes.
        let tok = TextTokenizer::tiny().unwrap();
        let m = user_message("<image>left or <video> right <image>", 2, 1).unwrap();
        let grids = [
            MediaGrid {
                kind: MediaKind::Image,
                grid_thw: [1, 2, 4],
            },
            MediaGrid {
                kind: MediaKind::Video,
                grid_thw: [3, 2, 2],
            },
            MediaGrid {
                kind: MediaKind::Image,
                grid_thw: [1, 4, 4],
            },
        ];
        let tmpl = ChatTemplate::qwen2_vl();
        let ours = prompt_ids(&tok, &tmpl, std::slice::from_ref(&m), &grids, 2).unwrap();
        let mut text = tmpl.render(&[m], true).unwrap();
        for (pad, counts) in [("<|image_pad|>", [2usize, 4]), ("<|video_pad|>", [3, 0])] {
            for n in counts.iter().filter(|&&n| n > 0) {
                text = text.replacen(pad, &"<|placeholder|>".repeat(*n), 1);
            }
            text = text.replace("<|placeholder|>", pad);
        }
        assert_eq!(ours.ids, tok.encode(&text).unwrap());
        assert_eq!(
            ours.media_spans.iter().map(|s| s.len()).collect::<Vec<_>>(),
            vec![2, 3, 4]
        );
        assert!(ours.media_spans[0].end <= ours.media_spans[1].start);
    }

    #[test]
    fn media_count_mismatch_is_an_error() {
        let ids = [1, tiny::VIDEO_PAD, 2];
        let err = expand_media_tokens(&ids, tiny::IMAGE_PAD, tiny::VIDEO_PAD, &[], 2)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("1 <|video_pad|> placeholder(s) but 0"),
            "{err}"
        );
        let g = [MediaGrid {
            kind: MediaKind::Video,
            grid_thw: [1, 3, 2],
        }];
        let err = expand_media_tokens(&ids, tiny::IMAGE_PAD, tiny::VIDEO_PAD, &g, 2)
            .unwrap_err()
            .to_string();
        assert!(err.contains("multiples of merge size 2"), "{err}");
    }

    #[test]
    fn checkpoint_lookup_order_and_errors() {
        let dir = tempfile::tempdir().unwrap();
        let err = ChatTemplate::from_checkpoint(dir.path())
            .unwrap_err()
            .to_string();
        assert!(err.contains("has no chat template"), "{err}");
        tiny::write_files(dir.path()).unwrap();
        let t = ChatTemplate::from_checkpoint(dir.path()).unwrap();
        assert_eq!(
            t.render(&[Message::text("user", "x")], true).unwrap(),
            ChatTemplate::qwen2_vl()
                .render(&[Message::text("user", "x")], true)
                .unwrap()
        );
        // chat_template.json wins over tokenizer_config.json, and named list forms work.
        std::fs::write(
            dir.path().join("chat_template.json"),
            r#"{"chat_template": "{{ eos_token }}|{{ messages[0].content }}"}"#,
        )
        .unwrap();
        let t = ChatTemplate::from_checkpoint(dir.path()).unwrap();
        assert_eq!(
            t.render(&[Message::text("user", "x")], false).unwrap(),
            "<|im_end|>|x"
        );
        std::fs::write(
            dir.path().join("chat_template.jinja"),
            "{% if x %}\n  {{ raise_exception('no x') }}\n{% endif %}ok",
        )
        .unwrap();
        let t = ChatTemplate::from_checkpoint(dir.path()).unwrap();
        // trim_blocks drops the newline after a block tag, as in Hugging Face.
        assert_eq!(t.render(&[], false).unwrap(), "ok");
    }

    #[test]
    fn template_errors_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("chat_template.jinja"),
            "{% for m in messages %}",
        )
        .unwrap();
        let err = ChatTemplate::from_checkpoint(dir.path())
            .unwrap_err()
            .to_string();
        assert!(err.contains("chat_template.jinja"), "{err}");
        let t = ChatTemplate::from_source("{{ raise_exception('only user turns') }}", "t.jinja")
            .unwrap();
        let err = t.render(&[], false).unwrap_err().to_string();
        assert!(
            err.contains("only user turns") && err.contains("t.jinja"),
            "{err}"
        );
    }
}
