//! Parquet datasets in veRL's layout (a `prompt` list of messages, `images` as `{bytes, path}`
//! structs with embedded PNGs, `reward_model.ground_truth`), written here with the `parquet`
//! crate's writer: the tiny CPU job trains on one end to end, and malformed files (a missing
//! column, a value of the wrong type, an image that does not decode) are refused before the
//! run writes anything, with the file, the row and the column named and exit status 1.

#![cfg(unix)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use parquet::basic::Compression;
use parquet::data_type::{ByteArray, ByteArrayType};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;

const BIN: &str = env!("CARGO_BIN_EXE_rollplex-run");

/// One leaf column of a nested schema: its non-null values and its definition and repetition
/// levels (`None`: a required column outside any list, which has no levels).
struct Leaf {
    values: Vec<Vec<u8>>,
    def: Option<Vec<i16>>,
    rep: Option<Vec<i16>>,
}

/// Writes `leaves` (in the schema's depth-first leaf order, all byte arrays) as one row group,
/// snappy-compressed as pandas and pyarrow write by default.
fn write_parquet(path: &Path, schema: &str, leaves: Vec<Leaf>) {
    let schema = Arc::new(parse_message_type(schema).expect("schema parses"));
    let props = Arc::new(
        WriterProperties::builder()
            .set_compression(Compression::SNAPPY)
            .build(),
    );
    let file = std::fs::File::create(path).unwrap();
    let mut w = SerializedFileWriter::new(file, schema, props).unwrap();
    let mut rg = w.next_row_group().unwrap();
    for leaf in leaves {
        let mut col = rg.next_column().unwrap().expect("a column per leaf");
        let values: Vec<ByteArray> = leaf.values.into_iter().map(ByteArray::from).collect();
        col.typed::<ByteArrayType>()
            .write_batch(&values, leaf.def.as_deref(), leaf.rep.as_deref())
            .unwrap();
        col.close().unwrap();
    }
    assert!(rg.next_column().unwrap().is_none(), "a leaf per column");
    rg.close().unwrap();
    w.close().unwrap();
}

/// veRL's schema: `prompt` a list of {content, role}, `images` a list of {bytes, path},
/// `reward_model` {ground_truth, style}; `prompt_element` replaces the message struct (a wrong
/// type) when given.
fn verl_schema(prompt_element: Option<&str>) -> String {
    let element = prompt_element.unwrap_or(
        "required group element { required binary content (UTF8); required binary role (UTF8); }",
    );
    format!(
        "message verl {{
            required group prompt (LIST) {{ repeated group list {{ {element} }} }}
            required group images (LIST) {{
                repeated group list {{
                    required group element {{ optional binary bytes; optional binary path (UTF8); }}
                }}
            }}
            required group reward_model {{ required binary ground_truth (UTF8); required binary style (UTF8); }}
        }}"
    )
}

