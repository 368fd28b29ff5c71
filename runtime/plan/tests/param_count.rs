//! Parameter counts against the numbers Hugging Face reports for the same configs (the preset
//! table's rows).
use rollplex_plan::models;
use rollplex_plan::spec::{DType, WeightsSource};

/// transformers 5.17 reported 3.75 B parameters for this 3B-shaped config
/// (cost/profiles/reference/hf_baseline.py, "params 3.754... B").
#[test]
fn qwen25_vl_3b_matches_hf_count() {
    let m = models::model("qwen2.5-vl-3b")
        .expect("a built-in preset")
        .spec(DType::Bf16, WeightsSource::Random { seed: 0 });
    let p = m.param_count();
    let total = p.total() as f64 / 1e9;
    assert!((total - 3.754).abs() < 0.01, "3B total {total} B, {p:?}");
}
