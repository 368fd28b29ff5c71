//! Built-in rewards: `exact_match`, `choice_letter`, `numeric`.
//!
//! All three first cut the response down to its final answer ([`final_answer`]): reasoning in
//! `<think>...</think>` is dropped, then the content of the last `<answer>...</answer>` or
//! `\boxed{...}` (braces balanced) is used when there is one, else the whole response. The
//! `math` and `format` rewards, which read answers their own way, are [`super::math`] and
//! [`super::format`].
//!
//! Invariant: a reference answer the reward cannot read (a `choice_letter` answer without a
//! letter, a `numeric` answer without a number) is an error naming the sample, never a zero.

use std::sync::OnceLock;

use regex::Regex;

use super::math;

/// The letters `choice_letter` accepts.
pub const CHOICES: std::ops::RangeInclusive<char> = 'A'..='D';

fn re(cell: &'static OnceLock<Regex>, pat: &str) -> &'static Regex {
    cell.get_or_init(|| Regex::new(pat).expect("valid built-in regex"))
}

/// The part of `response` that holds the final answer (see the module doc).
pub fn final_answer(response: &str) -> &str {
    final_answer_tagged(response).0
}

/// [`final_answer`], and whether it came from an `<answer>` tag or `\boxed{}`.
fn final_answer_tagged(response: &str) -> (&str, bool) {
    // everything up to the last </think> is reasoning
    let s = math::after_think(response);
    if let Some(a) = math::last_tag(s, "answer") {
        return (a.trim(), true);
    }
    if let Some(b) = math::last_braced(s, &["\\boxed"]) {
        return (b.trim(), true);
    }
    (s.trim(), false)
}

fn normalise(s: &str) -> String {
    let s = s.trim().trim_end_matches(['.', '!']).trim();
    s.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .to_lowercase()
}

/// 1 when the final answer equals the reference, ignoring case, surrounding whitespace, runs of
/// whitespace and a trailing period; else 0.
pub fn exact_match(response: &str, answer: &str) -> f64 {
    (normalise(final_answer(response)) == normalise(final_answer(answer))) as u8 as f64
}

/// The options `A. left B. right ...` of a multiple-choice prompt, as (letter, text).
pub fn parse_options(prompt: &str) -> Vec<(char, String)> {
    static OPT: OnceLock<Regex> = OnceLock::new();
    let r = re(&OPT, r"(?:^|[\s(])([A-D])[.)]\s+");
    let heads: Vec<(char, usize, usize)> = r
        .captures_iter(prompt)
        .map(|c| {
            let l = c.get(1).expect("group 1");
            (
                l.as_str().chars().next().expect("one letter"),
                l.start(),
                c.get(0).expect("match").end(),
            )
        })
        .collect();
    let mut out = Vec::new();
    for (i, &(letter, _, text_start)) in heads.iter().enumerate() {
        let end = heads.get(i + 1).map_or(prompt.len(), |h| h.1);
        let text = prompt[text_start..end]
            .lines()
            .next()
            .unwrap_or("")
            .trim()
            .trim_end_matches(['.', ',', ';']);
        let text = text.trim_end_matches(" (").trim();
        if !text.is_empty() && !out.iter().any(|(l, _)| *l == letter) {
            out.push((letter, text.to_lowercase()));
        }
    }
    out
}

/// The chosen letter of a multiple-choice response, or `None` when none can be read.
///
/// In order: a tagged answer that starts with a letter (`<answer>B</answer>`, `\boxed{B}`);
/// the last `answer/option/choice [is|:] X`; the last `(X)`; an answer that starts with
/// `X.`, `X)`, `X:` or is just `X` (not `A square`); the one option whose text (from `prompt`'s `A. left ...`)
/// appears in the answer as whole words when exactly one does; a lone letter at the end.
pub fn extract_choice(response: &str, prompt: &str) -> Option<char> {
    static LEAD: OnceLock<Regex> = OnceLock::new();
    static LEAD_TAGGED: OnceLock<Regex> = OnceLock::new();
    static KEYWORD: OnceLock<Regex> = OnceLock::new();
    static PAREN: OnceLock<Regex> = OnceLock::new();
    static TAIL: OnceLock<Regex> = OnceLock::new();
    let (s, tagged) = final_answer_tagged(response);
    let first = |c: regex::Captures| {
        c.get(1)
            .and_then(|m| m.as_str().chars().next())
            .map(|c| c.to_ascii_uppercase())
    };
    // A tagged answer may be `B`, `(B)`, `B right`; untagged text must not read `A square` as A.
    let lead = if tagged {
        r"^[\(\[]?([A-D])(?:[\)\]]|[.:,]|\s|$)"
    } else {
        r"^[\(\[]?([A-D])(?:[\)\]]|[.:,]|\s*$)"
    };
    let lead_re = if tagged {
        re(&LEAD_TAGGED, lead)
    } else {
        re(&LEAD, lead)
    };
    if tagged {
        if let Some(c) = lead_re.captures(s) {
            return first(c);
        }
    }
    if let Some(c) =
        re(&KEYWORD, r"(?i:answer|option|choice)\s*(?:(?i:is)\s*)?[:=]?\s*(?:(?i:option)\s*)?[\(\[]?([A-D])(?:[\)\]]|[^A-Za-z]|$)")
            .captures_iter(s)
            .last()
    {
        return first(c);
    }
    if let Some(c) = re(&PAREN, r"\(([A-Da-d])\)").captures_iter(s).last() {
        return first(c);
    }
    if let Some(c) = lead_re.captures(s) {
        return first(c);
    }
    let words = format!(
        " {} ",
        normalise(s).replace(|c: char| !c.is_alphanumeric(), " ")
    );
    let hits: Vec<char> = parse_options(prompt)
        .into_iter()
        .filter(|(_, text)| {
            let t = text.replace(|c: char| !c.is_alphanumeric(), " ");
            let t = t.split_whitespace().collect::<Vec<_>>().join(" ");
            !t.is_empty() && words.contains(&format!(" {t} "))
        })
        .map(|(l, _)| l)
        .collect();
    if hits.len() == 1 {
        return Some(hits[0]);
    }
    re(&TAIL, r"(?:^|[^A-Za-z])([A-D])[.!]?\s*$")
        .captures(s)
        .and_then(first)
}

/// 1 when the response's chosen letter is the reference's. The reference may be `B`, `(B)`,
/// `B. right`, ...; one without a letter A-D is an error.
pub fn choice_letter(response: &str, answer: &str, prompt: &str) -> Result<f64, String> {
    let want = extract_choice(answer, "")
        .filter(|c| CHOICES.contains(c))
        .ok_or_else(|| format!("reference answer {answer:?} has no choice letter A-D"))?;
    Ok((extract_choice(response, prompt) == Some(want)) as u8 as f64)
}

/// The last number in the final answer: integers, decimals, scientific notation, thousands
/// separators (`1,234`), simple fractions (`3/4`).
pub fn extract_number(s: &str) -> Option<f64> {
    static NUM: OnceLock<Regex> = OnceLock::new();
    let r = re(
        &NUM,
        r"[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?(?:\s*/\s*(?:\d+\.?\d*|\.\d+))?",
    );
    let m = r.find_iter(final_answer(s)).last()?;
    let text: String = m
        .as_str()
        .chars()
        .filter(|c| *c != ',' && !c.is_whitespace())
        .collect();
    let v = match text.split_once('/') {
        Some((a, b)) => a.parse::<f64>().ok()? / b.parse::<f64>().ok()?,
        None => text.parse().ok()?,
    };
    v.is_finite().then_some(v)
}

/// 1 when the last number of the response is within `tolerance` (absolute) of the reference's.
pub fn numeric(response: &str, answer: &str, tolerance: f64) -> Result<f64, String> {
    if !(tolerance >= 0.0 && tolerance.is_finite()) {
        return Err(format!(
            "numeric tolerance must be finite and >= 0, got {tolerance}"
        ));
    }
    let want = extract_number(answer)
        .ok_or_else(|| format!("reference answer {answer:?} has no number"))?;
    Ok(extract_number(response).is_some_and(|got| (got - want).abs() <= tolerance) as u8 as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const Q: &str = "Which way did the red square move? A. left B. right C. up D. down";

    #[test]
    fn choice_letter_reads_common_answer_forms() {
        let cases = [
            ("B", Some('B')),
            ("B.", Some('B')),
            ("B. right", Some('B')),
            ("(C)", Some('C')),
            ("answer: D", Some('D')),
            ("Answer: (A)", Some('A')),
            ("The answer is C.", Some('C')),
            ("A square moved; so the answer is B", Some('B')),
            ("<answer>B</answer>", Some('B')),
            ("<think>maybe A? no.</think><answer> D </answer>", Some('D')),
            ("<think>The answer is A</think> so (C)", Some('C')),
            ("\\boxed{A}", Some('A')),
            ("I pick option (b)", Some('B')),
            ("It moved right.", Some('B')),
            ("It moved up", Some('C')),
            ("left or right?", None),
            ("I don't know", None),
            ("", None),
            ("The shape went down, final: D", Some('D')),
            ("Because of this, I choose E", None),
        ];
        for (resp, want) in cases {
            assert_eq!(extract_choice(resp, Q), want, "{resp:?}");
        }
    }

    #[test]
    fn choice_letter_scores_and_rejects_unreadable_references() {
        assert_eq!(choice_letter("The answer is B", "B", Q), Ok(1.0));
        assert_eq!(choice_letter("The answer is B", "(C)", Q), Ok(0.0));
        assert_eq!(choice_letter("garbage", "B", Q), Ok(0.0));
        assert!(choice_letter("B", "right", Q)
            .unwrap_err()
            .contains("no choice letter"));
    }

    #[test]
    fn options_are_parsed_from_one_line_and_multi_line_prompts() {
        assert_eq!(
            parse_options(Q),
            vec![
                ('A', "left".into()),
                ('B', "right".into()),
                ('C', "up".into()),
                ('D', "down".into())
            ]
        );
        let multi = "Pick one.\nA. the red one\nB. the blue one\n";
        assert_eq!(
            parse_options(multi),
            vec![('A', "the red one".into()), ('B', "the blue one".into())]
        );
    }

    #[test]
    fn exact_match_normalises_lightly() {
        assert_eq!(exact_match("  Paris. ", "paris"), 1.0);
        assert_eq!(exact_match("<answer>New  York</answer>", "new york"), 1.0);
        assert_eq!(exact_match("Paris, France", "Paris"), 0.0);
    }

    #[test]
    fn numeric_reads_the_last_number() {
        assert_eq!(extract_number("I count 3 then 4 shapes"), Some(4.0));
        assert_eq!(extract_number("total: 1,234.5"), Some(1234.5));
        assert_eq!(extract_number("-2.5e3"), Some(-2500.0));
        assert_eq!(extract_number("3/4"), Some(0.75));
        assert_eq!(extract_number("\\boxed{42} and 7 later"), Some(42.0));
        assert_eq!(extract_number("none"), None);
        assert_eq!(numeric("about 3.14", "3.14159", 0.01), Ok(1.0));
        assert_eq!(numeric("about 3.2", "3.14159", 0.01), Ok(0.0));
        assert_eq!(numeric("7", "7", 0.0), Ok(1.0));
        assert!(numeric("7", "seven", 0.0)
            .unwrap_err()
            .contains("no number"));
        assert!(numeric("7", "7", f64::NAN).is_err());
    }
}
