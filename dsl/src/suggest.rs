//! "Did you mean": the closest known word to a misspelt one.

/// Edit distance (insertions, deletions, substitutions, adjacent transpositions).
pub fn distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let (n, m) = (a.len(), b.len());
    let mut d = vec![vec![0usize; m + 1]; n + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=n {
        for j in 1..=m {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut v = (d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1)
                .min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                v = v.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = v;
        }
    }
    d[n][m]
}

/// The candidate closest to `word`, if it is close enough to be a likely typo: equal ignoring
/// case, or within a third of the word's length (at least 1) edits. Ties go to the first.
pub fn closest<'a, I>(word: &str, candidates: I) -> Option<&'a str>
where
    I: IntoIterator<Item = &'a str>,
{
    let lower = word.to_ascii_lowercase();
    let limit = (word.chars().count() / 3).max(1);
    let mut best: Option<(usize, &'a str)> = None;
    for c in candidates {
        if c == word {
            continue;
        }
        let dist = if c.to_ascii_lowercase() == lower {
            0
        } else {
            distance(word, c)
        };
        if dist <= limit && best.is_none_or(|(b, _)| dist < b) {
            best = Some((dist, c));
        }
    }
    best.map(|(_, c)| c)
}

/// "did you mean `x`?" or, failing that, "expected one of: a, b, c".
pub fn help_for(word: &str, candidates: &[&str]) -> String {
    match closest(word, candidates.iter().copied()) {
        Some(c) => format!("did you mean `{c}`?"),
        None => format!("expected one of: {}", candidates.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distances() {
        assert_eq!(distance("micro_bach", "micro_batch"), 1);
        assert_eq!(distance("ab", "ba"), 1);
        assert_eq!(distance("", "abc"), 3);
        assert_eq!(distance("kitten", "sitting"), 3);
    }

    #[test]
    fn closest_picks_typos_only() {
        let keys = ["micro_batch", "mini_batch", "epochs", "tp"];
        assert_eq!(closest("micro_bach", keys), Some("micro_batch"));
        assert_eq!(closest("epoch", keys), Some("epochs"));
        assert_eq!(closest("TP", keys), Some("tp"));
        assert_eq!(closest("learning_rate", keys), None);
        assert_eq!(help_for("zzz", &["a", "b"]), "expected one of: a, b");
        assert_eq!(
            help_for("serail", &["serial", "overlap"]),
            "did you mean `serial`?"
        );
    }
}