/// A 56x56 PNG: a coloured square on black, its colour the answer's.
fn png(colour: [u8; 3], at: u32) -> Vec<u8> {
    let mut img = image::RgbImage::new(56, 56);
    for y in at..at + 20 {
        for x in at..at + 20 {
            img.put_pixel(x, y, image::Rgb(colour));
        }
    }
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

const COLOURS: [([u8; 3], &str); 4] = [
    ([255, 0, 0], "A"),
    ([0, 255, 0], "B"),
    ([0, 0, 255], "C"),
    ([255, 255, 0], "D"),
];

/// `rows` samples in veRL's layout: a system and a user message, one embedded PNG, the answer
/// letter. `image_of(row)` gives each row's image bytes.
fn verl_leaves(rows: usize, image_of: impl Fn(usize) -> Vec<u8>) -> Vec<Leaf> {
    let (mut content, mut role, mut images, mut truth) = (vec![], vec![], vec![], vec![]);
    for r in 0..rows {
        content.push(b"Answer with one letter.".to_vec());
        role.push(b"system".to_vec());
        content.push(b"<image>Which colour? A red B green C blue D yellow".to_vec());
        role.push(b"user".to_vec());
        images.push(image_of(r));
        truth.push(COLOURS[r % 4].1.as_bytes().to_vec());
    }
    let messages = |values| Leaf {
        values,
        def: Some(vec![1; 2 * rows]),
        rep: Some((0..2 * rows).map(|i| (i % 2) as i16).collect()),
    };
    vec![
        messages(content),
        messages(role),
        // one image a row: bytes set (def 2), path null (def 1)
        Leaf {
            values: images,
            def: Some(vec![2; rows]),
            rep: Some(vec![0; rows]),
        },
        Leaf {
            values: vec![],
            def: Some(vec![1; rows]),
            rep: Some(vec![0; rows]),
        },
        Leaf {
            values: truth,
            def: None,
            rep: None,
        },
        Leaf {
            values: vec![b"rule".to_vec(); rows],
            def: None,
            rep: None,
        },
    ]
}

fn good_image(r: usize) -> Vec<u8> {
    png(COLOURS[r % 4].0, 4 + 8 * (r as u32 % 4))
}

/// The tiny example on images from the dataset `data`, compiled into `dir`.
fn tiny_plan(dir: &Path, data: &Path) -> PathBuf {
    let src = include_str!("../../examples/tiny.rpx")
        .replacen("const PROMPTS = 8 ", "const PROMPTS = 2 ", 1)
        .replacen("const G = 16 ", "const G = 4 ", 1)
        .replacen(
            "media = video(frames = 4, size = 56x56)",
            "media = image(size = 56x56, count = 1)",
            1,
        )
        .replacen("text_tokens = 40", "text_tokens = 120", 1)
        .replacen(
            "generated(\"moving_shapes\", 4096)",
            &format!("file({:?})", data.display().to_string()),
            1,
        );
    let checked = rollplex_dsl::compile_source("tiny.rpx", &src, &rollplex_dsl::NoFiles)
        .unwrap_or_else(|d| panic!("{}", d.render("tiny.rpx", &src, false)));
    let plan = rollplex_compiler::compile(&checked.spec, &Default::default())
        .expect("the pipeline compiles")
        .plan;
    let path = dir.join("tiny.plan");
    std::fs::write(&path, rollplex_plan::encode(&plan, "tests").unwrap()).unwrap();
    path
}

/// Runs the plan for `iterations` into `out`: exit status and stderr.
fn train(plan: &Path, out: &Path, iterations: u32) -> (i32, String) {
    let o = Command::new(BIN)
        .arg(plan)
        .args(["--iterations", &iterations.to_string(), "--quiet", "--out"])
        .arg(out)
        .output()
        .expect("rollplex-run runs");
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn the_tiny_job_trains_on_a_verl_parquet_file_with_embedded_images() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("train.parquet");
    write_parquet(&data, &verl_schema(None), verl_leaves(8, good_image));
    let loaded = rollplex_runtime::data::Dataset::load(&data).expect("loads");
    assert_eq!(loaded.len(), 8);
    let s = &loaded.samples[5];
    assert_eq!(s.id, "row5");
    assert_eq!(s.answer, "B");
    assert_eq!(s.system.as_deref(), Some("Answer with one letter."));
    assert!(s.prompt.starts_with("<image>Which colour?"), "{}", s.prompt);
    match &s.media {
        rollplex_runtime::data::Media::Images(v) => {
            assert_eq!(v.len(), 1);
            assert_eq!(v[0].load().unwrap().dimensions(), (56, 56));
        }
        m => panic!("expected one image, got {m:?}"),
    }

    let plan = tiny_plan(dir.path(), &data);
    let out = dir.path().join("out");
    let (code, err) = train(&plan, &out, 3);
    assert_eq!(code, 0, "{err}");
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let rewards: Vec<f64> = metrics
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["reward_mean"].as_f64().expect("a reward")
        })
        .collect();
    assert_eq!(rewards.len(), 3, "{metrics}");
    assert!(
        rewards.iter().all(|r| (0.0..=1.0).contains(r)),
        "{rewards:?}"
    );
}

