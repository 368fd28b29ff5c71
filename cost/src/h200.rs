//! The H200 reference measurements of `cost/profiles/reference/` as profile points, and the shipped
//! profile built from them (`cost/profiles/h200.yaml` is [`profile_yaml`]'s output:
//! `cargo run -p rollplex-cost --example calibrate_h200 > cost/profiles/h200.yaml`).
//!
//! Every number below is copied from a bench JSON file (file and field in each point's note);
//! the work amounts are computed from the probe's own formulas (`overlap_probe.py`): 4 distinct
//! decoder layers cycled to the full depth, decode over a KV cache of `B x S`, prefill chunks of
//! 8192 tokens, weights in bf16.

use rollplex_plan::spec::GpuSpec;
use rollplex_plan::work::{Work, WorkKind};

use crate::defaults::datasheet;
use crate::profile::{CorunPoint, Point, Profile, ProfileError};

/// Decoder dimensions of one probe workload (`DIMS` and `LAYERS` of `overlap_probe.py`).
#[derive(Clone, Copy, Debug)]
pub struct ProbeDims {
    pub hidden: u64,
    pub ffn: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub layers: u64,
}

/// Qwen2.5-7B-like dims (the probe's default `DIMS=3584,18944,28,4,128`, 28 layers).
pub const DIMS_7B: ProbeDims = ProbeDims {
    hidden: 3584,
    ffn: 18944,
    heads: 28,
    kv_heads: 4,
    head_dim: 128,
    layers: 28,
};
/// Qwen2.5-3B-like dims (`DIMS=2048,11008,16,2,128 LAYERS=36`).
pub const DIMS_3B: ProbeDims = ProbeDims {
    hidden: 2048,
    ffn: 11008,
    heads: 16,
    kv_heads: 2,
    head_dim: 128,
    layers: 36,
};
/// Tokens per prefill chunk (`T_PRE`).
pub const PREFILL_TOKENS: u64 = 8192;

impl ProbeDims {
    /// Weights of one layer as the probe builds them: qkv, o, gate+up, down (no biases).
    pub fn layer_params(&self) -> u64 {
        let (h, i, d) = (self.hidden, self.ffn, self.head_dim);
        h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h + h * 2 * i + i * h
    }

    /// `steps` decode steps at batch `b` over a KV cache of `s` tokens.
    /// Bytes: the probe's `dec_tokens_bytes` (weights + K and V caches, once per step).
    /// FLOPs: 2 per weight per sample, plus QK^T and PV over the cache.
    pub fn decode_work(&self, b: u64, s: u64, steps: u64) -> Work {
        let l = self.layers;
        let bytes = l * (self.layer_params() + 2 * b * self.kv_heads * s * self.head_dim) * 2;
        let flops = 2 * b * l * self.layer_params() + 4 * b * self.heads * s * self.head_dim * l;
        Work {
            flops: (flops * steps) as f64,
            bytes: (bytes * steps) as f64,
            steps: (l * steps) as u32,
            host_bytes: 0.0,
            net_bytes: 0.0,
            parts: Vec::new(),
        }
    }

    /// `chunks` prefill chunks of `t` tokens (causal attention within the chunk).
    /// FLOPs: the probe's `pre_flops` (2 per weight per token) plus causal attention
    /// (QK^T and PV over half of the t x t square). Bytes: weights once plus each layer's
    /// activations written and read once.
    pub fn prefill_work(&self, t: u64, chunks: u64) -> Work {
        let (l, h, i, d) = (self.layers, self.hidden, self.ffn, self.head_dim);
        let flops = 2 * t * l * self.layer_params() + 2 * t * t * self.heads * d * l;
        let acts = t * (2 * h + (self.heads + 2 * self.kv_heads) * d + self.heads * d + 3 * i);
        let bytes = l * (self.layer_params() + acts) * 2;
        Work {
            flops: (flops * chunks) as f64,
            bytes: (bytes * chunks) as f64,
            steps: (l * chunks) as u32,
            host_bytes: 0.0,
            net_bytes: 0.0,
            parts: Vec::new(),
        }
    }
}

