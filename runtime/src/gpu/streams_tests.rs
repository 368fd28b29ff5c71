//! Tests of SM partitions: the rounding and placement rules (no GPU), and on a CUDA device
//! (skipped, saying so, without one) where kernels land (%smid) on two partitions used at once
//! from one thread, and that a prefill and a decode step give the same bits on the whole GPU,
//! on green partitions and on plain streams.

use half::bf16;
use rollplex_kernels::cuda::nvrtc::KernelModule;
use rollplex_kernels::cuda::{test_gpu, Gpu};
use rollplex_plan::spec::{DType, ModelSpec, SpecialTokens, TextDims, VisionDims, WeightsSource};

use super::*;
use crate::gpu::{GpuKvArena, GpuModel, GpuPrompt};
use crate::model::{DecodeSlot, Qwen25VL};

/// The H200 as its driver (580) splits it: 15 groups of 8 SMs and 12 left over (measured).
const H200: SmLayout = SmLayout {
    total: 132,
    unit: 8,
    units: 15,
    remainder: 12,
};

#[test]
fn rounding_of_sm_counts() {
    use Placement::*;
    use Priority::*;
    let l = H200;
    // (asked, priority) -> (placement, granted)
    let cases = [
        (1, High, Front { units: 1 }, 8),
        (8, High, Front { units: 1 }, 8),
        (40, High, Front { units: 5 }, 40),
        (44, High, Front { units: 6 }, 48),
        (120, High, Front { units: 15 }, 120),
        (121, High, Whole, 132), // 16 groups do not exist
        (132, High, Whole, 132),
        (1000, High, Whole, 132),
        (1, Normal, Back { units: 1 }, 20), // a back partition holds a group and the remainder
        (20, Normal, Back { units: 1 }, 20),
        (21, Normal, Back { units: 2 }, 28),
        (80, Normal, Back { units: 9 }, 84),
        (84, Normal, Back { units: 9 }, 84),
        (52, Normal, Back { units: 5 }, 52),
        (124, Normal, Back { units: 14 }, 124),
        (125, Normal, Whole, 132),
        (132, Normal, Whole, 132),
    ];
    for (sms, prio, want, granted) in cases {
        let p = l.place(sms, prio).unwrap();
        assert_eq!(p, want, "{sms} SMs {prio:?}");
        assert_eq!(l.sms(p), granted, "{sms} SMs {prio:?}");
    }
    assert!(l.place(0, High).is_err());
    assert!(l.place(0, Normal).is_err());
    // every request gets at least what it asked (up to the GPU), less than a group more (plus
    // the remainder for the smallest back partitions)
    for sms in 1..=140 {
        for prio in [High, Normal] {
            let g = l.sms(l.place(sms, prio).unwrap());
            assert!(g >= sms.min(l.total), "{sms} {prio:?} -> {g}");
            assert!(g < sms + l.unit + l.remainder, "{sms} {prio:?} -> {g}");
        }
    }
    // the nominal layout (where the driver cannot be asked): 16 x 8 + 4
    let nominal = SmLayout::nominal(132, 8);
    assert_eq!((nominal.units, nominal.remainder), (16, 4));
    assert_eq!(nominal.sms(nominal.place(80, Normal).unwrap()), 84);
    assert_eq!(nominal.sms(nominal.place(128, High).unwrap()), 128);
    // without a remainder, back partitions are whole groups
    let no_rem = SmLayout::nominal(128, 8);
    assert_eq!(no_rem.remainder, 0);
    assert_eq!(no_rem.sms(no_rem.place(84, Normal).unwrap()), 88);
    assert_eq!(no_rem.place(128, Normal).unwrap(), Whole);
}

