//! What a task costs, in machine-independent terms: the cost model turns a [`Work`] and an SM
//! share into seconds. The compiler fills one per task from the shapes it lowers; the simulator
//! and the runtime's profiler read them back from the plan.

use serde::{Deserialize, Serialize};

/// The kind of a task, as the cost model distinguishes them (each kind has its own efficiency
/// curve in a profile).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkKind {
    /// Vision tower over media patches (compute-bound).
    VisionEncode,
    /// Prompt prefill of the rollout engine (compute-bound).
    Prefill,
    /// A window of decode steps (memory-bound: weights + KV once per step).
    Decode,
    /// Reference model over the prompt prefix (compute-bound, response-independent).
    RefPrefix,
    /// Reference model over response tokens attending to the kept prefix.
    RefSuffix,
    /// Actor forward over the prompt prefix (old log-probs / first mini-batch).
    ActorPrefixFwd,
    /// Actor forward over response tokens.
    ActorSuffixFwd,
    /// Actor backward (suffix and prefix).
    ActorBwd,
    /// Optimizer step (memory-bound: master weights, moments, grads).
    Optimizer,
    /// Reward computation (host).
    Reward,
    /// Advantage computation (tiny).
    Advantage,
    /// Weight sync from training to rollout layout (copy or reshard).
    WeightSync,
    /// Device <-> host transfer of a buffer (offload / reload).
    Transfer,
}

/// Which way a task's host bytes ([`Work::host_bytes`]) cross the host link: the cost model
/// prices each direction at its own rate ([`crate::plan::Op::host_dir`] is the rule).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum HostDir {
    /// Host to device: a reload, and the host bytes of every task that is not an offload.
    #[default]
    ToDevice,
    /// Device to host: an offload.
    ToHost,
}

/// Machine-independent amount of work of one task.
///
/// `parts` is work of another kind inside the task, priced at that kind's rate: a reference or
/// training prefix that encodes its media itself holds the vision tower's forward (kind
/// `vision_encode`), a micro-batch that trains the tower holds its backward. The amounts above
/// are the task's own work, without its parts; parts do not nest. The YAML form leaves out an
/// empty `parts` (the binary form always carries it).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct Work {
    /// Dense floating-point operations (2 per multiply-add).
    pub flops: f64,
    /// Minimum device-memory traffic, bytes read + written.
    pub bytes: f64,
    /// Sequential dependent steps (decode steps, layers x micro-batches): a latency floor.
    pub steps: u32,
    /// Host <-> device bytes.
    pub host_bytes: f64,
    /// GPU <-> GPU bytes (per GPU).
    pub net_bytes: f64,
    /// Work of other kinds inside the task (see the type's doc).
    #[serde(default)]
    pub parts: Vec<WorkPart>,
}

/// Work of `kind` inside a task of another kind (see [`Work`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkPart {
    pub kind: WorkKind,
    pub work: Work,
}

impl Work {
    /// FLOPs of the task with its parts.
    pub fn total_flops(&self) -> f64 {
        self.flops + self.parts.iter().map(|p| p.work.flops).sum::<f64>()
    }

    /// HBM bytes of the task with its parts.
    pub fn total_bytes(&self) -> f64 {
        self.bytes + self.parts.iter().map(|p| p.work.bytes).sum::<f64>()
    }

    /// `share` of the work, its parts too (a part of a decode window's steps), amounts rounded
    /// to whole numbers as plans print them.
    pub fn scaled(&self, share: f64) -> Work {
        Work {
            flops: (self.flops * share).round(),
            bytes: (self.bytes * share).round(),
            steps: (self.steps as f64 * share).round() as u32,
            host_bytes: (self.host_bytes * share).round(),
            net_bytes: (self.net_bytes * share).round(),
            parts: self
                .parts
                .iter()
                .map(|p| WorkPart {
                    kind: p.kind,
                    work: p.work.scaled(share),
                })
                .collect(),
        }
    }

    /// Every amount of the task and its parts, for validation (finite, >= 0).
    pub fn amounts(&self) -> impl Iterator<Item = f64> + '_ {
        std::iter::once(self)
            .chain(self.parts.iter().map(|p| &p.work))
            .flat_map(|w| [w.flops, w.bytes, w.host_bytes, w.net_bytes])
    }
}

// By hand: a human-readable form (YAML, JSON) leaves out empty `parts`, so that plans and
// profiles without parts read as before; a compact one (the binary plan) always writes every
// field, in order, as it reads them.
impl Serialize for Work {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let with_parts = !serializer.is_human_readable() || !self.parts.is_empty();
        let mut st = serializer.serialize_struct("Work", 5 + with_parts as usize)?;
        st.serialize_field("flops", &self.flops)?;
        st.serialize_field("bytes", &self.bytes)?;
        st.serialize_field("steps", &self.steps)?;
        st.serialize_field("host_bytes", &self.host_bytes)?;
        st.serialize_field("net_bytes", &self.net_bytes)?;
        if with_parts {
            st.serialize_field("parts", &self.parts)?;
        } else {
            st.skip_field("parts")?;
        }
        st.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn work(flops: f64) -> Work {
        Work {
            flops,
            bytes: 2.0 * flops,
            steps: 3,
            host_bytes: 4.0,
            net_bytes: 5.0,
            parts: Vec::new(),
        }
    }

    fn with_part() -> Work {
        Work {
            parts: vec![WorkPart {
                kind: WorkKind::VisionEncode,
                work: work(7.0),
            }],
            ..work(1.0)
        }
    }

    #[test]
    fn yaml_leaves_out_empty_parts_and_reads_them_back() {
        let plain = serde_yaml::to_string(&work(1.0)).unwrap();
        assert!(!plain.contains("parts"), "{plain}");
        assert_eq!(serde_yaml::from_str::<Work>(&plain).unwrap(), work(1.0));
        let mixed = serde_yaml::to_string(&with_part()).unwrap();
        assert!(
            mixed.contains("parts") && mixed.contains("vision_encode"),
            "{mixed}"
        );
        assert_eq!(serde_yaml::from_str::<Work>(&mixed).unwrap(), with_part());
    }

    #[test]
    fn the_binary_form_always_carries_parts() {
        for w in [work(1.0), with_part()] {
            let bytes = postcard::to_allocvec(&(w.clone(), 9u32)).unwrap();
            let back: (Work, u32) = postcard::from_bytes(&bytes).unwrap();
            assert_eq!(back, (w, 9));
        }
    }

    #[test]
    fn totals_count_the_parts() {
        let w = with_part();
        assert_eq!(w.total_flops(), 8.0);
        assert_eq!(w.total_bytes(), 16.0);
        assert_eq!(w.amounts().count(), 8);
    }
}