/// One probe run: its workload and the times of its JSON file, milliseconds.
pub struct ProbeRun {
    pub file: &'static str,
    pub dims: ProbeDims,
    pub batch: u64,
    pub kv_len: u64,
    /// `NDEC`.
    pub decode_steps: u64,
    /// `NPRE`.
    pub prefill_chunks: u64,
    pub t_dec_ms: f64,
    pub t_pre_ms: f64,
    pub t_serial_ms: f64,
    /// `green_dec{k}_pre{132-k}`: (k, dec_alone, pre_alone, both).
    pub green: &'static [(u32, f64, f64, f64)],
}

/// The three runs of `cost/profiles/reference/README.md`'s table.
pub const RUNS: [ProbeRun; 3] = [
    ProbeRun {
        file: "h200-7b-b64-s1024.json",
        dims: DIMS_7B,
        batch: 64,
        kv_len: 1024,
        decode_steps: 100,
        prefill_chunks: 3,
        t_dec_ms: 520.330983000001,
        t_pre_ms: 559.6566070000008,
        t_serial_ms: 1080.1240730000004,
        green: &[
            (
                16,
                1691.3397040000007,
                632.1763940000053,
                1810.4030490000014,
            ),
            (32, 944.8840270000005, 692.2369600000025, 1110.8756179999943),
            (48, 743.1296000000032, 799.9033490000045, 995.7395360000021),
            (64, 599.6054839999942, 949.9713410000084, 1139.3270880000018),
            (
                80,
                594.5701699999972,
                1228.6071799999972,
                1411.4370069999893,
            ),
        ],
    },
    ProbeRun {
        file: "h200-3b-b64-s2048.json",
        dims: DIMS_3B,
        batch: 64,
        kv_len: 2048,
        decode_steps: 100,
        prefill_chunks: 4,
        t_dec_ms: 370.3911550000001,
        t_pre_ms: 390.71497800000543,
        t_serial_ms: 760.1772659999995,
        green: &[
            (24, 860.9760850000043, 465.354204999997, 936.0432359999961),
            (32, 655.8893979999993, 489.9903539999997, 742.7041419999938),
            (40, 592.9928509999982, 527.7122790000064, 685.718811000001),
            (48, 565.2387329999868, 560.2357960000006, 661.5210890000043),
            (56, 563.4094429999976, 600.4676409999945, 703.7681649999996),
            (64, 421.08427499999834, 670.7866840000065, 775.8314189999993),
            (72, 423.844514999999, 777.3754899999972, 868.9395889999929),
        ],
    },
    ProbeRun {
        file: "h200-3b-b8-s2048.json",
        dims: DIMS_3B,
        batch: 8,
        kv_len: 2048,
        decode_steps: 150,
        prefill_chunks: 4,
        t_dec_ms: 399.32734599999264,
        t_pre_ms: 391.84338399999774,
        t_serial_ms: 789.0907569999968,
        green: &[
            (24, 746.7646260000009, 468.17638400000305, 819.7152990000092),
            (32, 597.0020969999865, 485.6478850000201, 682.2708769999792),
            (40, 555.585437000019, 527.2281459999988, 633.9521189999857),
            (48, 479.8094889999902, 560.29655399999, 641.5592160000188),
            (56, 476.9550180000124, 600.4545739999969, 680.3739549999932),
            (64, 446.34329699999853, 670.6453769999996, 753.3472050000114),
            (72, 441.73020200000224, 777.6547820000133, 856.4832430000138),
        ],
    },
];

/// Device copy ceiling of `h200-7b-b64-s1024.json` (`copy_tbs`, TB/s of bytes read +
/// written; the 3B files hold a placeholder there): the memory roof of streaming kernels.
pub const COPY_TBS: f64 = 4.21789769107919;
/// Bytes the probe's copy moves (2 GiB of bf16 read and written).
pub const COPY_BYTES: f64 = 2.0 * 2.0 * (1u64 << 30) as f64;