#[test]
fn decode_and_side_partitions_are_disjoint() {
    use Priority::*;
    let l = H200;
    // every split of the plan's kind (decode a multiple of 8, side the rest, at least a group
    // and the remainder) is disjoint and covers the GPU exactly
    for d in (8..=112).step_by(8) {
        let (a, b) = (l.place(d, High).unwrap(), l.place(132 - d, Normal).unwrap());
        assert!(l.disjoint(a, b), "{d}/{}", 132 - d);
        assert_eq!(l.sms(a) + l.sms(b), 132, "{d}/{}", 132 - d);
        let (ga, gb) = (l.groups(a), l.groups(b));
        assert!(ga.end <= gb.start, "{ga:?} {gb:?}");
    }
    let p = |s, q| l.place(s, q).unwrap();
    assert!(!l.disjoint(p(120, High), p(12, Normal))); // the side gets 20
    assert!(!l.disjoint(p(56, High), p(84, Normal))); // 56 + 84 > 132
    assert!(l.disjoint(p(40, High), p(84, Normal)));
    assert!(!l.disjoint(p(40, High), p(48, High))); // both from the front
    assert!(!l.disjoint(p(12, Normal), p(20, Normal))); // both hold the remainder
    assert!(!l.disjoint(p(40, High), p(132, Normal))); // the whole GPU
}

#[test]
fn cache_keys_follow_the_granted_sms() {
    use Priority::*;
    let l = H200;
    let key = |s, q| (l.place(s, q).unwrap(), q);
    assert_eq!(key(41, High), key(48, High));
    assert_ne!(key(48, High), key(49, High));
    assert_eq!(key(77, Normal), key(84, Normal));
    assert_ne!(key(48, High), key(48, Normal));
    // the whole GPU at two priorities is two streams
    assert_eq!(l.place(500, High).unwrap(), l.place(132, Normal).unwrap());
    assert_ne!(key(500, High), key(132, Normal));
}

// ---------------------------------------------------------------- on a CUDA device

/// Device 0, or a printed skip (a failure with `ROLLPLEX_REQUIRE_GPU=1`).
fn gpu_or_skip() -> Option<Gpu> {
    test_gpu()
}

/// Each block's SM id and its start / end times (globaltimer, ns) after spinning `spin` clocks.
const SM_PROBE: KernelModule = KernelModule {
    name: "sm_probe",
    source: r#"
extern "C" __global__ void sm_probe(unsigned* smid, unsigned long long* t, long long spin) {
  if (threadIdx.x != 0) return;
  unsigned s; asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  unsigned long long t0, t1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  long long c0 = clock64();
  while (clock64() - c0 < spin) {}
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  smid[blockIdx.x] = s;
  t[2 * blockIdx.x] = t0;
  t[2 * blockIdx.x + 1] = t1;
}
"#,
};

struct Probe {
    smid: cudarc::driver::CudaSlice<u32>,
    t: cudarc::driver::CudaSlice<u64>,
}

fn launch_probe(gpu: &Gpu, s: &Arc<CudaStream>, blocks: u32, spin: i64) -> Probe {
    use cudarc::driver::{LaunchConfig, PushKernelArg};
    let f = gpu.function(&SM_PROBE, &[], "sm_probe").unwrap();
    let mut p = Probe {
        smid: s.alloc_zeros::<u32>(blocks as usize).unwrap(),
        t: s.alloc_zeros::<u64>(2 * blocks as usize).unwrap(),
    };
    let mut lb = s.launch_builder(&f);
    lb.arg(&mut p.smid).arg(&mut p.t).arg(&spin);
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the kernel writes blocks entries of smid and 2 * blocks of t, both allocated so.
    unsafe { lb.launch(cfg) }.unwrap();
    p
}

/// (distinct SMs, first start, last end) of a finished probe.
fn probe_result(s: &Arc<CudaStream>, p: &Probe) -> (std::collections::BTreeSet<u32>, u64, u64) {
    let ids = s.clone_dtoh(&p.smid).unwrap();
    let t = s.clone_dtoh(&p.t).unwrap();
    s.synchronize().unwrap();
    let start = t.iter().step_by(2).copied().min().unwrap();
    let end = t.iter().skip(1).step_by(2).copied().max().unwrap();
    (ids.into_iter().collect(), start, end)
}