/// EasyR1's layout: a `problem` string, an `answer` string, `images` as paths relative to the
/// file; and a path that does not exist is named with its row and column.
#[test]
fn easyr1_layout_with_image_paths_loads_and_a_missing_image_is_named() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("img")).unwrap();
    std::fs::write(dir.path().join("img/0.png"), good_image(0)).unwrap();
    let schema = "message easyr1 {
        required binary problem (UTF8);
        required binary answer (UTF8);
        required group images (LIST) { repeated group list { required binary element (UTF8); } }
    }";
    let leaves = |second: &str| {
        vec![
            Leaf {
                values: vec![b"<image>Which colour?".to_vec(); 2],
                def: None,
                rep: None,
            },
            Leaf {
                values: vec![b"A".to_vec(), b"B".to_vec()],
                def: None,
                rep: None,
            },
            Leaf {
                values: vec![b"img/0.png".to_vec(), second.as_bytes().to_vec()],
                def: Some(vec![1, 1]),
                rep: Some(vec![0, 0]),
            },
        ]
    };
    let data = dir.path().join("easy.parquet");
    write_parquet(&data, schema, leaves("img/0.png"));
    let loaded = rollplex_runtime::data::Dataset::load(&data).expect("loads");
    assert_eq!(loaded.len(), 2);
    assert_eq!(
        (
            loaded.samples[1].prompt.as_str(),
            loaded.samples[1].answer.as_str()
        ),
        ("<image>Which colour?", "B")
    );
    assert_eq!(
        loaded.samples[0].media,
        rollplex_runtime::data::Media::Images(vec![rollplex_runtime::data::MediaSource::Path(
            dir.path().join("img/0.png")
        )])
    );
    write_parquet(&data, schema, leaves("img/9.png"));
    let e = rollplex_runtime::data::Dataset::load(&data)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("easy.parquet:row 1: column `images[0]`: no such file")
            && e.contains("img/9.png"),
        "{e}"
    );
}

/// A malformed file: the run stops with exit 1 before writing anything, naming the file, the
/// row and the column.
#[track_caller]
fn refused(schema: &str, leaves: Vec<Leaf>, needles: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.parquet");
    write_parquet(&good, &verl_schema(None), verl_leaves(4, good_image));
    let plan = tiny_plan(dir.path(), &good);
    let bad = dir.path().join("d.parquet");
    write_parquet(&bad, schema, leaves);
    // the same plan, pointed at the bad file: it sits where the good one was
    std::fs::rename(&bad, &good).unwrap();
    let out = dir.path().join("out");
    let (code, err) = train(&plan, &out, 1);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("good.parquet"), "{err}");
    for n in needles {
        assert!(err.contains(n), "{n:?} not in: {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
    assert!(!out.join("metrics.jsonl").exists(), "nothing is written");
}

#[test]
fn a_missing_column_is_named_with_the_columns_there_are() {
    let schema = "message m {
        required group prompt (LIST) { repeated group list {
            required group element { required binary content (UTF8); required binary role (UTF8); } } }
    }";
    let mut leaves = verl_leaves(2, good_image);
    leaves.truncate(2);
    refused(
        schema,
        leaves,
        &[
            "column `answer` is missing",
            "reward_model",
            "columns are: prompt",
        ],
    );
}

#[test]
fn a_value_of_the_wrong_type_names_its_row_and_column() {
    // `prompt` a list of strings, not of {role, content} messages
    let schema = verl_schema(Some("required binary element (UTF8);"));
    let mut leaves = verl_leaves(2, good_image);
    leaves.remove(1);
    refused(
        &schema,
        leaves,
        &[
            "good.parquet:row 0",
            "column `prompt[0]`",
            "expected a {role, content} message, got a string",
        ],
    );
}

#[test]
fn an_image_that_does_not_decode_names_its_row_and_column() {
    let leaves = verl_leaves(3, |r| {
        if r == 2 {
            b"\x89PNG\r\n\x1a\nnot really".to_vec()
        } else {
            good_image(r)
        }
    });
    refused(
        &verl_schema(None),
        leaves,
        &[
            "good.parquet:row 2",
            "column `images[0].bytes`",
            "not a decodable image",
        ],
    );
}