impl ProbeRun {
    pub fn decode(&self) -> Work {
        self.dims
            .decode_work(self.batch, self.kv_len, self.decode_steps)
    }
    pub fn prefill(&self) -> Work {
        self.dims.prefill_work(PREFILL_TOKENS, self.prefill_chunks)
    }
}

/// The datasheet GPU the probe ran on.
pub fn gpu() -> GpuSpec {
    // "H200" is a known datasheet name.
    datasheet("H200").unwrap_or_else(|| unreachable!("H200 datasheet"))
}

/// Points (alone on the whole GPU, and the copy ceiling) and co-run points (green splits).
pub fn bench_points() -> (Vec<Point>, Vec<CorunPoint>) {
    let all = gpu().sms;
    let mut points = Vec::new();
    let mut corun = Vec::new();
    for r in &RUNS {
        points.push(Point {
            kind: WorkKind::Decode,
            sms: all,
            work: r.decode(),
            seconds: r.t_dec_ms / 1e3,
            note: format!("{}: t_dec_ms", r.file),
        });
        points.push(Point {
            kind: WorkKind::Prefill,
            sms: all,
            work: r.prefill(),
            seconds: r.t_pre_ms / 1e3,
            note: format!("{}: t_pre_ms", r.file),
        });
        for &(k, dec, pre, both) in r.green {
            let field = format!("green_dec{k}_pre{}", all - k);
            corun.push(CorunPoint {
                a: Point {
                    kind: WorkKind::Decode,
                    sms: k,
                    work: r.decode(),
                    seconds: dec / 1e3,
                    note: format!("{}: {field}.dec_alone", r.file),
                },
                b: Point {
                    kind: WorkKind::Prefill,
                    sms: all - k,
                    work: r.prefill(),
                    seconds: pre / 1e3,
                    note: format!("{}: {field}.pre_alone", r.file),
                },
                seconds: both / 1e3,
                note: format!("{}: {field}.both", r.file),
            });
        }
    }
    points.push(Point {
        kind: WorkKind::Optimizer,
        sms: all,
        work: Work {
            flops: 0.0,
            bytes: COPY_BYTES,
            steps: 1,
            host_bytes: 0.0,
            net_bytes: 0.0,
            parts: Vec::new(),
        },
        seconds: COPY_BYTES / (COPY_TBS * 1e12),
        note: "h200-7b-b64-s1024.json: copy_tbs (device copy, read + written)".into(),
    });
    (points, corun)
}

/// Kinds that were not measured but run the same kernels as a measured one: (kind, source).
pub const BORROWED: [(WorkKind, WorkKind); 8] = [
    (WorkKind::VisionEncode, WorkKind::Prefill),
    (WorkKind::RefPrefix, WorkKind::Prefill),
    (WorkKind::RefSuffix, WorkKind::Prefill),
    (WorkKind::ActorPrefixFwd, WorkKind::Prefill),
    (WorkKind::ActorSuffixFwd, WorkKind::Prefill),
    (WorkKind::ActorBwd, WorkKind::Prefill),
    (WorkKind::Advantage, WorkKind::Optimizer),
    (WorkKind::WeightSync, WorkKind::Optimizer),
];

/// The shipped H200 profile: [`Profile::fit`] on [`bench_points`], then the [`BORROWED`]
/// kinds take their source's curve.
pub fn profile() -> Result<Profile, ProfileError> {
    let (points, corun) = bench_points();
    let mut p = Profile::fit(&gpu(), points, corun)?;
    for (kind, from) in BORROWED {
        if let Some(c) = p.kinds.get(&from).cloned() {
            p.kinds.insert(kind, c);
        }
    }
    p.source = "cost/profiles/reference (overlap_probe.py, PyTorch 2.11, CUDA 13.0, driver 580), \
                fitted by rollplex-cost (cargo run -p rollplex-cost --example calibrate_h200)"
        .into();
    p.validate()?;
    Ok(p)
}

