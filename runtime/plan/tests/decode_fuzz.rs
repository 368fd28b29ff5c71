//! The decoder never panics: arbitrary bytes, and arbitrary bytes behind a valid header.
use proptest::prelude::*;
use rollplex_plan::codec::{decode, DecodeError, FORMAT_VERSION, MAGIC};

/// A header whose lengths and checksum are right for `payload`, so the bytes reach postcard.
fn framed(payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&4u16.to_le_bytes());
    out.extend_from_slice(b"fuzz");
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(payload);
    let crc = crc32fast::hash(&out[12..]);
    out[8..12].copy_from_slice(&crc.to_le_bytes());
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        prop_assert!(decode(&bytes).is_err());
    }

    #[test]
    fn arbitrary_payload_behind_a_valid_header_never_panics(payload in proptest::collection::vec(any::<u8>(), 0..2048)) {
        match decode(&framed(&payload)) {
            Err(DecodeError::Payload(_)) | Err(DecodeError::Trailing { .. }) => {}
            Err(e) => prop_assert!(false, "unexpected error {e}"),
            // A random payload that is a whole plan is astronomically unlikely; accept it.
            Ok(_) => {}
        }
    }
}

#[test]
fn foreign_and_future_files_say_so() {
    assert!(matches!(
        decode(b"PK\x03\x04 a zip file, not a plan"),
        Err(DecodeError::BadMagic { .. })
    ));
    assert!(matches!(decode(b"RPL"), Err(DecodeError::TooShort { .. })));
    let mut f = framed(b"");
    f[4..8].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
    let e = decode(&f).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("plan format v{} is newer than this rollplex (v{}): rebuild rollplex or recompile the plan", FORMAT_VERSION + 1, FORMAT_VERSION)
    );
    let mut f = framed(b"xyz");
    let n = f.len();
    f.truncate(n - 1);
    assert!(matches!(decode(&f), Err(DecodeError::Truncated { .. })));
    let mut f = framed(b"xyz");
    f.push(0);
    assert!(matches!(decode(&f), Err(DecodeError::Trailing { .. })));
}

/// The checked-in plan of the tiny example, in both forms.
fn tiny_plan() -> (String, Vec<u8>) {
    let yaml = include_str!("../../../examples/tiny.plan.yaml").to_string();
    let plan = rollplex_plan::from_yaml(&yaml).expect("the checked-in plan reads");
    let bytes = rollplex_plan::encode(&plan, "fuzz").expect("encodes");
    (yaml, bytes)
}

/// Header bytes before the payload of a plan encoded with producer `fuzz`.
const HEADER: usize = 4 + 4 + 4 + 2 + 4 + 8;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// A real plan's payload with a few bytes changed, behind a header whose checksum fits, so
    /// every change reaches the decoder and, when it still decodes, the verifier.
    #[test]
    fn a_mutated_compiled_plan_never_panics(edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..4)) {
        let (_, bytes) = tiny_plan();
        let mut payload = bytes[HEADER..].to_vec();
        for (at, b) in edits {
            let i = at % payload.len();
            payload[i] = b;
        }
        if let Ok((_, plan)) = decode(&framed(&payload)) {
            let _ = rollplex_plan::validate(&plan);
        }
        // Without the checksum fixed up, any change is refused.
        let mut raw = bytes.clone();
        let i = HEADER + payload.len() / 2;
        raw[i] ^= 0x5a;
        prop_assert!(decode(&raw).is_err());
    }

    /// A plan's YAML with a few bytes changed reads as an error or as a plan the verifier judges
    /// without panicking.
    #[test]
    fn a_mutated_yaml_plan_never_panics(edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..4)) {
        let (yaml, _) = tiny_plan();
        let mut b = yaml.into_bytes();
        for (at, v) in edits {
            let i = at % b.len();
            b[i] = b"0123456789-:x \n[]{}"[v as usize % 19];
        }
        if let Ok(plan) = rollplex_plan::from_yaml(&String::from_utf8_lossy(&b)) {
            let _ = rollplex_plan::validate(&plan);
        }
    }
}
