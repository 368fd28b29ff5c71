//! Qwen2.5-VL-3B's widths (the preset table's `qwen2.5-vl-3b`) with fewer text layers and
//! vision blocks, random weights: the model of the GPU benchmarks.

use rollplex_plan::models;
use rollplex_plan::spec::{DType, ModelSpec, WeightsSource};

/// `text_layers` text layers and `vision_blocks` vision blocks (the last one full attention);
/// one EOS id, as the released config.json lists.
pub fn qwen3b_widths(text_layers: u32, vision_blocks: u32) -> ModelSpec {
    let mut s = models::model("qwen2.5-vl-3b")
        .expect("a built-in preset")
        .spec(DType::Bf16, WeightsSource::Random { seed: 1 });
    s.name = "qwen2.5-vl-3b-widths".into();
    s.vision.depth = vision_blocks;
    s.vision.fullatt_block_indexes = vec![vision_blocks - 1];
    s.text.num_layers = text_layers;
    s.tokens.eos_token_ids = vec![151645];
    s
}
