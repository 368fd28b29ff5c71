//! The plan's streams as CUDA streams, on SM partitions inside decode windows.

use std::sync::Arc;

use rollplex_kernels::cuda::{CudaStream, Gpu};
use rollplex_plan::plan::{Op, Plan, Priority, Task};
use rollplex_plan::StreamId;

use super::super::ExecError;
use crate::gpu::streams::{Priority as PartPriority, StreamOptions, StreamSet};

/// The plan's streams of one GPU program as CUDA streams. Outside decode windows a task runs
/// on its plan stream's own CUDA stream (`High` priority: the device's most urgent; `Normal`:
/// the least), on the whole GPU. Inside a window, its decode task runs on the window's decode
/// partition (`decode_sms` SMs) and its side tasks on the side partition (`side_sms`), from
/// [`StreamSet`] (green contexts; prioritised plain streams where those are unavailable).
pub struct PlanStreams {
    streams: Vec<Option<Arc<CudaStream>>>,
    /// Per window: (decode, side) partition streams.
    windows: Vec<Option<(Arc<CudaStream>, Arc<CudaStream>)>>,
    set: StreamSet,
}

impl PlanStreams {
    /// [`PlanStreams::with_options`] with the default options (green contexts where available).
    pub fn new(plan: &Plan, gpu: &Gpu) -> Result<Self, ExecError> {
        Self::with_options(plan, gpu, StreamOptions::default())
    }

    /// The plan's streams, the decode windows' partitions made as `options` say.
    pub fn with_options(plan: &Plan, gpu: &Gpu, options: StreamOptions) -> Result<Self, ExecError> {
        let set = StreamSet::with_options(gpu, options)?;
        let (least, most_urgent) = gpu.priority_range()?;
        let mut streams = vec![None; plan.streams.len()];
        let program = plan.gpus[0].id;
        for s in plan.streams.iter().filter(|s| s.gpu == program) {
            let prio = match s.priority {
                Priority::High => most_urgent,
                Priority::Normal => least,
            };
            streams[s.id.index()] = Some(gpu.stream(prio)?);
        }
        let total = set.total_sms();
        let mut windows = vec![None; plan.windows.len()];
        for w in plan.windows.iter().filter(|w| w.gpu == program) {
            // side_sms == 0: decode has the whole GPU (no side work in the window)
            let (d, sd) = if w.side_sms == 0 {
                (total, total)
            } else {
                (w.decode_sms, w.side_sms)
            };
            windows[w.id.index()] = Some((
                set.partition(d, PartPriority::High)?,
                set.partition(sd, PartPriority::Normal)?,
            ));
        }
        Ok(PlanStreams {
            streams,
            windows,
            set,
        })
    }

    pub fn get(&self, id: StreamId) -> Result<&Arc<CudaStream>, ExecError> {
        self.streams
            .get(id.index())
            .and_then(Option::as_ref)
            .ok_or_else(|| ExecError::Plan(format!("{id} is not a stream of GPU program 0")))
    }

    /// Every CUDA stream of the plan's tasks (plan streams and window partitions).
    pub fn all(&self) -> impl Iterator<Item = &Arc<CudaStream>> {
        self.streams.iter().flatten().chain(
            self.windows
                .iter()
                .flatten()
                .flat_map(|(d, s)| [d, s].into_iter()),
        )
    }

    /// Whether windows run on real SM partitions (green contexts).
    pub fn green(&self) -> bool {
        self.set.green()
    }

    /// The CUDA stream `task` runs on (see the type's docs).
    pub fn for_task(&self, plan: &Plan, task: &Task) -> Result<Arc<CudaStream>, ExecError> {
        let Some(w) = task.window else {
            return Ok(self.get(task.stream)?.clone());
        };
        let window = plan
            .windows
            .get(w.index())
            .ok_or_else(|| ExecError::Plan(format!("{} names unknown {w}", task.id)))?;
        let (decode, side) = self
            .windows
            .get(w.index())
            .and_then(Option::as_ref)
            .ok_or_else(|| ExecError::Plan(format!("{w} is not a window of GPU program 0")))?;
        Ok(if task.stream == window.decode_stream {
            decode.clone()
        } else {
            side.clone()
        })
    }
}

/// Whether the host waits for the device inside this op (see the module docs).
pub fn blocks_host(op: &Op) -> bool {
    matches!(
        op,
        Op::DecodeWindow { .. } | Op::TrainMicroBatch { .. } | Op::OptimizerStep { .. }
    )
}
