//! Literals with units: sizes (`141GiB`, `80GB`), bandwidths (`4.8TB/s`), compute rates
//! (`989TFLOPS`), durations (`30s`, `500ms`); and plain number literals (`1_000`, `1e-6`).
//!
//! Invariant: every quantity is stored in base units — bytes, bytes/s, FLOP/s, seconds — as
//! an `f64`. Decimal prefixes are powers of 1000 (`GB` = 1e9 bytes), binary ones powers of 1024
//! (`GiB` = 2^30 bytes), as on datasheets.

use std::fmt;

/// What a quantity measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dim {
    Bytes,
    Bandwidth,
    FlopRate,
    Duration,
}

impl Dim {
    /// "a size", "a bandwidth", ... for messages.
    pub fn noun(self) -> &'static str {
        match self {
            Dim::Bytes => "a size",
            Dim::Bandwidth => "a bandwidth",
            Dim::FlopRate => "a compute rate",
            Dim::Duration => "a duration",
        }
    }

    /// Example literal for help texts.
    pub fn example(self) -> &'static str {
        match self {
            Dim::Bytes => "80GiB",
            Dim::Bandwidth => "3.35TB/s",
            Dim::FlopRate => "989TFLOPS",
            Dim::Duration => "30s",
        }
    }
}

const KI: f64 = 1024.0;

/// Every unit the language knows: (spelling, dimension, factor to the base unit).
pub const UNITS: &[(&str, Dim, f64)] = &[
    ("B", Dim::Bytes, 1.0),
    ("KB", Dim::Bytes, 1e3),
    ("MB", Dim::Bytes, 1e6),
    ("GB", Dim::Bytes, 1e9),
    ("TB", Dim::Bytes, 1e12),
    ("KiB", Dim::Bytes, KI),
    ("MiB", Dim::Bytes, KI * KI),
    ("GiB", Dim::Bytes, KI * KI * KI),
    ("TiB", Dim::Bytes, KI * KI * KI * KI),
    ("B/s", Dim::Bandwidth, 1.0),
    ("KB/s", Dim::Bandwidth, 1e3),
    ("MB/s", Dim::Bandwidth, 1e6),
    ("GB/s", Dim::Bandwidth, 1e9),
    ("TB/s", Dim::Bandwidth, 1e12),
    ("KiB/s", Dim::Bandwidth, KI),
    ("MiB/s", Dim::Bandwidth, KI * KI),
    ("GiB/s", Dim::Bandwidth, KI * KI * KI),
    ("TiB/s", Dim::Bandwidth, KI * KI * KI * KI),
    ("FLOPS", Dim::FlopRate, 1.0),
    ("GFLOPS", Dim::FlopRate, 1e9),
    ("TFLOPS", Dim::FlopRate, 1e12),
    ("PFLOPS", Dim::FlopRate, 1e15),
    ("us", Dim::Duration, 1e-6),
    ("ms", Dim::Duration, 1e-3),
    ("s", Dim::Duration, 1.0),
    ("min", Dim::Duration, 60.0),
    ("h", Dim::Duration, 3600.0),
];

/// The dimension and factor of a unit spelling (case-sensitive: `Gb` is not `GB`).
pub fn unit(spelling: &str) -> Option<(Dim, f64)> {
    UNITS
        .iter()
        .find(|(s, _, _)| *s == spelling)
        .map(|&(_, d, f)| (d, f))
}

/// All unit spellings, for "did you mean".
pub fn unit_names() -> Vec<&'static str> {
    UNITS.iter().map(|(s, _, _)| *s).collect()
}

/// A plain number literal: an integer unless it has a `.` or an exponent.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Number {
    Int(i64),
    Float(f64),
}

impl Number {
    pub fn as_f64(self) -> f64 {
        match self {
            Number::Int(i) => i as f64,
            Number::Float(f) => f,
        }
    }
}

impl fmt::Display for Number {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Number::Int(i) => write!(f, "{i}"),
            Number::Float(x) => write!(f, "{x}"),
        }
    }
}

/// Parses `12`, `1_000`, `0.5`, `1e-6`, `2.5E3`. Integers must fit in i64.
pub fn parse_number(text: &str) -> Result<Number, String> {
    let clean: String = text.chars().filter(|&c| c != '_').collect();
    if clean.is_empty() {
        return Err("empty number".into());
    }
    if clean.contains(['.', 'e', 'E']) {
        let x: f64 = clean
            .parse()
            .map_err(|_| format!("`{text}` is not a number"))?;
        if !x.is_finite() {
            return Err(format!("`{text}` is too large"));
        }
        Ok(Number::Float(x))
    } else {
        clean
            .parse::<i64>()
            .map(Number::Int)
            .map_err(|_| format!("`{text}` is too large (integers go up to {})", i64::MAX))
    }
}

