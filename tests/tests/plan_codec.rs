//! The binary plan format on real plans: round trips, and every single-byte corruption and
//! every truncation of an encoded plan is rejected with an error, never a panic or a plan.
use rollplex_compiler::fixtures::{job, paper_job, QwenSize};
use rollplex_compiler::{compile, Options};
use rollplex_plan::codec::{decode, encode, from_yaml, to_yaml, DecodeError, FORMAT_VERSION};
use rollplex_plan::spec::Mode;
use rollplex_plan::{validate, Plan};

fn plan(spec: &rollplex_plan::spec::JobSpec, mode: Mode) -> Plan {
    compile(
        spec,
        &Options {
            mode: Some(mode),
            ..Options::default()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"))
    .plan
}

fn small_plan() -> Plan {
    plan(
        &job(|s| {
            s.actor = rollplex_compiler::fixtures::qwen_model(QwenSize::Tiny);
            s.rollout.prompts_per_iter = 2;
            s.rollout.group_size = 2;
            s.rollout.max_new_tokens = 8;
            s.rollout.media = rollplex_plan::spec::MediaSpec::Video {
                frames: 2,
                height: 56,
                width: 56,
            };
            s.train.micro_batch = 2;
            s.train.mini_batch = 4;
            s.schedule.decode_window = 4;
        }),
        Mode::Overlap,
    )
}

#[test]
fn round_trip_binary_and_yaml() {
    for (spec, mode) in [
        (job(|_| {}), Mode::Overlap),
        (paper_job(QwenSize::B7), Mode::Disaggregated),
        (paper_job(QwenSize::B32), Mode::Serial),
    ] {
        let p = plan(&spec, mode);
        let bytes = encode(&p, "rollplexc test").unwrap();
        let (h, back) = decode(&bytes).unwrap();
        assert_eq!(h.version, FORMAT_VERSION);
        assert_eq!(h.producer, "rollplexc test");
        assert_eq!(back, p);
        validate(&back).unwrap();
        // `explain` prints to_yaml of the decoded plan: byte-identical to --emit-yaml.
        let y = to_yaml(&p).unwrap();
        assert_eq!(to_yaml(&back).unwrap(), y);
        assert_eq!(from_yaml(&y).unwrap(), p);
    }
}

#[test]
fn every_single_byte_corruption_is_an_error() {
    let p = small_plan();
    let bytes = encode(&p, "rollplexc test").unwrap();
    let mut buf = bytes.clone();
    let mut checked = 0;
    for i in 0..bytes.len() {
        for mask in [0x01u8, 0x80, 0xff] {
            buf[i] = bytes[i] ^ mask;
            match decode(&buf) {
                Err(_) => checked += 1,
                Ok(_) => panic!("flipping byte {i} with {mask:#04x} still decoded"),
            }
        }
        buf[i] = bytes[i];
    }
    assert_eq!(checked, bytes.len() * 3);
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = encode(&small_plan(), "rollplexc test").unwrap();
    for n in 0..bytes.len() {
        let e = decode(&bytes[..n]).unwrap_err();
        assert!(
            matches!(
                e,
                DecodeError::TooShort { .. } | DecodeError::Truncated { .. }
            ),
            "length {n}: {e}"
        );
    }
    let mut longer = bytes.clone();
    longer.extend_from_slice(b"junk");
    assert!(matches!(
        decode(&longer),
        Err(DecodeError::Trailing { extra: 4 })
    ));
}

#[test]
fn newer_format_says_how_to_fix_it() {
    let mut bytes = encode(&small_plan(), "rollplexc test").unwrap();
    bytes[4..8].copy_from_slice(&(FORMAT_VERSION + 3).to_le_bytes());
    let msg = decode(&bytes).unwrap_err().to_string();
    assert!(
        msg.contains("is newer than this rollplex") && msg.contains("recompile the plan"),
        "{msg}"
    );
}
