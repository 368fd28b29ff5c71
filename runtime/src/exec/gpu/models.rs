//! The models and optimizer that live across iterations, built for a plan, and the checks of a
//! plan against the GPU.

use std::sync::Arc;

use half::bf16;
use rollplex_kernels::cuda::{CudaStream, Gpu};
use rollplex_plan::plan::Plan;
use rollplex_plan::spec::JobSpec;

use super::super::placement::{PlanArena, Role};
use super::super::ExecError;
use crate::gpu::arena::DevBuf;
use crate::gpu::decode::DeviceDecode;
use crate::gpu::train::{GpuTrainer, TrainerPlacement};
use crate::gpu::GpuModel;
use crate::model::Qwen25VL;

/// The models and optimizer that live across iterations on the GPU.
pub struct GpuModels {
    /// The actor: its model is the rollout's, updated in place by each optimizer step.
    pub trainer: GpuTrainer,
    /// The frozen reference (initial actor weights); `None` when the job scores no reference.
    pub reference: Option<GpuModel>,
    /// The stream the models were uploaded on (also evaluation's).
    pub stream: Arc<CudaStream>,
    /// The device arena of the plan the models were built for ([`build_gpu_models_for`]):
    /// the weights, masters and moments lie at its offsets, and the loop places the
    /// iteration's buffers there too; `None`: everything from the memory pool.
    pub arena: Option<PlanArena>,
    /// The rollout's device-resident decode loop (buffers and captured step graphs), made by
    /// the first iteration's decode and kept while the shape allows.
    pub decode: Option<DeviceDecode>,
    /// Declared last: dropped after every buffer above (its drop synchronises the device).
    pub gpu: Gpu,
}

impl GpuModels {
    /// The bits of the actor's weights as the device holds them (bf16 compute copy), for
    /// comparing runs bitwise; synchronises.
    pub fn weight_bits(&self) -> Result<WeightBits, ExecError> {
        let w = &self.trainer.model().weights;
        let s = &self.stream;
        let mut vision: Vec<&DevBuf<bf16>> = vec![&w.patch_embed];
        vision.extend(w.vision.iter().flat_map(block_bufs));
        vision.extend([&w.merger_ln, &w.merger_fc1.w]);
        vision.extend(w.merger_fc1.b.as_ref());
        vision.push(&w.merger_fc2.w);
        vision.extend(w.merger_fc2.b.as_ref());
        let mut text = vec![&w.embed];
        text.extend(w.text.iter().flat_map(block_bufs));
        text.push(&w.final_norm);
        text.extend(w.lm_head.as_ref());
        let bits = |bufs: Vec<&DevBuf<bf16>>| -> Result<Vec<u16>, ExecError> {
            let mut out = Vec::new();
            for b in bufs {
                out.extend(s.clone_dtoh(&**b)?.into_iter().map(|x| x.to_bits()));
            }
            Ok(out)
        };
        let out = WeightBits {
            vision: bits(vision)?,
            text: bits(text)?,
        };
        s.synchronize()?;
        Ok(out)
    }
}

/// The bits of a model's bf16 weights on the device ([`GpuModels::weight_bits`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WeightBits {
    /// The patch embedding, every vision block's norms and linears (weight, bias), the merger.
    pub vision: Vec<u16>,
    /// The token embeddings, every decoder layer's norms and linears, final norm, untied lm
    /// head.
    pub text: Vec<u16>,
}

/// A block's weight buffers: norms, then each linear's weight and bias.
fn block_bufs(b: &crate::gpu::weights::GpuBlock) -> Vec<&DevBuf<bf16>> {
    let mut v = vec![&b.norm1, &b.norm2];
    for l in [&b.qkv, &b.o, &b.gate_up, &b.down] {
        v.push(&l.w);
        v.extend(l.b.as_ref());
    }
    v
}

/// Opens GPU 0 and builds the job's models on it: the actor (random or from its checkpoint,
/// through the CPU model), the trainer around it, and the reference (a copy of the initial
/// actor). Returns once the uploads have finished.
pub fn build_gpu_models(spec: &JobSpec) -> Result<GpuModels, ExecError> {
    build_gpu_models_from(spec, &super::super::host_actor(spec)?)
}

