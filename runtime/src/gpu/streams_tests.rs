//! SM partitions under the model engine on a CUDA device (skipped, saying so, without one): a
//! prefill and a decode step give the same bits on the whole GPU, on green partitions and on
//! plain streams. The partition rules and where kernels land are tested in `rollplex-kernels`.

use std::sync::Arc;

use half::bf16;
use rollplex_kernels::cuda::{test_gpu, CudaStream, Gpu};
use rollplex_plan::models::{mrope_for, TestModel};
use rollplex_plan::spec::DType;

use super::*;
use crate::gpu::{GpuKvArena, GpuModel, GpuPrompt};
use crate::model::{DecodeSlot, Qwen25VL};

/// Device 0, or a printed skip (a failure with `ROLLPLEX_REQUIRE_GPU=1`).
fn gpu_or_skip() -> Option<Gpu> {
    test_gpu()
}

/// A small random model whose ops spread over more SMs than a 40-SM partition has.
fn small_model() -> Qwen25VL {
    let spec = TestModel {
        name: "streams-test",
        vision_depth: 1,
        vision_ffn: 48,
        layers: 2,
        heads: 8,
        kv_heads: 2,
        head_dim: 64,
        ffn: 1376,
        vocab: 3001,
        mrope_section: mrope_for(64),
        first_special: 2995,
        dtype: DType::Bf16,
        seed: 5,
        ..TestModel::default()
    }
    .spec();
    Qwen25VL::random(spec, 13).unwrap()
}

fn bits(v: Vec<bf16>) -> Vec<u16> {
    v.into_iter().map(bf16::to_bits).collect()
}

/// Prefill of three prompts, then one decode step of 6 samples (2 per prompt) on `s`: every
/// prompt's last logits, the prefill K and V, and the step's logits, as bits.
fn prefill_and_decode(gpu: &Gpu, gm: &GpuModel, s: &Arc<CudaStream>) -> Vec<Vec<u16>> {
    let ids: Vec<Vec<u32>> = [301usize, 190, 97]
        .iter()
        .enumerate()
        .map(|(p, &n)| {
            (0..n)
                .map(|i| ((i * 37 + p * 1013) % 2990) as u32)
                .collect()
        })
        .collect();
    let prompts: Vec<GpuPrompt> = ids
        .iter()
        .map(|ids| GpuPrompt { ids, media: &[] })
        .collect();
    let states = gm.prefill(gpu, s, &prompts).unwrap();
    let cap = 2048;
    let mut arena = GpuKvArena::for_model(gm, gpu, s, cap).unwrap();
    let mut slots = Vec::new();
    let mut row = 0u32;
    for st in &states {
        let span = arena.store_prefix(s, row, st).unwrap();
        row += st.len;
        for _ in 0..2 {
            slots.push(DecodeSlot::new(span, st.rope_delta, row, 8));
            row += 8;
        }
    }
    let tokens: Vec<u32> = (0..slots.len() as u32).map(|i| 7 + 131 * i).collect();
    let logits = gm
        .decode_step(gpu, s, &mut arena, &mut slots, &tokens)
        .unwrap();
    let mut out: Vec<Vec<u16>> = states
        .iter()
        .map(|st| bits(s.clone_dtoh(st.last_logits.as_ref()).unwrap()))
        .collect();
    out.push(bits(s.clone_dtoh(&states[0].kv.k).unwrap()));
    out.push(bits(s.clone_dtoh(&states[0].kv.v).unwrap()));
    out.push(bits(s.clone_dtoh(&logits).unwrap()));
    s.synchronize().unwrap();
    out
}

#[test]
fn prefill_and_decode_bits_do_not_depend_on_the_partition() {
    let Some(gpu) = gpu_or_skip() else { return };
    let set = StreamSet::new(&gpu).unwrap();
    let plain = StreamSet::plain(&gpu).unwrap();
    assert!(!plain.green());
    let total = set.total_sms();
    let whole = set.partition(total, Priority::Normal).unwrap();
    let model = small_model();
    let gm = GpuModel::upload(&gpu, &whole, &model).unwrap();
    whole.synchronize().unwrap();
    let want = prefill_and_decode(&gpu, &gm, &whole);
    assert!(want.iter().all(|v| !v.is_empty()));
    let runs = [
        (
            "green decode 40",
            set.partition(40, Priority::High).unwrap(),
        ),
        (
            "green side 52",
            set.partition(52, Priority::Normal).unwrap(),
        ),
        ("plain high", plain.partition(40, Priority::High).unwrap()),
    ];
    for (name, s) in &runs {
        let got = prefill_and_decode(&gpu, &gm, s);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let diff = g.iter().zip(w).filter(|(a, b)| a != b).count();
            assert_eq!(
                diff,
                0,
                "{name}: output {i} differs in {diff} of {} values",
                w.len()
            );
        }
        eprintln!(
            "{name}: {} outputs bitwise equal to the whole GPU's",
            got.len()
        );
    }
    // cached: the same granted size and priority is the same stream
    let a = set.partition(33, Priority::High).unwrap();
    assert!(Arc::ptr_eq(&a, &set.partition(40, Priority::High).unwrap()));
    assert!(!Arc::ptr_eq(
        &a,
        &set.partition(41, Priority::High).unwrap()
    ));
    eprintln!(
        "green: {}; {} SMs in groups of {}",
        set.green(),
        total,
        set.granularity()
    );
}
