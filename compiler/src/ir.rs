//! The compiler's intermediate representation: the types the passes hand each other, at the
//! bottom of the compiler's modules (it uses only the spec analyses `shapes`, `lengths` and
//! `topology`).
//!
//! - the phase graph ([`PhaseGraph`]: [`Node`]s with their [`Role`] and [`SideClass`], the
//!   planned decode windows) that `lower` builds;
//! - logical buffers ([`LogicalBuffer`], by [`BufferRole`]) with each node's reads, writes and
//!   scratch, that `buffers` fills;
//! - placement ([`Placement`], [`ResidencyChoice`]): the decisions of `schedule_serial`,
//!   `schedule_overlap` and `residency`;
//! - the schedule ([`Sched`]: streams, windows, tasks in issue order, buffers after residency)
//!   that `assemble` builds and `sched` times.
//!
//! Module layers, bottom up (a module uses only modules of lower layers; `fixtures`, `diff`,
//! the command line and unit tests stand aside): `error`, `shapes`, `lengths`, `topology`,
//! `sharing`, `workload` (the spec's analyses); `ir`; `lower`; `buffers`; `ilp`; `residency`;
//! `sched`; `assemble`; `schedule_serial`, `schedule_overlap`; `emit`, `memory`; `driver`.
//!
//! [`verify_graph`] and [`verify_sched`] check the invariants each pass relies on; the driver
//! runs them between passes in debug builds, the property tests on every plan they compile.

use crate::lengths::Lengths;
use crate::shapes::Shapes;
use crate::topology::Topology;
use petgraph::graph::{DiGraph, NodeIndex};
use rollplex_plan::spec::JobSpec;
use rollplex_plan::work::{Work, WorkKind};
use rollplex_plan::{BufferClass, BufferRole, GpuId, Op, Phase, Priority, ReshardPoint, Residency};
use std::collections::BTreeMap;

/// A node of the phase graph.
pub type NodeId = NodeIndex<u32>;

/// Defines a typed index into one of the IR's tables, so that an index of one table cannot be
/// used for another (a task index where a stream index is due is a type error). Ids print as
/// the bare index.
macro_rules! table_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub u32);

        impl $name {
            /// The index into the table this id refers to.
            pub fn index(self) -> usize {
                self.0 as usize
            }

            /// The id of the `i`-th element of the table. Tables are bounded by the plan
            /// format's u32 ids; a larger index is a compiler bug, reported as such.
            pub fn from_index(i: usize) -> Self {
                match u32::try_from(i) {
                    Ok(v) => $name(v),
                    Err(_) => panic!("{} index {i} does not fit in u32", stringify!($name)),
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "{}", self.0)
            }
        }
    };
}

table_id!(
    /// A logical buffer: its index in [`PhaseGraph::buffers`].
    LBufId
);
table_id!(
    /// A scheduled task: its index in [`Sched::tasks`] (issue order).
    STaskId
);
table_id!(
    /// A stream: its index in [`Sched::streams`].
    SStreamId
);
table_id!(
    /// A buffer as the plan will hold it: its index in [`Sched::buffers`].
    PBufId
);

impl PBufId {
    /// The id an [`Op::Offload`] / [`Op::Reload`] of the schedule names this buffer by. Inside
    /// a [`Sched`] such an op's plan-typed buffer ids hold schedule buffer indices; `emit`
    /// renumbers them to the plan's buffers.
    pub fn op_id(self) -> rollplex_plan::BufferId {
        rollplex_plan::BufferId(self.0)
    }

    /// The schedule buffer an [`Op::Offload`] / [`Op::Reload`] of the schedule names (the
    /// inverse of [`PBufId::op_id`]).
    pub fn of_op(id: rollplex_plan::BufferId) -> Self {
        PBufId(id.0)
    }
}

/// Kinds of work that overlap mode may move into decode windows. Items of one class are
/// interchangeable in size and run in item order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SideClass {
    RefPrefix,
    OldPrefix,
    TrainPrefix,
    RefSuffix,
    OldSuffix,
    Reward,
    Advantages,
    MicroBatch,
}

impl SideClass {
    /// In the order a side stream runs them within a window (producers first).
    pub const ALL: [SideClass; 8] = [
        SideClass::RefPrefix,
        SideClass::OldPrefix,
        SideClass::TrainPrefix,
        SideClass::Reward,
        SideClass::Advantages,
        SideClass::RefSuffix,
        SideClass::OldSuffix,
        SideClass::MicroBatch,
    ];