/// [`build_gpu_models`] from the job's initial actor already on the host (`host_actor`), for
/// a caller that keeps it (checkpoints hash it and save through a host copy).
pub fn build_gpu_models_from(spec: &JobSpec, actor: &Qwen25VL) -> Result<GpuModels, ExecError> {
    build_models(spec, actor, None)
}

/// [`build_gpu_models_from`] for `plan`: its device arena is allocated once, first, and the
/// actor's and reference's weights, the fp32 masters and the Adam moments are uploaded at the
/// plan's offsets in it (`exec::placement`); [`run_gpu_loop`] of that plan places the
/// iteration's buffers there too.
pub fn build_gpu_models_for(plan: &Plan, actor: &Qwen25VL) -> Result<GpuModels, ExecError> {
    build_models(&plan.spec, actor, Some(plan))
}

fn build_models(
    spec: &JobSpec,
    actor: &Qwen25VL,
    plan: Option<&Plan>,
) -> Result<GpuModels, ExecError> {
    let gpu = open_gpu()?;
    let stream = gpu.stream(0)?;
    let arena = match plan {
        Some(p) => PlanArena::new(p, &gpu)?,
        None => None,
    };
    let region = |r: Role| arena.as_ref().and_then(|a| a.region(r)).cloned();
    let reference = if spec.reference.enabled {
        let r = region(Role::RefWeights);
        Some(GpuModel::upload_in(&gpu, &stream, actor, r.as_deref())?)
    } else {
        None
    };
    // a streamed optimizer step: the state lives in pinned host memory, the device keeps only
    // the staging chunks
    let program = plan.and_then(|p| p.gpus.first()).map(|g| g.id);
    let optimizer_stream = plan
        .and_then(|p| p.optimizer_stream.as_ref())
        .filter(|st| Some(st.gpu) == program)
        .cloned();
    let trainer = GpuTrainer::new_in(
        &gpu,
        &stream,
        actor,
        super::super::cpu::train_config(spec)?,
        spec.train.optimizer.clone(),
        &TrainerPlacement {
            weights: region(Role::ActorWeights),
            masters: region(Role::Masters),
            moments: region(Role::Moments),
            stream: optimizer_stream,
        },
    )?;
    stream.synchronize()?;
    if let Some(a) = &arena {
        // what the plan keeps on the host between uses starts as it was uploaded
        a.capture(&stream)?;
    }
    Ok(GpuModels {
        trainer,
        reference,
        stream,
        arena,
        decode: None,
        gpu,
    })
}

/// GPU 0, or a message saying why there is none.
pub fn open_gpu() -> Result<Gpu, ExecError> {
    Gpu::new(0).map_err(|e| {
        ExecError::Machine(format!(
            "--backend cuda needs a CUDA GPU: {e} (run a CPU-compiled plan with --backend cpu, or any plan with --backend sim)"
        ))
    })
}

/// Checks that `plan` can run on `gpu` with this executor (one GPU, TP 1, the plan's GPU kind,
/// the plan's device memory available).
pub fn check_gpu_plan(plan: &Plan, gpu: &Gpu) -> Result<(), ExecError> {
    let target = &plan.target;
    if target.gpu.eq_ignore_ascii_case("cpu") {
        return Err(ExecError::Machine(format!(
            "this plan was compiled for the CPU backend's pseudo-GPU: run it with --backend cpu, or compile the \
             pipeline for this GPU ({}) with `gpu {{ preset = {} count = 1 }}` for --backend cuda",
            gpu.name(),
            preset_of(gpu.name()).unwrap_or("<its preset>")
        )));
    }
    if !gpu
        .name()
        .to_ascii_lowercase()
        .contains(&target.gpu.to_ascii_lowercase())
    {
        return Err(ExecError::Machine(format!(
            "this plan was compiled for {} GPUs but this one is {}: its schedule (SM partitions, timings, memory) \
             would not hold here; recompile the pipeline with `gpu {{ preset = {} }}`",
            target.gpu,
            gpu.name(),
            preset_of(gpu.name()).unwrap_or("<this GPU's preset>")
        )));
    }
    if target.count != 1
        || plan.gpus.len() != 1
        || plan.parallel.rollout_tp != 1
        || plan.parallel.train_tp != 1
    {
        return Err(ExecError::Machine(format!(
            "the CUDA executor runs one GPU with TP 1; this plan targets {} x {} ({} GPU programs, rollout TP {}, \
             training TP {}): compile it with `gpu {{ preset = {} count = 1 }}`",
            target.count,
            target.gpu,
            plan.gpus.len(),
            plan.parallel.rollout_tp,
            plan.parallel.train_tp,
            target.gpu
        )));
    }
    let devices = rollplex_kernels::cuda::cuda_available()?;
    if devices < target.count as usize {
        return Err(ExecError::Machine(format!(
            "the plan needs {} GPUs, {devices} present",
            target.count
        )));
    }
    gpu.ctx().bind_to_thread()?;
    let (free, total) = cudarc::driver::result::mem_get_info()?;
    let need = plan.memory.max_peak();
    if need > total as u64 {
        return Err(ExecError::Machine(format!(
            "the plan's device arena peak is {:.1} GiB but {} has {:.1} GiB ({:.1} GiB free): recompile with a \
             smaller batch or memory budget",
            need as f64 / GIB,
            gpu.name(),
            total as f64 / GIB,
            free as f64 / GIB
        )));
    }
    Ok(())
}