/// Splits a quantity literal (`4.8TB/s`) into its number and its unit spelling.
pub fn split_quantity(text: &str) -> (&str, &str) {
    let mut cut = text.len();
    for (i, c) in text.char_indices() {
        if c.is_ascii_digit() || c == '.' || c == '_' {
            continue;
        }
        // an exponent belongs to the number when a digit (or sign + digit) follows it
        if c == 'e' || c == 'E' {
            let rest = &text[i + 1..];
            let rest = rest.strip_prefix(['+', '-']).unwrap_or(rest);
            if rest.starts_with(|d: char| d.is_ascii_digit()) {
                continue;
            }
        }
        if (c == '+' || c == '-') && i > 0 && matches!(&text[i - 1..i], "e" | "E") {
            continue;
        }
        cut = i;
        break;
    }
    (&text[..cut], &text[cut..])
}

/// Parses a whole quantity literal into base units.
pub fn parse_quantity(text: &str) -> Result<(f64, Dim), String> {
    let (num, u) = split_quantity(text);
    let n = parse_number(num)?;
    let (dim, factor) = unit(u).ok_or_else(|| format!("unknown unit `{u}`"))?;
    Ok((n.as_f64() * factor, dim))
}

/// Bytes as GiB with one decimal ("12.3 GiB").
pub fn gib(bytes: f64) -> String {
    format!("{:.1} GiB", bytes / (KI * KI * KI))
}

/// A quantity in a readable unit of its dimension, for messages.
pub fn show(value: f64, dim: Dim) -> String {
    match dim {
        Dim::Bytes => gib(value),
        Dim::Bandwidth => format!("{} GB/s", trim(value / 1e9)),
        Dim::FlopRate => format!("{} TFLOPS", trim(value / 1e12)),
        Dim::Duration => format!("{} s", trim(value)),
    }
}

fn trim(x: f64) -> String {
    let s = format!("{x:.3}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    s.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers() {
        assert_eq!(parse_number("12"), Ok(Number::Int(12)));
        assert_eq!(parse_number("1_000"), Ok(Number::Int(1000)));
        assert_eq!(parse_number("0.5"), Ok(Number::Float(0.5)));
        assert_eq!(parse_number("1e-6"), Ok(Number::Float(1e-6)));
        assert_eq!(parse_number("2.5E3"), Ok(Number::Float(2500.0)));
        assert!(parse_number("99999999999999999999")
            .unwrap_err()
            .contains("too large"));
        assert!(parse_number("1e999").unwrap_err().contains("too large"));
    }

    #[test]
    fn sizes_are_decimal_or_binary() {
        assert_eq!(
            parse_quantity("141GiB"),
            Ok((141.0 * 1073741824.0, Dim::Bytes))
        );
        assert_eq!(parse_quantity("80GB"), Ok((80e9, Dim::Bytes)));
        assert_eq!(
            parse_quantity("143771MiB"),
            Ok((143771.0 * 1048576.0, Dim::Bytes))
        );
        assert_eq!(parse_quantity("512B"), Ok((512.0, Dim::Bytes)));
    }

    #[test]
    fn bandwidths_rates_durations() {
        let (bw, d) = parse_quantity("4.8TB/s").unwrap();
        assert_eq!(d, Dim::Bandwidth);
        assert!((bw - 4.8e12).abs() < 1.0);
        assert_eq!(parse_quantity("400GB/s"), Ok((400e9, Dim::Bandwidth)));
        assert_eq!(parse_quantity("989TFLOPS"), Ok((989e12, Dim::FlopRate)));
        assert_eq!(parse_quantity("30s"), Ok((30.0, Dim::Duration)));
        assert_eq!(parse_quantity("500ms"), Ok((0.5, Dim::Duration)));
        assert_eq!(parse_quantity("2min"), Ok((120.0, Dim::Duration)));
        assert_eq!(parse_quantity("1e3GB"), Ok((1e12, Dim::Bytes)));
    }

    #[test]
    fn unknown_units_are_errors() {
        assert_eq!(
            parse_quantity("80Gib"),
            Err("unknown unit `Gib`".to_string())
        );
        assert_eq!(split_quantity("4.8TB/s"), ("4.8", "TB/s"));
        assert_eq!(split_quantity("2e5s"), ("2e5", "s"));
        assert_eq!(split_quantity("2em"), ("2", "em"));
    }

    #[test]
    fn shows_readable_values() {
        assert_eq!(gib(12.34 * 1073741824.0), "12.3 GiB");
        assert_eq!(show(4.8e12, Dim::Bandwidth), "4800 GB/s");
        assert_eq!(show(0.5, Dim::Duration), "0.5 s");
    }
}
