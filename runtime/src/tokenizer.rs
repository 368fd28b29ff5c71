//! Text tokenization: Hugging Face `tokenizer.json` files, and a small built-in tokenizer for
//! the tiny model that has no checkpoint.
//!
//! What this module knows: how to turn text into token ids and back, and which ids carry a
//! meaning to a Qwen2.5-VL model (`<|image_pad|>`, `<|video_pad|>`, `<|vision_start|>`, ...).
//! It does not know chat templates (see [`crate::chat`]) nor how many pad tokens a media item
//! expands to.
//!
//! Invariants:
//! - Encoding never adds special tokens of its own (Qwen2 tokenizers have no BOS); special
//!   tokens come from the chat template text.
//! - The built-in tiny tokenizer is a byte-level BPE, so every string round-trips exactly
//!   (`decode(encode(s)) == s`). Its vocabulary is exactly [`tiny::VOCAB_SIZE`] = 512 ids:
//!   ids 0..256 are the 256 bytes, 256..504 are [`tiny::MERGES`] merges learned by a
//!   deterministic BPE on a built-in corpus, and 504..512 are 8 special tokens
//!   ([`tiny::SPECIAL_TOKENS`]). The ids are constants and agree with the DSL's tiny preset:
//!   `<|endoftext|>` 504, `<|im_end|>` 505 (EOS ids [505, 504]), `<|im_start|>` 506,
//!   `<|vision_pad|>` 507, `<|vision_start|>` 508, `<|vision_end|>` 509, `<|image_pad|>` 510,
//!   `<|video_pad|>` 511.
//! - The tiny tokenizer is serialised as a standard `tokenizer.json`, loaded through the same
//!   code path as a checkpoint's, and loads in Hugging Face `tokenizers`/`transformers` too.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use rollplex_plan::spec::SpecialTokens;

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot load tokenizer {path}: {msg}")]
    Load { path: PathBuf, msg: String },
    #[error("tokenizer: {0}")]
    Tokenizers(String),
    #[error("tokenizer has no token {token:?}, which a Qwen2.5-VL model needs ({why})")]
    MissingToken { token: String, why: &'static str },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("built-in tiny tokenizer: {0}")]
    Tiny(String),
}

pub type Result<T, E = TokenizerError> = std::result::Result<T, E>;

/// A loaded tokenizer: a `tokenizers::Tokenizer` plus the special ids the runtime needs.
#[derive(Clone)]
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    special: SpecialTokens,
    /// `<|im_end|>` / `<|endoftext|>` style ids used by chat templates, by content.
    by_content: HashMap<String, u32>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("special", &self.special)
            .finish()
    }
}

