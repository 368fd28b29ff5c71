//! The forced response lengths of `examples/h200-3b-video.rpx` match the Python port in
//! `tests/reference/iteration_common.py` (the PyTorch peers, `hf_iteration.py` and
//! `strong_iteration.py`, stop each sample at the length Rollplex forces on it).
//! `python3 tests/reference/hf_iteration.py --write-golden
//! tests/reference/forced_lengths_h200_3b_video.json` rewrites the golden file from the port.

use std::path::PathBuf;

use rollplex_runtime::exec::forced_length;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn python_port_draws_the_same_lengths() {
    let yaml = std::fs::read_to_string(root().join("examples/h200-3b-video.plan.yaml"))
        .expect("read the example plan");
    let plan = rollplex_plan::from_yaml(&yaml).expect("parse the example plan");
    let spec = &plan.spec;
    assert!(
        spec.rollout.sampling.forced_lengths,
        "the example forces lengths"
    );
    let golden: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("tests/reference/forced_lengths_h200_3b_video.json"))
            .expect("read the golden lengths"),
    )
    .expect("golden lengths are JSON");
    assert_eq!(golden["seed"].as_u64(), Some(spec.seed));
    assert_eq!(
        golden["max_new_tokens"].as_u64(),
        Some(spec.rollout.max_new_tokens as u64)
    );
    let iteration = golden["iteration"].as_u64().expect("iteration") as u32;
    let want: Vec<u32> = golden["lengths"]
        .as_array()
        .expect("lengths")
        .iter()
        .map(|v| v.as_u64().expect("a length") as u32)
        .collect();
    let samples = spec.rollout.prompts_per_iter * spec.rollout.group_size;
    assert_eq!(want.len() as u32, samples, "one length per sample");
    let got: Vec<u32> = (0..samples)
        .map(|s| forced_length(spec, iteration, s))
        .collect();
    assert_eq!(got, want);
}
