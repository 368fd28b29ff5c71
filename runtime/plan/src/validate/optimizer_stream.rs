//! The `optimizer_stream` rule: a streamed optimizer step's staging slots, chunks, host copies
//! and device staging buffers agree with each other and with the optimizer steps of its GPU
//! program, and no reload or offload moves the staging whole.

use super::Checker;
use crate::plan::{BufferClass, BufferRole, Op};

impl Checker<'_> {
    pub(super) fn optimizer_stream(&mut self) {
        let p = self.plan;
        let Some(st) = &p.optimizer_stream else {
            return;
        };
        let bad = |m: String| ("optimizer_stream", m);
        let mut errs = Vec::new();
        if st.gpu.index() >= p.gpus.len() {
            self.err(
                "optimizer_stream",
                format!("streams on {}, not a GPU", st.gpu),
            );
            return;
        }
        if !(2..=3).contains(&st.slots) {
            errs.push(bad(format!("{} staging slots (2 or 3)", st.slots)));
        }
        if st.chunk_elems == 0 {
            errs.push(bad("chunks of 0 parameters".into()));
        }
        let on = |role: BufferRole, class: BufferClass| {
            p.buffers
                .iter()
                .find(|b| b.gpu == st.gpu && b.role == role && b.class == class)
        };
        let host = (
            on(BufferRole::HostCopy, BufferClass::MasterWeights),
            on(BufferRole::HostCopy, BufferClass::OptimizerMoments),
        );
        let dev = (
            on(BufferRole::MasterWeights, BufferClass::MasterWeights),
            on(BufferRole::AdamMoments, BufferClass::OptimizerMoments),
        );
        let steps: Vec<&crate::plan::Task> = p
            .tasks
            .iter()
            .filter(|t| t.gpu == st.gpu && matches!(t.op, Op::OptimizerStep { .. }))
            .collect();
        if steps.is_empty() {
            errs.push(bad(format!("{} runs no optimizer step", st.gpu)));
        }
        match host {
            (Some(hm), Some(hv)) => {
                let total = hm.bytes / 4;
                if hv.bytes != 2 * hm.bytes {
                    errs.push(bad(format!(
                        "host copies of {} B of masters and {} B of moments (twice as many)",
                        hm.bytes, hv.bytes
                    )));
                }
                if st.chunk_elems > 0 && total.div_ceil(st.chunk_elems) != st.chunks as u64 {
                    errs.push(bad(format!(
                        "{} chunks of {} parameters for a state of {total}",
                        st.chunks, st.chunk_elems
                    )));
                }
                for t in &steps {
                    for b in [hm.id, hv.id] {
                        if !t.reads.contains(&b) || !t.writes.contains(&b) {
                            errs.push(bad(format!(
                                "{} `{}` does not read and write the host copy {b}",
                                t.id, t.name
                            )));
                        }
                    }
                }
            }
            _ => errs.push(bad(format!(
                "{} has no host copy of the master weights and the moments",
                st.gpu
            ))),
        }
        match dev {
            (Some(m), Some(v)) => {
                if m.bytes != st.master_bytes() || v.bytes != st.moment_bytes() {
                    errs.push(bad(format!(
                        "staging of {} B of masters and {} B of moments, not {} slots of {} \
                         parameters ({} B and {} B)",
                        m.bytes,
                        v.bytes,
                        st.slots,
                        st.chunk_elems,
                        st.master_bytes(),
                        st.moment_bytes()
                    )));
                }
                for t in p.tasks.iter().filter(|t| t.gpu == st.gpu) {
                    if let Op::Reload { to: b, .. } | Op::Offload { from: b, .. } = t.op {
                        if b == m.id || b == v.id {
                            errs.push(bad(format!(
                                "{} `{}` moves the streamed staging {b} whole",
                                t.id, t.name
                            )));
                        }
                    }
                }
            }
            _ => errs.push(bad(format!(
                "{} has no master weights and moments staging",
                st.gpu
            ))),
        }
        for (rule, m) in errs {
            self.err(rule, m);
        }
    }
}
