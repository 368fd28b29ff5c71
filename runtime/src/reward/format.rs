//! The `format` built-in reward: is the response laid out as the prompt asked?
//!
//! 1 when the response is, after leading whitespace, `<think>` reasoning `</think>` (one pair,
//! reasoning not blank) and then its answer, either in `<answer>...</answer>` (one pair, not
//! blank, nothing after it) or in a `\boxed{...}` (braces balanced, not blank); else 0. The tag
//! names are parameters (`think`, `answer`); an empty `think` asks for no reasoning block.
//!
//! Invariant: a pure function of (response, tag names); it does not look at the answer's
//! correctness (that is `math`'s or `exact_match`'s job, weighed beside it in a `sum`).

use super::math::last_braced;

/// 1 when `response` has the layout of the module doc with tags `think` and `answer`.
pub fn format(response: &str, think: &str, answer: &str) -> f64 {
    well_formed(response, think, answer) as u8 as f64
}

fn well_formed(response: &str, think: &str, answer: &str) -> bool {
    let mut rest = response.trim_start();
    if !think.is_empty() {
        let (open, close) = (format!("<{think}>"), format!("</{think}>"));
        let Some(body) = rest.strip_prefix(open.as_str()) else {
            return false;
        };
        if body.contains(open.as_str()) || rest.matches(close.as_str()).count() != 1 {
            return false;
        }
        let Some((reasoning, after)) = body.split_once(close.as_str()) else {
            return false;
        };
        if reasoning.trim().is_empty() {
            return false;
        }
        rest = after;
    }
    if !answer.is_empty() {
        let (open, close) = (format!("<{answer}>"), format!("</{answer}>"));
        if rest.contains(open.as_str()) || rest.contains(close.as_str()) {
            if rest.matches(open.as_str()).count() != 1 || rest.matches(close.as_str()).count() != 1
            {
                return false;
            }
            let Some((_, inside)) = rest.split_once(open.as_str()) else {
                return false;
            };
            return match inside.split_once(close.as_str()) {
                Some((content, tail)) => !content.trim().is_empty() && tail.trim().is_empty(),
                None => false,
            };
        }
    }
    last_braced(rest, &["\\boxed"]).is_some_and(|b| !b.trim().is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rollplex_plan::spec::{
        FORMAT_ANSWER_TAG as DEFAULT_ANSWER, FORMAT_THINK_TAG as DEFAULT_THINK,
    };

    #[test]
    fn layouts() {
        let (t, a) = (DEFAULT_THINK, DEFAULT_ANSWER);
        let cases = [
            ("<think>add them</think><answer>5</answer>", true),
            ("  <think>add\nthem</think>\n<answer> 5 </answer>\n", true),
            ("<think>add them</think> so the sum is \\boxed{5}.", true),
            ("<think>a</think>\\boxed{\\frac{1}{2}}", true),
            ("<think>add them</think>5", false),
            ("<answer>5</answer>", false),
            ("<think> </think><answer>5</answer>", false),
            ("<think>a</think><answer> </answer>", false),
            ("<think>a</think><answer>5</answer> and more", false),
            (
                "<think>a</think><answer>5</answer><answer>6</answer>",
                false,
            ),
            ("<think>a<think>b</think><answer>5</answer>", false),
            ("<think>a</think></think><answer>5</answer>", false),
            ("<think>a</think><answer>5", false),
            ("<think>a</think>\\boxed{5", false),
            ("<think>a</think>\\boxed{}", false),
            ("text <think>a</think><answer>5</answer>", false),
            ("<think>a</think><answer>5</answer>\\boxed{5}", false),
            ("", false),
        ];
        for (resp, want) in cases {
            assert_eq!(format(resp, t, a), want as u8 as f64, "{resp:?}");
        }
    }

    #[test]
    fn tags_are_parameters() {
        assert_eq!(
            format("<reason>r</reason><final>B</final>", "reason", "final"),
            1.0
        );
        assert_eq!(
            format("<think>r</think><answer>B</answer>", "reason", "final"),
            0.0
        );
        assert_eq!(format("The answer is \\boxed{3}", "", DEFAULT_ANSWER), 1.0);
        assert_eq!(format("<answer>3</answer>", "", DEFAULT_ANSWER), 1.0);
        assert_eq!(format("<think>r</think>\\boxed{3}", DEFAULT_THINK, ""), 1.0);
        assert_eq!(
            format("<think>r</think><answer>3</answer>", DEFAULT_THINK, ""),
            0.0
        );
    }
}