    pub fn name(self) -> &'static str {
        match self {
            SideClass::RefPrefix => "ref_prefix",
            SideClass::OldPrefix => "old_prefix",
            SideClass::TrainPrefix => "train_prefix",
            SideClass::RefSuffix => "ref_suffix",
            SideClass::OldSuffix => "old_suffix",
            SideClass::Reward => "reward",
            SideClass::Advantages => "advantages",
            SideClass::MicroBatch => "micro_batch",
        }
    }
}

/// Where scheduling may put a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Before decode, on the rollout program's main stream.
    PreDecode,
    /// Decode window `window`.
    Decode { window: u32 },
    /// In a decode window's side partition (overlap) or after decode.
    Side { class: SideClass, item: u32 },
    /// After decode only.
    Post,
}

#[derive(Clone, Debug)]
pub struct Node {
    pub name: String,
    pub kind: WorkKind,
    pub op: Op,
    pub gpu: GpuId,
    /// The phase the task belongs to when it is not moved into a decode window ([`Op::phase`]).
    pub phase: Phase,
    pub role: Role,
    pub work: Work,
    pub ready_step: u32,
    /// Logical buffers, filled by the buffer pass.
    pub reads: Vec<LBufId>,
    pub writes: Vec<LBufId>,
    /// Transient device bytes the task needs while it runs (filled by the buffer pass).
    pub scratch: u64,
}

/// A planned decode window: steps `first .. first + steps`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowPlan {
    pub first: u32,
    pub steps: u32,
}

pub struct PhaseGraph {
    pub spec: JobSpec,
    pub topo: Topology,
    pub shapes: Shapes,
    pub lengths: Lengths,
    pub graph: DiGraph<Node, (), u32>,
    pub buffers: Vec<LogicalBuffer>,
    pub windows: Vec<WindowPlan>,
    /// Planned decode steps after which completion slot `k` (training replica) has finished.
    pub slot_finish: Vec<u32>,
    /// Whether the reference and actor prefixes read the rollout's encoding (colocated, media,
    /// tower and merger frozen; with or without prefix dedup) instead of encoding their own.
    pub reuses_encoding: bool,
    /// How the actor's weights are shared between the layouts (colocated modes only).
    pub sharing: Option<rollplex_plan::WeightSharing>,
    pub copies: u32,
    /// Text layers whose training activations are kept (the rest recomputed in backward).
    pub kept: KeptLayers,
}

/// Text layers (`0..n`) that keep every training activation for backward; the others keep
/// their layer input and are recomputed there. Two decisions: the micro-batches' response
/// rows, and the prompt rows of the kept prompt forwards (which live from their forward to
/// the last micro-batch that reads them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct KeptLayers {
    pub suffix: u32,
    pub prompt: u32,
}

impl PhaseGraph {
    pub fn node(&self, id: NodeId) -> &Node {
        &self.graph[id]
    }

    pub fn ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.graph.node_indices()
    }

    /// Direct predecessors of `id`, in insertion order.
    pub fn deps(&self, id: NodeId) -> Vec<NodeId> {
        let mut v: Vec<NodeId> = self
            .graph
            .neighbors_directed(id, petgraph::Direction::Incoming)
            .collect();
        v.sort();
        v.dedup();
        v
    }

    pub fn decode_nodes(&self) -> Vec<NodeId> {
        let mut v: Vec<(u32, NodeId)> = self
            .ids()
            .filter_map(|i| match self.graph[i].role {
                Role::Decode { window } => Some((window, i)),
                _ => None,
            })
            .collect();
        v.sort();
        v.into_iter().map(|(_, i)| i).collect()
    }
}

/// How a buffer may be moved to host memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Offload {
    /// Must stay in device memory.
    No,
    /// Never written during the iteration: a host copy stays valid, reload only.
    Frozen,
    /// Written during the iteration: offload writes back, reload reads it.
    Mutable,
}

#[derive(Clone, Debug, PartialEq)]
pub struct LogicalBuffer {
    pub name: String,
    pub role: BufferRole,
    /// The class `role` fixes.
    pub class: BufferClass,
    pub gpu: GpuId,
    pub bytes: u64,
    pub shape: String,
    /// Loop-carried: alive across iterations.
    pub persistent: bool,
    pub offload: Offload,
}