impl TextTokenizer {
    /// Loads `tokenizer.json` (a file, or a checkpoint directory that holds one).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let mut path = path.as_ref().to_path_buf();
        if path.is_dir() {
            path = path.join("tokenizer.json");
        }
        if !path.is_file() {
            return Err(TokenizerError::Load {
                path,
                msg: "no such file".into(),
            });
        }
        let text = rollplex_plan::files::read_to_string(&path, rollplex_plan::files::TEXT_CAP)
            .map_err(|e| TokenizerError::Load {
                path: path.clone(),
                msg: e.to_string(),
            })?;
        let inner = tokenizers::Tokenizer::from_str(&text).map_err(|e| TokenizerError::Load {
            path: path.clone(),
            msg: e.to_string(),
        })?;
        Self::from_tokenizer(inner).map_err(|e| TokenizerError::Load {
            path,
            msg: e.to_string(),
        })
    }

    /// Parses the text of a `tokenizer.json`.
    pub fn from_json(json: &str) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_str(json)
            .map_err(|e| TokenizerError::Tokenizers(e.to_string()))?;
        Self::from_tokenizer(inner)
    }

    /// The built-in tokenizer of the tiny model (see [`tiny`]).
    pub fn tiny() -> Result<Self> {
        Self::from_json(&tiny::tokenizer_json()?)
    }

    fn from_tokenizer(inner: tokenizers::Tokenizer) -> Result<Self> {
        let id = |token: &str, why: &'static str| {
            inner
                .token_to_id(token)
                .ok_or_else(|| TokenizerError::MissingToken {
                    token: token.into(),
                    why,
                })
        };
        let image_token_id = id("<|image_pad|>", "image placeholder")?;
        let video_token_id = id("<|video_pad|>", "video placeholder")?;
        let vision_start_token_id = id("<|vision_start|>", "start of a media item")?;
        let vision_end_token_id = id("<|vision_end|>", "end of a media item")?;
        // Qwen2.5-VL's generation_config: eos_token_id = [<|im_end|>, <|endoftext|>].
        let mut eos_token_ids = Vec::new();
        for t in ["<|im_end|>", "<|endoftext|>"] {
            if let Some(i) = inner.token_to_id(t) {
                eos_token_ids.push(i);
            }
        }
        if eos_token_ids.is_empty() {
            return Err(TokenizerError::MissingToken {
                token: "<|im_end|>".into(),
                why: "end of an assistant turn (generation stops there)",
            });
        }
        let by_content = inner
            .get_added_tokens_decoder()
            .into_iter()
            .map(|(id, tok)| (tok.content, id))
            .collect();
        let special = SpecialTokens {
            image_token_id,
            video_token_id,
            vision_start_token_id,
            vision_end_token_id,
            eos_token_ids,
        };
        Ok(Self {
            inner,
            special,
            by_content,
        })
    }

    /// Token ids of `text`, with special tokens written in the text (`<|im_start|>`) mapped to
    /// their ids and nothing added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| TokenizerError::Tokenizers(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`; `skip_special` drops special tokens (`<|im_end|>`, pads).
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| TokenizerError::Tokenizers(e.to_string()))
    }

    /// Number of ids, added tokens included (the model's `vocab_size` may be larger).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The ids with a meaning to the model, looked up by their Qwen2-VL spelling.
    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.special
    }

    /// The id of an added (special) token by its text, e.g. `<|im_start|>`.
    pub fn added_token_id(&self, content: &str) -> Option<u32> {
        self.by_content.get(content).copied()
    }

    /// The wrapped Hugging Face tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// The GPT-2 byte-to-character map of byte-level BPE: printable bytes map to themselves, the
/// others to code points from U+0100 on, in byte order.
pub fn bytes_to_unicode() -> [char; 256] {
    let mut printable = [false; 256];
    for b in (b'!'..=b'~').chain(0xA1..=0xAC).chain(0xAE..=0xFF) {
        printable[b as usize] = true;
    }
    let mut out = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256usize {
        out[b] = if printable[b] {
            char::from_u32(b as u32).expect("latin-1 code point")
        } else {
            n += 1;
            char::from_u32(255 + n).expect("code point below U+0200")
        };
    }
    out
}

/// The built-in tokenizer of the tiny model.
pub mod tiny {
    use super::*;

    /// Total ids (= the tiny model's `vocab_size`).
    pub const VOCAB_SIZE: u32 = 512;
    /// Byte tokens: ids 0..256, id = byte value.
    pub const BYTES: u32 = 256;
    /// BPE merges: ids 256..504.
    pub const MERGES: u32 = 248;
    /// First special id.
    pub const FIRST_SPECIAL: u32 = BYTES + MERGES;
    /// The special tokens at ids `FIRST_SPECIAL..VOCAB_SIZE` (504..512), the ids the DSL's
    /// `tiny` preset declares (`rollplex_dsl::presets::tiny_tokens`).
    pub const SPECIAL_TOKENS: [&str; 8] = [
        "<|endoftext|>",
        "<|im_end|>",
        "<|im_start|>",
        "<|vision_pad|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|image_pad|>",
        "<|video_pad|>",
    ];
    pub const ENDOFTEXT: u32 = FIRST_SPECIAL;
    pub const IM_END: u32 = FIRST_SPECIAL + 1;
    pub const IM_START: u32 = FIRST_SPECIAL + 2;
    pub const VISION_START: u32 = FIRST_SPECIAL + 4;
    pub const VISION_END: u32 = FIRST_SPECIAL + 5;
    pub const IMAGE_PAD: u32 = FIRST_SPECIAL + 6;
    pub const VIDEO_PAD: u32 = FIRST_SPECIAL + 7;