/// Checks, before any model is built, that this machine's host memory holds what the run pins
/// there (the plan's host copies: offloaded buffers, a streamed optimizer state) beside the
/// initial actor's fp32 host copy that the device models are built from. Without it a plan
/// compiled for a larger `host_memory` than the machine has is killed by the kernel mid-build.
/// Where the available memory cannot be read (not Linux), nothing is checked.
pub fn check_host_memory(plan: &Plan) -> Result<(), ExecError> {
    match available_host_memory() {
        Some(available) => check_host_memory_against(plan, available),
        None => Ok(()),
    }
}

/// [`check_host_memory`] against `available` bytes.
pub fn check_host_memory_against(plan: &Plan, available: u64) -> Result<(), ExecError> {
    let pinned = plan.memory.host_total();
    let model = plan.spec.actor.param_count().total() * std::mem::size_of::<f32>() as u64;
    let need = pinned + model;
    if need <= available {
        return Ok(());
    }
    Err(ExecError::Machine(format!(
        "the plan pins {:.1} GiB of host memory (its offloaded buffers and host-resident \
         optimizer state) and the models are built from a {:.1} GiB host copy of the actor: \
         {:.1} GiB, but this machine has {:.1} GiB available: recompile with a `host_memory` \
         of at most {:.0}GiB in the pipeline's `schedule` block, or keep more in HBM",
        pinned as f64 / GIB,
        model as f64 / GIB,
        need as f64 / GIB,
        available as f64 / GIB,
        (available.saturating_sub(model) as f64 / GIB).floor()
    )))
}

/// Host memory a new allocation can take: `MemAvailable` from `/proc/meminfo`, capped by the
/// cgroup's limit where one is set (cgroup v2: `memory.max - memory.current`).
fn available_host_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let mut available = meminfo_available(&meminfo)?;
    let read = |f: &str| std::fs::read_to_string(format!("/sys/fs/cgroup/{f}")).ok();
    if let (Some(max), Some(cur)) = (read("memory.max"), read("memory.current")) {
        if let (Ok(max), Ok(cur)) = (max.trim().parse::<u64>(), cur.trim().parse::<u64>()) {
            available = available.min(max.saturating_sub(cur));
        }
    }
    Some(available)
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
pub(super) fn meminfo_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut words = line.split_whitespace().skip(1);
    let kib: u64 = words.next()?.parse().ok()?;
    (words.next() == Some("kB")).then_some(kib * 1024)
}

pub(super) const GIB: f64 = (1u64 << 30) as f64;

/// Device memory the plan does not count and an iteration may hold beyond its arena before the
/// loop warns: the runtime's fixed working buffers (a 32 MiB cuBLASLt workspace per stream,
/// decode attention workspaces, upload staging), about 0.3-0.5 GiB measured with the tiny
/// pipeline, whose plan arena is a few MiB.
pub(super) const WORKSPACE_ALLOWANCE: u64 = 1 << 30;

/// The DSL preset of a device name (`gpu { preset = .. }`), when there is one.
pub fn preset_of(name: &str) -> Option<&'static str> {
    let n = name.to_ascii_uppercase();
    ["H200", "H100", "H800", "A100"]
        .into_iter()
        .find(|p| n.contains(p))
}
