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