    /// The special ids of the tiny model, as the job spec holds them.
    pub fn special_tokens() -> SpecialTokens {
        SpecialTokens {
            image_token_id: IMAGE_PAD,
            video_token_id: VIDEO_PAD,
            vision_start_token_id: VISION_START,
            vision_end_token_id: VISION_END,
            eos_token_ids: vec![IM_END, ENDOFTEXT],
        }
    }

    /// The text the merges are learned from, as (text, weight) pairs: the chat template's
    /// fixed text, the moving-shapes questions and answer forms, and common short words.
    /// Changing it changes the tiny vocabulary (and so any tiny checkpoint's meaning).
    fn corpus() -> Vec<(String, u32)> {
        let mut c: Vec<(String, u32)> = Vec::new();
        let mut add = |s: &str, w: u32| c.push((s.to_string(), w));
        add("system\nYou are a helpful assistant.", 20);
        add("user\n", 20);
        add("assistant\n", 20);
        let colours = [
            "red", "green", "blue", "yellow", "purple", "orange", "white", "cyan",
        ];
        let shapes = ["square", "circle", "triangle"];
        for c in colours {
            for s in shapes {
                add(&format!("Which way did the {c} {s} move?"), 4);
            }
        }
        add("A. left B. right C. up D. down", 16);
        add("A. left\nB. right\nC. up\nD. down", 8);
        add(
            "Answer with the option's letter from the given choices directly.",
            8,
        );
        for l in ["A", "B", "C", "D"] {
            add(&format!("The answer is {l}."), 4);
            add(&format!("<answer>{l}</answer>"), 4);
            add(&format!("Answer: {l}"), 4);
            add(&format!("answer: ({l})"), 2);
        }
        add(
            "<think> The square moved to the left, so the answer is A. </think>",
            4,
        );
        add(
            "The red square moves from the left side of the frame to the right side between the first \
             and the last frame, so it moved right. It did not move up or down.",
            2,
        );
        add(
            "What is shown in the image? How many objects are in the video? Where is the object in \
             the picture? Count the number of shapes. What colour is it? The color of the shape is \
             blue. There are two circles and one triangle. It is at the top, bottom or center.",
            2,
        );
        add("zero one two three four five six seven eight nine ten", 2);
        add("0 1 2 3 4 5 6 7 8 9 10 100 2024", 2);
        add(
            "yes no true false first last frame video image moved moving object shape",
            2,
        );
        c
    }