#[test]
fn kernels_land_on_their_partitions_sms_when_two_run_at_once() {
    let Some(gpu) = gpu_or_skip() else { return };
    let set = StreamSet::new(&gpu).unwrap();
    if !set.green() {
        eprintln!(
            "skipped: green contexts unavailable ({})",
            set.warning().unwrap_or("")
        );
        return;
    }
    eprintln!(
        "layout {:?} (driver split of {} SMs)",
        set.layout(),
        gpu.sm_count()
    );
    assert_eq!(set.total_sms(), gpu.sm_count());
    // the whole GPU: the probe spreads over (nearly) every SM, so the checks below can fail
    let whole = set.partition(gpu.sm_count(), Priority::High).unwrap();
    let p = launch_probe(&gpu, &whole, 2048, 20_000);
    let (all, _, _) = probe_result(&whole, &p);
    eprintln!("whole GPU: {} distinct SMs", all.len());
    assert!(all.len() as u32 > set.total_sms() / 2);
    let total = set.total_sms();
    for d in [40, 48, 64, 80] {
        let side = total - d;
        let (a, b) = (
            set.partition(d, Priority::High).unwrap(),
            set.partition(side, Priority::Normal).unwrap(),
        );
        let (ga, gb) = (
            set.granted(d, Priority::High).unwrap(),
            set.granted(side, Priority::Normal).unwrap(),
        );
        // launched back to back from this thread; each block spins ~1 ms
        let pa = launch_probe(&gpu, &a, 1024, 2_000_000);
        let pb = launch_probe(&gpu, &b, 1024, 2_000_000);
        let (sa, a0, a1) = probe_result(&a, &pa);
        let (sb, b0, b1) = probe_result(&b, &pb);
        eprintln!(
            "decode {d} (granted {ga}): {} SMs; side {side} (granted {gb}): {} SMs; overlap \
             {:.3} ms of {:.3} / {:.3} ms",
            sa.len(),
            sb.len(),
            (a1.min(b1) as f64 - a0.max(b0) as f64) / 1e6,
            (a1 - a0) as f64 / 1e6,
            (b1 - b0) as f64 / 1e6
        );
        assert!(
            sa.len() as u32 <= ga,
            "decode partition on {} SMs",
            sa.len()
        );
        assert!(sb.len() as u32 <= gb, "side partition on {} SMs", sb.len());
        assert!(sa.is_disjoint(&sb), "partitions share SMs");
        assert!(
            a0 < b1 && b0 < a1,
            "the two partitions did not run at the same time"
        );
    }
}

/// A small random model whose ops spread over more SMs than a 40-SM partition has.
fn small_model() -> Qwen25VL {
    let spec = ModelSpec {
        name: "streams-test".into(),
        vision: VisionDims {
            depth: 1,
            hidden_size: 32,
            num_heads: 2,
            intermediate_size: 48,
            patch_size: 4,
            temporal_patch_size: 2,
            spatial_merge_size: 2,
            window_size: 16,
            fullatt_block_indexes: vec![0],
            in_channels: 3,
            out_hidden_size: 512,
        },
        text: TextDims {
            num_layers: 2,
            hidden_size: 512,
            num_heads: 8,
            num_kv_heads: 2,
            intermediate_size: 1376,
            vocab_size: 3001,
            rope_theta: 10000.0,
            mrope_section: [8, 12, 12],
            tie_word_embeddings: false,
            rms_norm_eps: 1e-6,
            max_position_embeddings: 4096,
        },
        tokens: SpecialTokens {
            image_token_id: 2998,
            video_token_id: 2999,
            vision_start_token_id: 2996,
            vision_end_token_id: 2997,
            eos_token_ids: vec![2995],
        },
        dtype: DType::Bf16,
        weights: WeightsSource::Random { seed: 5 },
    };
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