/// The shipped profile, `cost/profiles/h200.yaml` as compiled in (no fitting at run time; a
/// test checks that it equals [`profile`]'s fit).
pub fn shipped() -> Result<Profile, ProfileError> {
    Profile::from_yaml(include_str!("../profiles/h200.yaml"))
}

/// [`profile`] as YAML with a header that says where each number comes from.
pub fn profile_yaml(p: &Profile) -> String {
    let mut out = String::from(HEADER);
    out.push_str(&p.to_yaml());
    out
}

const HEADER: &str = "\
# H200 profile for the Rollplex cost model. GENERATED, do not edit by hand:
#   cargo run -p rollplex-cost --example calibrate_h200 > cost/profiles/h200.yaml
# (rollplex-cost's test `shipped_profile_is_the_fit_of_the_bench` fails when this file and the
# fit disagree.)
#
# Where the numbers come from (all in cost/profiles/reference/, measured on one H200 with PyTorch 2.11):
# - gpu: datasheet peaks of the H200 SXM (132 SMs, 4.8 TB/s HBM3e, 989 TFLOP/s dense bf16,
#   PCIe Gen5 64 GB/s); every efficiency below is a fraction of these.
# - points / corun_points: the times of the three overlap_probe.py runs of reference/README.md's
#   table; each `note` names the JSON file and field. Work amounts are computed from the
#   probe's dims with its formulas (rollplex_cost::h200::ProbeDims). `sms: 132` points are
#   the plain-stream runs (t_dec_ms, t_pre_ms); the others ran in green contexts.
# - the optimizer point is the device-copy ceiling (copy_tbs of h200-7b-b64-s1024.json):
#   AdamW and other elementwise kernels stream memory like a copy.
# - kinds: decode and prefill are fitted to their points (rollplex_cost::fit); optimizer to
#   the copy point (only its memory efficiency is measured: its SM curve is the default).
#   Not measured, same kernels as a measured kind, so they take its curve:
#   vision_encode, ref_prefix, ref_suffix, actor_prefix_fwd, actor_suffix_fwd, actor_bwd
#   <- prefill (bf16 GEMMs + attention); advantage, weight_sync <- optimizer (streaming).
#   reward and transfer keep the datasheet defaults (host work; PCIe from the gpu spec).
# - corun: one slowdown for decode beside prefill, fitted to the 19 green-split makespans
#   given their measured times alone; default_corun is the same value.
";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_matches_the_probe_bandwidth_and_rate() {
        // The probe reports dec_bw_tbs and pre_tflops from the same formulas (its FLOPs
        // exclude attention).
        let r = &RUNS[0];
        let step_bytes = r.decode().bytes / r.decode_steps as f64;
        let bw = step_bytes / (r.t_dec_ms / r.decode_steps as f64 * 1e-3) / 1e12;
        assert!((bw - 3.2303810130791244).abs() < 1e-9, "{bw}");
        let d = r.dims;
        let gemm = (2 * PREFILL_TOKENS * d.layers * d.layer_params() * r.prefill_chunks) as f64;
        let rate = gemm / (r.t_pre_ms * 1e-3) / 1e12;
        assert!((rate - 573.0853058545157).abs() < 1e-6, "{rate}");
        let r = &RUNS[2];
        let bw = r.decode().bytes / (r.t_dec_ms * 1e-3) / 1e12;
        assert!((bw - 2.3112782143400143).abs() < 1e-9, "{bw}");
    }

    #[test]
    fn points_cover_the_table() {
        let (points, corun) = bench_points();
        assert_eq!(points.len(), 7);
        assert_eq!(corun.len(), 19);
        assert!(corun.iter().all(|c| c.a.sms + c.b.sms == 132));
    }
}