    /// Learns `MERGES` merges on [`corpus`] by plain BPE: repeatedly merge the most frequent
    /// adjacent pair (ties: the lexicographically smallest pair), inside byte-level words.
    fn learn_merges() -> Result<Vec<(String, String)>> {
        use tokenizers::pre_tokenizers::byte_level::ByteLevel;
        use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
        let mut words: BTreeMap<Vec<String>, u64> = BTreeMap::new();
        let pre = ByteLevel::new(false, true, true);
        for (text, weight) in corpus() {
            let mut pts = PreTokenizedString::from(text.as_str());
            pre.pre_tokenize(&mut pts)
                .map_err(|e| TokenizerError::Tiny(e.to_string()))?;
            for (w, _, _) in pts.get_splits(OffsetReferential::Original, OffsetType::Byte) {
                let symbols: Vec<String> = w.chars().map(|c| c.to_string()).collect();
                *words.entry(symbols).or_insert(0) += weight as u64;
            }
        }
        let mut words: Vec<(Vec<String>, u64)> = words.into_iter().collect();
        let mut merges = Vec::with_capacity(MERGES as usize);
        while merges.len() < MERGES as usize {
            let mut counts: BTreeMap<(&str, &str), u64> = BTreeMap::new();
            for (syms, n) in &words {
                for p in syms.windows(2) {
                    *counts.entry((p[0].as_str(), p[1].as_str())).or_insert(0) += n;
                }
            }
            // Max count; BTreeMap order makes the smallest pair win ties.
            let best =
                counts.iter().fold(
                    None::<(&(&str, &str), u64)>,
                    |best, (pair, &n)| match best {
                        Some((_, bn)) if bn >= n => best,
                        _ => Some((pair, n)),
                    },
                );
            let Some(((a, b), _)) = best else {
                return Err(TokenizerError::Tiny(format!(
                    "corpus has only {} distinct pairs to merge, {} needed",
                    merges.len(),
                    MERGES
                )));
            };
            let (a, b) = (a.to_string(), b.to_string());
            let ab = format!("{a}{b}");
            for (syms, _) in words.iter_mut() {
                let mut i = 0;
                while i + 1 < syms.len() {
                    if syms[i] == a && syms[i + 1] == b {
                        syms[i] = ab.clone();
                        syms.remove(i + 1);
                    }
                    i += 1;
                }
            }
            merges.push((a, b));
        }
        Ok(merges)
    }

