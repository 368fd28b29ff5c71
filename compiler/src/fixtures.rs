//! Job specs built in Rust, for tests, property tests and benchmarks of the compiler (the
//! pipelines users write go through the DSL instead).
//!
//! Model dimensions are those of the published Qwen2.5-VL configs (config.json of
//! Qwen/Qwen2.5-VL-{3B,7B,32B}-Instruct); GPU numbers are datasheet values (see
//! `rollplex_cost::defaults::datasheet`).

use rollplex_plan::spec::*;

/// Published Qwen2.5-VL sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QwenSize {
    B3,
    B7,
    B32,
    /// A tiny model for CPU runs.
    Tiny,
}

/// The Qwen2.5-VL vision tower (the same for every published size), merging into `out`.
pub fn qwen_vision(out: u32) -> VisionDims {
    VisionDims {
        depth: 32,
        hidden_size: 1280,
        num_heads: 16,
        intermediate_size: 3420,
        patch_size: 14,
        temporal_patch_size: 2,
        spatial_merge_size: 2,
        window_size: 112,
        fullatt_block_indexes: vec![7, 15, 23, 31],
        in_channels: 3,
        out_hidden_size: out,
    }
}

pub fn qwen_model(size: QwenSize) -> ModelSpec {
    let (layers, hidden, heads, kv, ffn, vocab, tied) = match size {
        QwenSize::B3 => (36, 2048, 16, 2, 11008, 151936, true),
        QwenSize::B7 => (28, 3584, 28, 4, 18944, 152064, false),
        QwenSize::B32 => (64, 5120, 40, 8, 27648, 152064, false),
        QwenSize::Tiny => (2, 64, 4, 2, 128, 1024, true),
    };
    let mut vision = qwen_vision(hidden);
    if size == QwenSize::Tiny {
        vision.depth = 2;
        vision.hidden_size = 32;
        vision.num_heads = 2;
        vision.intermediate_size = 64;
        vision.fullatt_block_indexes = vec![1];
    }
    let head_dim = hidden / heads;
    ModelSpec {
        name: format!("{size:?}").to_lowercase(),
        vision,
        text: TextDims {
            num_layers: layers,
            hidden_size: hidden,
            num_heads: heads,
            num_kv_heads: kv,
            intermediate_size: ffn,
            vocab_size: vocab,
            rope_theta: 1e6,
            mrope_section: [head_dim / 8, 3 * head_dim / 16, 3 * head_dim / 16],
            tie_word_embeddings: tied,
            rms_norm_eps: 1e-6,
            max_position_embeddings: 128000,
        },
        tokens: SpecialTokens {
            image_token_id: 151655,
            video_token_id: 151656,
            vision_start_token_id: 151652,
            vision_end_token_id: 151653,
            eos_token_ids: vec![151645],
        },
        dtype: DType::Bf16,
        weights: WeightsSource::Random { seed: 0 },
    }
}

/// Datasheet GPUs: `H200`, `H800`.
pub fn gpu(name: &str) -> GpuSpec {
    rollplex_cost::defaults::datasheet(name).unwrap_or_else(|| GpuSpec {
        name: name.to_string(),
        sms: 132,
        sm_granularity: 8,
        hbm_bytes: 80_000_000_000,
        hbm_bw: 3.35e12,
        bf16_flops: 989e12,
        host_bw: 64e9,
    })
}

/// A single-H200 Qwen2.5-VL-3B GRPO job with 8-frame 448x448 video prompts, edited by `edit`.
pub fn job(edit: impl FnOnce(&mut JobSpec)) -> JobSpec {
    let g = gpu("H200");
    let mut s = JobSpec {
        name: "fixture".into(),
        seed: 1,
        cluster: ClusterSpec {
            gpu: g.clone(),
            count: 1,
            gpus_per_node: 8,
            intra_node_bw: 450e9,
            inter_node_bw: 50e9,
        },
        actor: qwen_model(QwenSize::B3),
        reference: ReferenceSpec { enabled: true },
        rollout: RolloutSpec {
            tp: 1,
            prompts_per_iter: 16,
            group_size: 8,
            media: MediaSpec::Video {
                frames: 8,
                height: 448,
                width: 448,
            },
            prompt_text_tokens: 200,
            max_new_tokens: 512,
            response_len: LengthDist::LogNormal {
                median: 256.0,
                sigma: 0.6,
            },
            sampling: SamplingSpec {
                temperature: 1.0,
                top_p: 1.0,
                top_k: 0,
                stop_token_ids: vec![],
                forced_lengths: true,
            },
            dataset: DatasetSpec::Synthetic,
        },
        reward: RewardSpec::Builtin {
            name: "exact_match".into(),
            tolerance: 0.0,
        },
        train: TrainSpec {
            tp: 1,
            algorithm: Algorithm::Grpo(PolicyLoss {
                clip_low: 0.2,
                clip_high: 0.28,
                kl_coef: 0.001,
                kl_estimator: KlEstimator::K3,
                loss_agg: LossAgg::TokenMean,
                norm_adv_by_std: true,
                advantage: AdvantageEstimator::Group,
                ratio: RatioLevel::Token,
                tis_cap: None,
                overlong: None,
            }),
            optimizer: AdamWSpec {
                lr: 1e-6,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.01,
                grad_clip: 1.0,
                lr_schedule: LrSchedule::Constant,
            },
            micro_batch: 8,
            mini_batch: 128,
            epochs: 1,
            freeze_vision: true,
            freeze_merger: false,
            recompute: Recompute::Full,
            optimizer_state: rollplex_plan::spec::OptimizerState::Auto,
            groups: None,
            old_logprobs: OldLogProbPass::Auto,
            prompt_forward: PromptForwardPass::Auto,
        },
        schedule: ScheduleSpec {
            mode: Mode::Overlap,
            prefix_dedup: true,
            decode_window: 64,
            memory_budget: g.hbm_bytes,
            host_memory: 1 << 40,
        },
    };
    edit(&mut s);
    s
}

/// The paper's setting: `size` on 32 H800s (4 nodes of 8), video reasoning, GRPO.
pub fn paper_job(size: QwenSize) -> JobSpec {
    job(|s| {
        let g = gpu("H800");
        s.name = format!("paper-{size:?}").to_lowercase();
        s.cluster = ClusterSpec {
            gpu: g.clone(),
            count: 32,
            gpus_per_node: 8,
            intra_node_bw: 200e9,
            inter_node_bw: 50e9,
        };
        s.actor = qwen_model(size);
        let (rtp, ttp) = match size {
            QwenSize::B32 => (4, 8),
            _ => (2, 4),
        };
        s.rollout.tp = rtp;
        s.train.tp = ttp;
        s.rollout.prompts_per_iter = 128;
        s.rollout.group_size = 8;
        s.rollout.media = MediaSpec::Video {
            frames: 16,
            height: 448,
            width: 448,
        };
        s.rollout.prompt_text_tokens = 200;
        s.rollout.max_new_tokens = 1024;
        s.rollout.response_len = LengthDist::LogNormal {
            median: 300.0,
            sigma: 0.6,
        };
        s.train.mini_batch = 1024;
        s.train.micro_batch = 8;
        s.schedule.memory_budget = g.hbm_bytes;
    })
}
