//! The binary and YAML forms of a [`Plan`].
//!
//! Binary layout (all integers little-endian):
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `RPLX` |
//! | 4..8 | format version (u32), [`FORMAT_VERSION`] |
//! | 8..12 | CRC-32 (IEEE) of every byte from offset 12 to the end |
//! | 12..14 | producer length P (u16) |
//! | 14..14+P | producer (UTF-8, e.g. `rollplexc 0.1.0`) |
//! | +8 | payload length N (u64) |
//! | +N | payload: the plan in postcard's wire format |
//!
//! The decoder checks, in order: length of the fixed header, magic, version, checksum,
//! producer, payload length (truncation and trailing bytes), then decodes the payload and
//! rejects bytes it leaves over. Every failure is a [`DecodeError`] with a message a user can
//! act on; the decoder never panics (tested on every single-byte corruption and on arbitrary
//! input).
//!
//! The YAML form is `serde_yaml` of the same structs: deterministic because every table is a
//! `Vec` in plan order and every struct serialises its fields in declaration order.

use crate::plan::Plan;
use thiserror::Error;

pub const MAGIC: [u8; 4] = *b"RPLX";
/// Version of the binary layout and payload schema. Bump on any change to the plan types.
pub const FORMAT_VERSION: u32 = 9;
const FIXED: usize = 14;

/// The header fields of a decoded plan file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub version: u32,
    pub producer: String,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("not a Rollplex plan: the file is {len} bytes, shorter than the {FIXED}-byte header")]
    TooShort { len: usize },
    #[error("not a Rollplex plan: the file starts with {found:?}, expected \"RPLX\"")]
    BadMagic { found: String },
    #[error("plan format v{found} is newer than this rollplex (v{ours}): rebuild rollplex or recompile the plan")]
    Newer { found: u32, ours: u32 },
    #[error("plan format v{found} is older than this rollplex (v{ours}): recompile the plan with this rollplexc")]
    Older { found: u32, ours: u32 },
    #[error(
        "plan is corrupted: checksum {computed:#010x} does not match the stored {stored:#010x}"
    )]
    Checksum { stored: u32, computed: u32 },
    #[error("plan is truncated: {what} needs {need} bytes, {have} are left")]
    Truncated {
        what: &'static str,
        need: u64,
        have: u64,
    },
    #[error("plan has {extra} unexpected bytes after the payload")]
    Trailing { extra: u64 },
    #[error("plan header is corrupted: the producer name is not UTF-8")]
    BadProducer,
    #[error("plan payload does not decode ({0}): the file was written by an incompatible producer or is corrupted")]
    Payload(String),
}

#[derive(Debug, Error)]
pub enum EncodeError {
    #[error("producer name is {0} bytes, longer than 65535")]
    ProducerTooLong(usize),
    #[error("cannot serialise the plan: {0}")]
    Serialize(String),
}

/// Encodes a plan; `producer` names the program and version that wrote it.
pub fn encode(plan: &Plan, producer: &str) -> Result<Vec<u8>, EncodeError> {
    let payload = postcard::to_allocvec(plan).map_err(|e| EncodeError::Serialize(e.to_string()))?;
    let plen =
        u16::try_from(producer.len()).map_err(|_| EncodeError::ProducerTooLong(producer.len()))?;
    let mut out = Vec::with_capacity(FIXED + producer.len() + 8 + payload.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&plen.to_le_bytes());
    out.extend_from_slice(producer.as_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&payload);
    let crc = crc32fast::hash(&out[12..]);
    out[8..12].copy_from_slice(&crc.to_le_bytes());
    Ok(out)
}

/// Reads and checks the header only (magic, version, checksum, producer, lengths).
pub fn decode_header(bytes: &[u8]) -> Result<(Header, &[u8]), DecodeError> {
    if bytes.len() < FIXED {
        // A short file that does not even start like a plan is foreign, not truncated.
        let n = bytes.len().min(4);
        if bytes[..n] != MAGIC[..n] {
            return Err(bad_magic(&bytes[..n]));
        }
        return Err(DecodeError::TooShort { len: bytes.len() });
    }
    if bytes[0..4] != MAGIC {
        return Err(bad_magic(&bytes[0..4]));
    }
    let version = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
    if version > FORMAT_VERSION {
        return Err(DecodeError::Newer {
            found: version,
            ours: FORMAT_VERSION,
        });
    }
    if version < FORMAT_VERSION {
        return Err(DecodeError::Older {
            found: version,
            ours: FORMAT_VERSION,
        });
    }
    let stored = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
    let plen = u16::from_le_bytes([bytes[12], bytes[13]]) as usize;
    let rest = &bytes[FIXED..];
    // Length fields are checked before the checksum so that a truncated file says so.
    if rest.len() < plen + 8 {
        return Err(DecodeError::Truncated {
            what: "the producer name and payload length",
            need: (plen + 8) as u64,
            have: rest.len() as u64,
        });
    }
    let producer = &rest[..plen];
    let mut n = [0u8; 8];
    n.copy_from_slice(&rest[plen..plen + 8]);
    let payload_len = u64::from_le_bytes(n);
    let payload = &rest[plen + 8..];
    let have = payload.len() as u64;
    if have < payload_len {
        return Err(DecodeError::Truncated {
            what: "the payload",
            need: payload_len,
            have,
        });
    }
    if have > payload_len {
        return Err(DecodeError::Trailing {
            extra: have - payload_len,
        });
    }
    let computed = crc32fast::hash(&bytes[12..]);
    if computed != stored {
        return Err(DecodeError::Checksum { stored, computed });
    }
    let producer = std::str::from_utf8(producer)
        .map_err(|_| DecodeError::BadProducer)?
        .to_string();
    Ok((Header { version, producer }, payload))
}

fn bad_magic(b: &[u8]) -> DecodeError {
    DecodeError::BadMagic {
        found: String::from_utf8_lossy(b).into_owned(),
    }
}

/// Decodes a plan file: header checks, then the payload.
pub fn decode(bytes: &[u8]) -> Result<(Header, Plan), DecodeError> {
    let (header, payload) = decode_header(bytes)?;
    let (plan, left) = postcard::take_from_bytes::<Plan>(payload)
        .map_err(|e| DecodeError::Payload(e.to_string()))?;
    if !left.is_empty() {
        return Err(DecodeError::Trailing {
            extra: left.len() as u64,
        });
    }
    Ok((header, plan))
}

/// The review form: deterministic YAML of the plan.
pub fn to_yaml(plan: &Plan) -> Result<String, String> {
    serde_yaml::to_string(plan).map_err(|e| format!("cannot write the plan as YAML: {e}"))
}

/// Reads the YAML form back (tests, review tools).
pub fn from_yaml(text: &str) -> Result<Plan, String> {
    serde_yaml::from_str(text).map_err(|e| format!("not a plan in YAML form: {e}"))
}