    /// The tiny tokenizer as the text of a `tokenizer.json`.
    pub fn tokenizer_json() -> Result<String> {
        let byte_chars = bytes_to_unicode();
        let mut vocab: BTreeMap<String, u32> = BTreeMap::new();
        for (b, c) in byte_chars.iter().enumerate() {
            vocab.insert(c.to_string(), b as u32);
        }
        let merges = learn_merges()?;
        for (i, (a, b)) in merges.iter().enumerate() {
            let tok = format!("{a}{b}");
            if vocab.insert(tok.clone(), BYTES + i as u32).is_some() {
                return Err(TokenizerError::Tiny(format!(
                    "merge {i} produced an existing token {tok:?}"
                )));
            }
        }
        let added: Vec<serde_json::Value> = SPECIAL_TOKENS
            .iter()
            .enumerate()
            .map(|(i, t)| {
                serde_json::json!({
                    "id": FIRST_SPECIAL + i as u32, "content": t, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": true
                })
            })
            .collect();
        let byte_level = serde_json::json!({
            "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true
        });
        let merges: Vec<String> = merges.iter().map(|(a, b)| format!("{a} {b}")).collect();
        let json = serde_json::json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": byte_level,
            "post_processor": null,
            "decoder": byte_level,
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                "ignore_merges": false, "vocab": vocab, "merges": merges
            }
        });
        serde_json::to_string_pretty(&json).map_err(|e| TokenizerError::Tiny(e.to_string()))
    }

    /// Writes `tokenizer.json`, `tokenizer_config.json` (with the Qwen2-VL chat template) into
    /// `dir`, so a tiny checkpoint directory is complete for Hugging Face tools as well.
    pub fn write_files(dir: &Path) -> Result<()> {
        let write = |name: &str, text: String| {
            let path = dir.join(name);
            std::fs::write(&path, text).map_err(|source| TokenizerError::Write { path, source })
        };
        std::fs::create_dir_all(dir).map_err(|source| TokenizerError::Write {
            path: dir.into(),
            source,
        })?;
        write("tokenizer.json", tokenizer_json()?)?;
        let config = serde_json::json!({
            "tokenizer_class": "Qwen2TokenizerFast",
            "model_max_length": 32768,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "bos_token": null,
            "unk_token": null,
            "clean_up_tokenization_spaces": false,
            "errors": "replace",
            "split_special_tokens": false,
            "chat_template": crate::chat::QWEN2_VL_CHAT_TEMPLATE,
        });
        write(
            "tokenizer_config.json",
            serde_json::to_string_pretty(&config).expect("json value"),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_vocab_layout_is_fixed() {
        let t = TextTokenizer::tiny().unwrap();
        assert_eq!(t.vocab_size(), tiny::VOCAB_SIZE as usize);
        for (i, s) in tiny::SPECIAL_TOKENS.iter().enumerate() {
            assert_eq!(
                t.token_to_id(s),
                Some(tiny::FIRST_SPECIAL + i as u32),
                "{s}"
            );
        }
        assert_eq!(t.special_tokens(), &tiny::special_tokens());
        // Byte tokens are at their byte value.
        assert_eq!(t.encode("A").unwrap(), vec![b'A' as u32]);
    }

    #[test]
    fn tiny_round_trips_any_text() {
        let t = TextTokenizer::tiny().unwrap();
        for s in [
            "Which way did the red square move? A. left B. right C. up D. down",
            "unusual wörds, emoji 🙂, tabs\tand\nnewlines  ",
            "",
            "<|im_start|>user\nhi<|im_end|>\n",
        ] {
            let ids = t.encode(s).unwrap();
            assert!(ids.iter().all(|&i| i < tiny::VOCAB_SIZE));
            assert_eq!(t.decode(&ids, false).unwrap(), s);
        }
    }

    #[test]
    fn tiny_special_tokens_are_single_ids_and_task_words_are_short() {
        let t = TextTokenizer::tiny().unwrap();
        let ids = t
            .encode("<|im_start|>assistant\n<|vision_start|><|video_pad|><|vision_end|>")
            .unwrap();
        assert_eq!(ids[0], tiny::IM_START);
        assert!(ids.ends_with(&[tiny::VISION_START, tiny::VIDEO_PAD, tiny::VISION_END]));
        // The merges learned from the built-in corpus make the task's question compact.
        let q = t
            .encode("Which way did the red square move? A. left B. right C. up D. down")
            .unwrap();
        assert!(q.len() <= 20, "question takes {} tokens: {q:?}", q.len());
        for w in [" left", " right", " up", " down", " square"] {
            assert_eq!(t.encode(w).unwrap().len(), 1, "{w:?}");
        }
    }

    #[test]
    fn tiny_is_deterministic() {
        assert_eq!(
            tiny::tokenizer_json().unwrap(),
            tiny::tokenizer_json().unwrap()
        );
    }

    #[test]
    fn load_from_dir_and_missing_file_names_path() {
        let dir = tempfile::tempdir().unwrap();
        tiny::write_files(dir.path()).unwrap();
        let t = TextTokenizer::from_file(dir.path()).unwrap();
        assert_eq!(
            t.encode("red").unwrap(),
            TextTokenizer::tiny().unwrap().encode("red").unwrap()
        );
        let missing = dir.path().join("nope/tokenizer.json");
        let err = TextTokenizer::from_file(&missing).unwrap_err().to_string();
        assert!(err.contains("nope/tokenizer.json"), "{err}");
    }

    #[test]
    fn tokenizer_without_vision_tokens_is_refused() {
        let json = tiny::tokenizer_json()
            .unwrap()
            .replace("<|video_pad|>", "<|not_video|>");
        let err = TextTokenizer::from_json(&json).unwrap_err().to_string();
        assert!(err.contains("<|video_pad|>"), "{err}");
    }

    #[test]
    fn bytes_to_unicode_is_gpt2s() {
        let m = bytes_to_unicode();
        assert_eq!(m[b' ' as usize], 'Ġ');
        assert_eq!(m[b'\n' as usize], 'Ċ');
        assert_eq!(m[b'a' as usize], 'a');
        let mut s: Vec<char> = m.to_vec();
        s.sort();
        s.dedup();
        assert_eq!(s.len(), 256);
    }
}
