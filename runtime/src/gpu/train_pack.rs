//! Host-side tables of the CUDA training step with kept prompt prefixes (pure: tested without a
//! GPU). The trainer ([`super::train`]) runs the prompt of a GRPO group once per *copy* (one
//! copy with prefix dedup, one per sample without) and keeps, for every copy, each layer's input
//! and K/V in one iteration-wide store; a micro-batch then runs only the response suffixes,
//! attending to the kept prefix K/V, and backpropagates into the prefix rows.
//!
//! - [`layout_prefixes`]: where each group's copies lie in the store (rows, units).
//! - [`SuffixPack`]: a micro-batch's packed suffix rows (`tokens[..n-1]` of each response, at
//!   positions `P + j + rope_delta` as `score` gives them), their attention descriptors into the
//!   store's rows `lo..hi`, and the head rows scoring every response token: token `j >= 1` from
//!   suffix row `j - 1`, token 0 from its copy's last prompt row (kept by the prefix forward and
//!   placed after the suffix rows, one row per response, so a scatter of their gradients never
//!   writes one row twice).
//!
//! Invariant: everything here is a function of the prompts' lengths, the copies and the
//! responses' tokens; nothing depends on which micro-batch or task a group lands in.

use rollplex_kernels::cpu::AttnSeq;

use super::plan::{check_ids, flat_rope_tables};
use super::GpuError;
use crate::model::ModelConfig;

/// Where one group's prompt copies lie in the prefix store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixLayout {
    /// First store row of copy 0; copy `c` starts at `row0 + c * len`.
    pub row0: usize,
    /// Prompt tokens.
    pub len: usize,
    /// Forwards of the prompt kept: 1 (shared by the group's samples) or one per sample.
    pub copies: usize,
    /// Unit (one per copy: its kept last row) of copy 0.
    pub unit0: usize,
}

impl PrefixLayout {
    /// Store rows of every copy.
    pub fn rows(&self) -> usize {
        self.copies * self.len
    }
    /// The copy response `r` of the group attends to.
    pub fn copy_of(&self, r: usize) -> usize {
        if self.copies > 1 {
            r
        } else {
            0
        }
    }
}

/// The store layout of groups given as `(prompt tokens, copies)`, in group order: rows and units
/// one after the other. Returns the layouts, total rows and total units.
pub fn layout_prefixes(
    groups: &[(usize, u32)],
) -> Result<(Vec<PrefixLayout>, usize, usize), GpuError> {
    let (mut row, mut unit) = (0usize, 0usize);
    let mut out = Vec::with_capacity(groups.len());
    for (g, &(len, copies)) in groups.iter().enumerate() {
        if len == 0 || copies == 0 {
            return Err(GpuError::Input(format!(
                "group {g}: a kept prefix needs a prompt of at least one token and one copy \
                 ({len} tokens, {copies} copies)"
            )));
        }
        let copies = copies as usize;
        out.push(PrefixLayout {
            row0: row,
            len,
            copies,
            unit0: unit,
        });
        row += len * copies;
        unit += copies;
    }
    Ok((out, row, unit))
}

/// One group of a micro-batch: its store layout, its prompt's `rope_delta`, its responses.
pub struct PackGroup<'a> {
    pub layout: PrefixLayout,
    pub rope_delta: i64,
    pub responses: Vec<&'a [u32]>,
}

/// Which kept last prompt row a token-0 head row copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FirstToken {
    /// Group of the micro-batch (index into its groups) and copy.
    pub group: usize,
    pub copy: usize,
    /// Store unit (`layout.unit0 + copy`).
    pub unit: usize,
}

