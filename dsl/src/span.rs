//! Byte spans into the source text, and the map from a spec field's dotted key path to the
//! span that set it.
//!
//! Invariant: a [`Span`] is a byte range of the one source string it was made from, with
//! `start <= end <= src.len()`, on UTF-8 boundaries. [`SpanMap`] always has an entry for the
//! root path `""` (the pipeline's name) once checking started, so [`SpanMap::get`] on any path
//! finds something.

use std::collections::BTreeMap;

/// A byte range `start..end` in the source text.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Span {
    pub start: usize,
    pub end: usize,
}

impl Span {
    pub fn new(start: usize, end: usize) -> Span {
        Span {
            start,
            end: end.max(start),
        }
    }

    /// The smallest span covering both.
    pub fn to(self, other: Span) -> Span {
        Span::new(self.start.min(other.start), self.end.max(other.end))
    }

    pub fn len(&self) -> usize {
        self.end - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }
}

/// The start of every line of a source, so that the line of an offset is a binary search and
/// its column a count over that line alone: locating n diagnostics in a file of m bytes costs
/// O(m + n log m) (plus the lengths of their lines), not O(n m).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LineIndex {
    /// Byte offset of the first byte of each line; `starts[0] == 0`.
    starts: Vec<usize>,
}

impl LineIndex {
    pub fn new(src: &str) -> LineIndex {
        let mut starts = vec![0];
        starts.extend(
            src.bytes()
                .enumerate()
                .filter(|&(_, b)| b == b'\n')
                .map(|(i, _)| i + 1),
        );
        LineIndex { starts }
    }

    /// The 1-based line of byte `offset` (past the end: the last line), without the column's
    /// count over the line.
    pub fn line(&self, offset: usize) -> usize {
        self.starts.partition_point(|&s| s <= offset).max(1)
    }

    /// What [`line_col`] returns, for the `src` this index was built from.
    pub fn line_col(&self, src: &str, offset: usize) -> (usize, usize) {
        let mut off = offset.min(src.len());
        while !src.is_char_boundary(off) {
            off -= 1;
        }
        // The last line starting at or before `off`.
        let line = self.starts.partition_point(|&s| s <= off);
        let line_start = self.starts[line - 1];
        let col = src[line_start..off].chars().count() + 1;
        (line, col)
    }
}

/// 1-based line and column (in characters) of a byte offset; offsets past the end, or inside
/// a UTF-8 sequence, are clamped to the nearest valid position. Scans `src` up to `offset`: for
/// many offsets of one source, build a [`LineIndex`] once.
pub fn line_col(src: &str, offset: usize) -> (usize, usize) {
    let mut off = offset.min(src.len());
    while !src.is_char_boundary(off) {
        off -= 1;
    }
    let before = &src[..off];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let col = src[line_start..off].chars().count() + 1;
    (line, col)
}

/// Where each part of the job came from: a dotted key path (`"train.micro_batch"`,
/// `"rollout.media"`, `"actor.text.heads"`, `"train.optimizer.lr"`) to the span of the value
/// that set it. Fields filled from a preset point at the preset (`gpu.hbm` -> `preset = H200`);
/// fields left at their default are absent, and [`SpanMap::get`] falls back to the nearest
/// parent (the section header, then the pipeline name).
///
/// Paths use the language's key names (see docs/language.md). For the compiler's convenience
/// the JobSpec field names are registered too where they differ: `cluster.gpu.hbm_bytes`,
/// `rollout.prompts_per_iter`, `rollout.group_size`, `schedule.memory_budget`, and so on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpanMap {
    map: BTreeMap<String, Span>,
}

impl SpanMap {
    pub fn new() -> SpanMap {
        SpanMap::default()
    }

    /// Records `path` (keeps the first span given for a path).
    pub fn insert(&mut self, path: &str, span: Span) {
        self.map.entry(path.to_string()).or_insert(span);
    }

    /// The span of `path`, else of its nearest recorded parent, else of the root.
    pub fn get(&self, path: &str) -> Option<Span> {
        let mut p = path;
        loop {
            if let Some(s) = self.map.get(p) {
                return Some(*s);
            }
            match p.rfind('.') {
                Some(i) => p = &p[..i],
                None if !p.is_empty() => p = "",
                None => return None,
            }
        }
    }

    /// The span of exactly `path`, without falling back.
    pub fn get_exact(&self, path: &str) -> Option<Span> {
        self.map.get(path).copied()
    }

    /// Every recorded path, sorted.
    pub fn iter(&self) -> impl Iterator<Item = (&str, Span)> {
        self.map.iter().map(|(k, v)| (k.as_str(), *v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_index_agrees_with_line_col() {
        for src in ["", "a", "ab\ncd", "\n\n", "é\nü x\n", "a\r\nb"] {
            let idx = LineIndex::new(src);
            for off in 0..src.len() + 3 {
                assert_eq!(
                    idx.line_col(src, off),
                    line_col(src, off),
                    "{src:?} at {off}"
                );
            }
        }
    }

    #[test]
    fn line_col_counts_chars_from_one() {
        let src = "ab\ncdé\nf";
        assert_eq!(line_col(src, 0), (1, 1));
        assert_eq!(line_col(src, 3), (2, 1));
        assert_eq!(line_col(src, 5), (2, 3));
        // inside the two-byte é: clamped back to its start
        assert_eq!(line_col(src, 6), (2, 3));
        assert_eq!(line_col(src, 8), (3, 1));
        assert_eq!(line_col(src, 100), (3, 2));
    }

    #[test]
    fn span_map_falls_back_to_parents() {
        let mut m = SpanMap::new();
        m.insert("", Span::new(0, 1));
        m.insert("train", Span::new(10, 15));
        m.insert("train.micro_batch", Span::new(20, 21));
        assert_eq!(m.get("train.micro_batch"), Some(Span::new(20, 21)));
        assert_eq!(m.get("train.optimizer.lr"), Some(Span::new(10, 15)));
        assert_eq!(m.get("rollout.media"), Some(Span::new(0, 1)));
        assert_eq!(m.get_exact("rollout"), None);
        assert_eq!(SpanMap::new().get("x"), None);
    }
}