impl PhaseGraph {
    /// The logical buffer of `role` (the table has at most one of each).
    pub fn buffer_with(&self, role: BufferRole) -> Option<LBufId> {
        self.buffers
            .iter()
            .position(|b| b.role == role)
            .map(LBufId::from_index)
    }

    pub fn buffer(&self, id: LBufId) -> &LogicalBuffer {
        &self.buffers[id.index()]
    }
}
/// Where large buffers live outside the phases that use them, and where the weight sync runs
/// (the residency pass decides).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ResidencyChoice {
    /// Reference weights: on host, reloaded before the first reference task.
    pub ref_host: bool,
    /// fp32 master weights and Adam moments: on host, reloaded before the first optimizer
    /// step and written back after the last.
    pub optimizer_host: bool,
    /// With `optimizer_host`: each optimizer step streams the state through the device in
    /// chunks instead (no whole reload or write-back), chunked so.
    pub optimizer_stream: Option<StreamShape>,
    /// `rollout_weights.frozen`: dropped after decode and rebuilt by every weight sync
    /// instead of kept in HBM.
    pub frozen_rebuilt: bool,
    /// Kept prefix states on host: each producer in a decode window
    /// writes its own chunk, offloaded right after it and reloaded after decode.
    pub ref_prefix_host: bool,
    pub old_prefix_host: bool,
    pub train_prefix_host: bool,
    /// Where the colocated weight sync runs.
    pub reshard: ReshardPoint,
    /// Text layers whose training activations are kept (the rest recomputed in backward).
    pub kept: KeptLayers,
    /// Bytes the ILP's decode and training memory rows left below their budgets: by its
    /// estimate. Where the exact layout overshoots, it needs this much more than the estimate
    /// besides the overshoot.
    pub room: RowRoom,
}

/// Bytes per memory row of the residency ILP (decode phase, training phase).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RowRoom {
    pub decode: u64,
    pub train: u64,
}

/// The chunking of a streamed optimizer step ([`rollplex_plan::OptimizerStream`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct StreamShape {
    pub chunk_elems: u64,
    pub chunks: u32,
    pub slots: u32,
}

impl ResidencyChoice {
    /// Whether the kept state `class` produces goes to host.
    pub fn kept_host(&self, class: SideClass) -> bool {
        match class {
            SideClass::RefPrefix => self.ref_prefix_host,
            SideClass::OldPrefix => self.old_prefix_host,
            SideClass::TrainPrefix => self.train_prefix_host,
            _ => false,
        }
    }
}

/// A mode's decisions.
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    /// One stream per GPU program, no windows split (serial, disaggregated).
    pub single_stream: bool,
    /// Per decode window: (decode SMs, side SMs); side 0 = decode has the whole GPU.
    pub splits: Vec<(u32, u32)>,
    /// Side-class nodes moved into a window.
    pub in_window: BTreeMap<NodeId, u32>,
    pub residency: ResidencyChoice,
}

/// Kept prefix states' producer classes and the class that consumes each.
pub const KEPT: [(SideClass, SideClass); 3] = [
    (SideClass::RefPrefix, SideClass::RefSuffix),
    (SideClass::OldPrefix, SideClass::OldSuffix),
    (SideClass::TrainPrefix, SideClass::MicroBatch),
];