/// A micro-batch's packed suffix rows and head rows (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct SuffixPack {
    /// Token ids of the suffix rows.
    pub ids: Vec<u32>,
    /// M-RoPE tables `[suffix rows, head_dim]`.
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
    /// One descriptor per response of at least two tokens: its suffix rows and its copy's
    /// prefix rows, counted from `lo`.
    pub seqs: Vec<AttnSeq>,
    /// Store rows `lo..hi` cover every copy the micro-batch's groups own.
    pub lo: usize,
    pub hi: usize,
    /// Rows of the final hidden buffer `[suffix rows ++ one row per first token]` whose logits
    /// score each response token, response by response, token by token.
    pub head_rows: Vec<u32>,
    pub targets: Vec<u32>,
    /// The token-0 rows, in order: row `ids.len() + i` copies `first[i]`'s kept last row.
    pub first: Vec<FirstToken>,
    /// Per group, per response: its first entry in `head_rows` (`None`: an empty response).
    pub starts: Vec<Vec<Option<usize>>>,
}

impl SuffixPack {
    pub fn new(cfg: &ModelConfig, groups: &[PackGroup<'_>]) -> Result<Self, GpuError> {
        let vocab = cfg.text().vocab_size as usize;
        let lo = groups.iter().map(|g| g.layout.row0).min().unwrap_or(0);
        let hi = groups
            .iter()
            .map(|g| g.layout.row0 + g.layout.rows())
            .max()
            .unwrap_or(0);
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut seqs = Vec::new();
        // pass 1: suffix rows
        for (gi, g) in groups.iter().enumerate() {
            let l = g.layout;
            if l.copies > 1 && g.responses.len() != l.copies {
                return Err(GpuError::Input(format!(
                    "group {gi} kept {} prompt copies for {} responses (one per response, or one \
                     shared)",
                    l.copies,
                    g.responses.len()
                )));
            }
            for (r, toks) in g.responses.iter().enumerate() {
                check_ids("train response", toks, vocab)?;
                let n = toks.len();
                if n < 2 {
                    continue;
                }
                let pstart = l.row0 + l.copy_of(r) * l.len - lo;
                seqs.push(AttnSeq {
                    start: ids.len() as u32,
                    len: (n - 1) as u32,
                    prefix_start: pstart as u32,
                    prefix_len: l.len as u32,
                });
                ids.extend_from_slice(&toks[..n - 1]);
                positions.extend((0..n - 1).map(|j| (l.len + j) as i64 + g.rope_delta));
            }
        }
        let rows = ids.len();
        // pass 2: head rows in response order
        let mut head_rows = Vec::new();
        let mut targets = Vec::new();
        let mut first = Vec::new();
        let mut starts = Vec::with_capacity(groups.len());
        let mut suffix = 0usize;
        for (gi, g) in groups.iter().enumerate() {
            let mut st = Vec::with_capacity(g.responses.len());
            for (r, toks) in g.responses.iter().enumerate() {
                let n = toks.len();
                if n == 0 {
                    st.push(None);
                    continue;
                }
                st.push(Some(head_rows.len()));
                let copy = g.layout.copy_of(r);
                head_rows.push((rows + first.len()) as u32);
                first.push(FirstToken {
                    group: gi,
                    copy,
                    unit: g.layout.unit0 + copy,
                });
                targets.push(toks[0]);
                for (j, &t) in toks.iter().enumerate().skip(1) {
                    head_rows.push((suffix + j - 1) as u32);
                    targets.push(t);
                }
                suffix += n - 1;
            }
            starts.push(st);
        }
        let (cos, sin) = flat_rope_tables(cfg, &positions);
        Ok(SuffixPack {
            ids,
            cos,
            sin,
            seqs,
            lo,
            hi,
            head_rows,
            targets,
            first,
            starts,
        })
    }

    /// Suffix rows (the rows the decoder layers run over).
    pub fn rows(&self) -> usize {
        self.ids.len()
    }

    /// Per copy of group `gi`: the token-0 rows (of the final hidden buffer) whose gradients
    /// reach that copy's last prompt row, in response order.
    pub fn first_rows_of(&self, gi: usize, copies: usize) -> Vec<Vec<u32>> {
        let mut out = vec![Vec::new(); copies];
        for (i, f) in self.first.iter().enumerate() {
            if f.group == gi {
                out[f.copy].push((self.rows() + i) as u32);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ModelConfig {
        ModelConfig::from_spec(crate::model::tests::tiny_spec(false)).unwrap()
    }

    #[test]
    fn prefixes_lie_one_after_the_other() {
        let (l, rows, units) = layout_prefixes(&[(5, 1), (3, 2), (4, 1)]).unwrap();
        assert_eq!((rows, units), (5 + 6 + 4, 4));
        assert_eq!(
            l[1],
            PrefixLayout {
                row0: 5,
                len: 3,
                copies: 2,
                unit0: 1
            }
        );
        assert_eq!((l[2].row0, l[2].unit0), (11, 3));
        assert_eq!((l[1].copy_of(1), l[0].copy_of(3)), (1, 0));
        assert!(layout_prefixes(&[(0, 1)]).is_err());
        assert!(layout_prefixes(&[(3, 0)]).is_err());
    }

    #[test]
    fn suffixes_attend_to_their_copy_and_token_zero_comes_from_the_prompt() {
        let cfg = cfg();
        let (l, _, _) = layout_prefixes(&[(5, 1), (3, 2), (4, 1)]).unwrap();
        let (a, b, c, d) = (vec![7u32, 8, 9], vec![4u32], vec![1u32, 2], vec![]);
        let groups = [
            // group 2 of the store (row 11), shared prefix
            PackGroup {
                layout: l[2],
                rope_delta: -2,
                responses: vec![&a, &b],
            },
            // group 1 (row 5), a copy per response
            PackGroup {
                layout: l[1],
                rope_delta: 0,
                responses: vec![&c, &d],
            },
        ];
        let p = SuffixPack::new(&cfg, &groups).unwrap();
        // rows lo..hi cover both groups' copies: 5..15
        assert_eq!((p.lo, p.hi), (5, 15));
        // suffix rows: a[..2] and c[..1]; b has one token, d none
        assert_eq!(p.ids, [7, 8, 1]);
        assert_eq!(
            p.seqs,
            [
                AttnSeq {
                    start: 0,
                    len: 2,
                    prefix_start: 6,
                    prefix_len: 4
                },
                // response 0 of group 1 reads copy 0: row 5 - lo
                AttnSeq {
                    start: 2,
                    len: 1,
                    prefix_start: 0,
                    prefix_len: 3
                },
            ]
        );
        // head rows: a -> [first0, 0, 1]; b -> [first1]; c -> [first2, 2]
        assert_eq!(p.head_rows, [3, 0, 1, 4, 5, 2]);
        assert_eq!(p.targets, [7, 8, 9, 4, 1, 2]);
        assert_eq!(
            p.first.iter().map(|f| f.unit).collect::<Vec<_>>(),
            [3, 3, 1]
        );
        assert_eq!(p.starts, [vec![Some(0), Some(3)], vec![Some(4), None]]);
        assert_eq!(p.first_rows_of(0, 1), [vec![3, 4]]);
        assert_eq!(p.first_rows_of(1, 2), [vec![5], vec![]]);
        // positions continue the prompt: P + j + rope_delta
        let hd = cfg.text().head_dim() as usize;
        let (c0, _) = flat_rope_tables(&cfg, &[4 + 1 - 2]);
        assert_eq!(&p.cos[hd..2 * hd], &c0[..]);
        let (c2, _) = flat_rope_tables(&cfg, &[3]);
        assert_eq!(&p.cos[2 * hd..3 * hd], &c2[..]);
        // a copy per response needs as many responses as copies
        let bad = [PackGroup {
            layout: l[1],
            rope_delta: 0,
            responses: vec![&c],
        }];
        assert!(SuffixPack::new(&cfg, &bad).is_err());
        // token ids are checked
        let big = vec![1u32 << 30];
        let bad = [PackGroup {
            layout: l[0],
            rope_delta: 0,
            responses: vec![&big],
        }];
        assert!(SuffixPack::new(&cfg, &bad).is_err());
    }
}
