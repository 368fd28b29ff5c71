//! The bounded window pest parses a statement head in: the head is scanned by hand first, so
//! a failed match costs the head, not a pass over the rest of the file.

use super::Driver;

/// The parts of a statement head, for [`Driver::head_window`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Head {
    Ident,
    OptIdent,
    Eq,
    Open,
}

impl Driver<'_> {
    /// How much text pest needs to match (or fail) a statement head of `shape` at `p`: the
    /// head is scanned by hand, as the grammar reads it (identifiers, `=`, `{`, whitespace and
    /// comments between; the scan accepts a little more than the grammar, never less), and the
    /// window ends just after its `{`, or a few characters past where the scan stopped, which
    /// covers every token pest tries there. Pest's result on the window is its result on the
    /// rest of the file, but a failed match no longer costs a pass over that rest (pest locates
    /// its error by scanning its input), which made a file of n statements cost O(n^2).
    pub(super) fn head_window(&self, p: usize, shape: &[Head]) -> usize {
        let b = self.src.as_bytes();
        let stop = |i: usize| {
            let mut end = (i + 16).min(b.len());
            while !self.src.is_char_boundary(end) {
                end += 1;
            }
            end
        };
        let ident_end = |mut i: usize| {
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            i
        };
        let mut i = p;
        for (k, part) in shape.iter().enumerate() {
            if k > 0 {
                i = match self.trivia_end(i) {
                    Some(i) => i,
                    None => return b.len(),
                };
            }
            match part {
                Head::Ident | Head::OptIdent => {
                    let j = ident_end(i);
                    if j == i && *part == Head::Ident {
                        return stop(i);
                    }
                    i = j;
                }
                Head::Eq if b.get(i) == Some(&b'=') => i += 1,
                Head::Open if b.get(i) == Some(&b'{') => return i + 1,
                Head::Eq | Head::Open => return stop(i),
            }
        }
        stop(i)
    }

    /// The end of the whitespace and comments at `p`, without reporting anything; `None` for a
    /// block comment that is never closed.
    fn trivia_end(&self, mut p: usize) -> Option<usize> {
        let b = self.src.as_bytes();
        loop {
            while p < b.len() && matches!(b[p], b' ' | b'\t' | b'\r' | b'\n') {
                p += 1;
            }
            let rest = &b[p.min(b.len())..];
            if rest.starts_with(b"//") {
                p = self.line_end(p);
            } else if rest.starts_with(b"/*") {
                p = p + 2 + self.src[p + 2..].find("*/")? + 2;
            } else {
                return Some(p);
            }
        }
    }
}