/// The role of the buffer a kept-state producer class writes (`None` for other classes).
pub fn kept_role(class: SideClass) -> Option<BufferRole> {
    match class {
        SideClass::RefPrefix => Some(BufferRole::RefPrefixKv),
        SideClass::OldPrefix => Some(BufferRole::OldPrefixKv),
        SideClass::TrainPrefix => Some(BufferRole::TrainPrefix { step: 0 }),
        _ => None,
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct SStream {
    pub gpu: GpuId,
    pub name: &'static str,
    pub priority: Priority,
}

#[derive(Clone, Debug, PartialEq)]
pub struct SWindow {
    pub gpu: GpuId,
    pub first_step: u32,
    pub steps: u32,
    pub decode_stream: SStreamId,
    pub side_stream: SStreamId,
    pub decode_sms: u32,
    pub side_sms: u32,
    pub expected_active: f64,
    pub expected_groups_done: u32,
    pub start: f64,
    pub end: f64,
}

/// A buffer as the plan will hold it (a logical buffer may become a host copy and a device
/// copy when it is offloaded).
#[derive(Clone, Debug, PartialEq)]
pub struct PBuf {
    pub name: String,
    pub role: BufferRole,
    pub class: BufferClass,
    pub gpu: GpuId,
    pub bytes: u64,
    pub shape: String,
    pub persistent: bool,
    pub host: bool,
    /// A device buffer with a pinned-host copy (offloaded, or a kept state's chunk).
    pub host_twin: bool,
    pub residency: Vec<(Phase, Residency)>,
    pub offload: Offload,
}

#[derive(Clone, Debug, PartialEq)]
pub struct STask {
    pub name: String,
    pub kind: WorkKind,
    pub op: Op,
    pub gpu: GpuId,
    /// Effective phase (work moved into a decode window counts as rollout).
    pub phase: Phase,
    pub stream: SStreamId,
    pub window: Option<u32>,
    /// Tasks this one waits for, each earlier in issue order.
    pub deps: Vec<STaskId>,
    pub reads: Vec<PBufId>,
    pub writes: Vec<PBufId>,
    pub work: Work,
    pub scratch: u64,
    pub sms: u32,
    pub ready_step: u32,
    pub start: f64,
    pub end: f64,
}

impl STask {
    /// Whether the task reads or writes `b`.
    pub fn uses(&self, b: PBufId) -> bool {
        self.reads.contains(&b) || self.writes.contains(&b)
    }

    /// Adds dependencies on `more`, keeping `deps` sorted and free of repeats.
    pub fn add_deps(&mut self, more: impl IntoIterator<Item = STaskId>) {
        self.deps.extend(more);
        self.deps.sort_unstable();
        self.deps.dedup();
    }
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Sched {
    pub streams: Vec<SStream>,
    pub windows: Vec<SWindow>,
    pub tasks: Vec<STask>,
    pub buffers: Vec<PBuf>,
    /// Where the colocated weight sync runs (`None`: not colocated).
    pub reshard_point: Option<rollplex_plan::ReshardPoint>,
    /// Whether the sync also rebuilds the frozen rollout extra.
    pub frozen_rebuilt: bool,
    /// The streamed optimizer step, when the residency answer streams the state.
    pub optimizer_stream: Option<rollplex_plan::OptimizerStream>,
}

impl Sched {
    /// The stream `name` of `gpu`'s program, added (with `priority`) if it is not there yet.
    pub fn stream(&mut self, gpu: GpuId, name: &'static str, priority: Priority) -> SStreamId {
        if let Some(i) = self
            .streams
            .iter()
            .position(|s| s.gpu == gpu && s.name == name)
        {
            return SStreamId::from_index(i);
        }
        self.streams.push(SStream {
            gpu,
            name,
            priority,
        });
        SStreamId::from_index(self.streams.len() - 1)
    }

    pub fn task(&self, id: STaskId) -> &STask {
        &self.tasks[id.index()]
    }

    pub fn task_mut(&mut self, id: STaskId) -> &mut STask {
        &mut self.tasks[id.index()]
    }

    pub fn stream_of(&self, id: SStreamId) -> &SStream {
        &self.streams[id.index()]
    }

    pub fn buffer(&self, id: PBufId) -> &PBuf {
        &self.buffers[id.index()]
    }

    /// The ids of the tasks, in issue order.
    pub fn task_ids(&self) -> impl DoubleEndedIterator<Item = STaskId> + ExactSizeIterator {
        (0..self.tasks.len()).map(STaskId::from_index)
    }

    /// The id the next pushed buffer gets.
    pub fn next_buffer(&self) -> PBufId {
        PBufId::from_index(self.buffers.len())
    }

    /// Predicted iteration time: the last end.
    pub fn makespan(&self) -> f64 {
        self.tasks.iter().map(|t| t.end).fold(0.0, f64::max)
    }
}

/// Checks what the passes after `lower` and `buffers` rely on: the graph is acyclic, every
/// buffer a node names is in the table, names and roles of the table are unique, and decode
/// nodes name planned windows.
pub fn verify_graph(pg: &PhaseGraph) -> Result<(), String> {
    if petgraph::algo::is_cyclic_directed(&pg.graph) {
        return Err("the phase graph has a cycle".into());
    }
    let nb = pg.buffers.len();
    for id in pg.ids() {
        let n = pg.node(id);
        if let Some(b) = n.reads.iter().chain(&n.writes).find(|b| b.index() >= nb) {
            return Err(format!("{} names buffer {} of {nb}", n.name, b.0));
        }
        if let Role::Decode { window } = n.role {
            if window as usize >= pg.windows.len() {
                return Err(format!(
                    "{} is in window {window} of {}",
                    n.name,
                    pg.windows.len()
                ));
            }
        }
    }
    for (i, a) in pg.buffers.iter().enumerate() {
        if let Some(b) = pg.buffers[i + 1..]
            .iter()
            .find(|b| b.name == a.name || b.role == a.role)
        {
            return Err(format!(
                "buffers `{}` and `{}` share a name or role",
                a.name, b.name
            ));
        }
    }
    Ok(())
}

/// Checks what `emit` relies on: tasks are in issue order (every dependency earlier), and
/// every stream, window and buffer a task or window names exists, on the task's GPU program.
pub fn verify_sched(s: &Sched) -> Result<(), String> {
    let (ns, nw, nb) = (s.streams.len(), s.windows.len(), s.buffers.len());
    for w in &s.windows {
        for st in [w.decode_stream, w.side_stream] {
            if st.index() >= ns || s.stream_of(st).gpu != w.gpu {
                return Err(format!("a window of {} names stream {st}", w.gpu));
            }
        }
    }
    for (i, t) in s.tasks.iter().enumerate() {
        if let Some(d) = t.deps.iter().find(|d| d.index() >= i) {
            return Err(format!("{} (task {i}) depends on later task {d}", t.name));
        }
        if t.stream.index() >= ns || s.stream_of(t.stream).gpu != t.gpu {
            return Err(format!(
                "{} names stream {} of another program",
                t.name, t.stream
            ));
        }
        if t.window.is_some_and(|w| w as usize >= nw) {
            return Err(format!(
                "{} names a window of {nw} that does not exist",
                t.name
            ));
        }
        if let Some(b) = t.reads.iter().chain(&t.writes).find(|b| b.index() >= nb) {
            return Err(format!("{} names buffer {b} of {nb}", t.name));
        }
    }
    Ok(())
}

#[cfg(test)]
impl STask {
    /// A task of GPU 0 that does nothing, on `stream`, after `deps`: what the schedule tests
    /// move around.
    pub(crate) fn bare(name: &str, stream: SStreamId, deps: Vec<STaskId>) -> STask {
        STask {
            name: name.into(),
            kind: WorkKind::Transfer,
            op: Op::RefSuffix { slot: 0 },
            gpu: GpuId(0),
            phase: Phase::Rollout,
            stream,
            window: None,
            deps,
            reads: vec![],
            writes: vec![],
            work: Work::default(),
            scratch: 0,
            sms: 1,
            ready_step: 0,
            start: 0.0,
            end: 0.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A schedule of two GPU programs with one stream each and `deps` as task 1's dependencies.
    fn sched(deps: Vec<STaskId>) -> Sched {
        let mut s = Sched::default();
        let (g0, g1) = (GpuId(0), GpuId(1));
        let main0 = s.stream(g0, "main", Priority::High);
        s.stream(g1, "main", Priority::High);
        assert_eq!(
            s.stream(g0, "main", Priority::High),
            main0,
            "streams are found again"
        );
        for (name, deps) in [("a", vec![]), ("b", deps)] {
            s.tasks.push(STask::bare(name, main0, deps));
        }
        s
    }

    #[test]
    fn verify_sched_names_what_is_out_of_order_or_of_another_program() {
        assert_eq!(verify_sched(&sched(vec![STaskId(0)])), Ok(()));
        let later = verify_sched(&sched(vec![STaskId(1)])).unwrap_err();
        assert!(later.contains("depends on later task 1"), "{later}");
        let mut s = sched(vec![]);
        s.tasks[1].stream = SStreamId(1);
        let other = verify_sched(&s).unwrap_err();
        assert!(
            other.contains("names stream 1 of another program"),
            "{other}"
        );
        let mut s = sched(vec![]);
        s.tasks[0].reads.push(PBufId(0));
        let missing = verify_sched(&s).unwrap_err();
        assert!(missing.contains("names buffer 0 of 0"), "{missing}");
    }

    #[test]
    fn add_deps_keeps_them_sorted_and_single() {
        let mut s = sched(vec![STaskId(0)]);
        s.task_mut(STaskId(1)).add_deps([STaskId(0), STaskId(0)]);
        assert_eq!(s.task(STaskId(1)).deps, vec![STaskId(0)]);
        assert_eq!(PBufId::of_op(PBufId(7).op_id()), PBufId(7));
    }
}
