//! The structural rules: `ids` (table ids, stored ids in range, unique names; checked first and
//! alone, as the other rules index tables with stored ids), `streams` (tasks, streams and decode
//! windows on one GPU; one decode task per window) and `sms` (SM splits of windows, streams and
//! tasks).

use super::{op_buffers, Checker};
use crate::plan::{Lifetime, Op};

impl Checker<'_> {
    pub(super) fn ids(&mut self) {
        let p = self.plan;
        let (ng, ns, nw, nt, nb, na) = (
            p.gpus.len(),
            p.streams.len(),
            p.windows.len(),
            p.tasks.len(),
            p.buffers.len(),
            p.memory.arenas.len(),
        );
        macro_rules! check_table {
            ($table:expr, $what:literal) => {
                for (i, x) in $table.iter().enumerate() {
                    if x.id.index() != i {
                        self.err(
                            "ids",
                            format!(concat!($what, " at index {} has id {}"), i, x.id),
                        );
                    }
                }
            };
        }
        check_table!(p.gpus, "gpu");
        check_table!(p.streams, "stream");
        check_table!(p.windows, "window");
        check_table!(p.tasks, "task");
        check_table!(p.buffers, "buffer");
        check_table!(p.memory.arenas, "arena");
        for s in &p.streams {
            if s.gpu.index() >= ng {
                self.err(
                    "ids",
                    format!("{} is on {}, which does not exist", s.id, s.gpu),
                );
            }
        }
        for w in &p.windows {
            if w.gpu.index() >= ng || w.decode_stream.index() >= ns || w.side_stream.index() >= ns {
                self.err("ids", format!("{} refers to a missing gpu or stream", w.id));
            }
        }
        for t in &p.tasks {
            if t.gpu.index() >= ng || t.stream.index() >= ns {
                self.err(
                    "ids",
                    format!("{} `{}` refers to a missing gpu or stream", t.id, t.name),
                );
            }
            if let Some(w) = t.window {
                if w.index() >= nw {
                    self.err(
                        "ids",
                        format!("{} `{}` is in {w}, which does not exist", t.id, t.name),
                    );
                }
            }
            for d in &t.deps {
                if d.index() >= nt {
                    self.err(
                        "ids",
                        format!("{} `{}` depends on {d}, which does not exist", t.id, t.name),
                    );
                }
            }
            for b in t
                .reads
                .iter()
                .chain(&t.writes)
                .chain(op_buffers(&t.op).iter())
            {
                if b.index() >= nb {
                    self.err(
                        "ids",
                        format!("{} `{}` uses {b}, which does not exist", t.id, t.name),
                    );
                }
            }
        }
        for b in &p.buffers {
            if b.gpu.index() >= ng || b.arena.index() >= na {
                self.err(
                    "ids",
                    format!("{} `{}` refers to a missing gpu or arena", b.id, b.name),
                );
            }
            if let Lifetime::Tasks { first, last } = b.lifetime {
                if first.index() >= nt || last.index() >= nt {
                    self.err(
                        "ids",
                        format!("{} `{}` has a lifetime naming a missing task", b.id, b.name),
                    );
                }
            }
        }
        for a in &p.memory.arenas {
            if a.gpu.index() >= ng {
                self.err(
                    "ids",
                    format!("{} is on {}, which does not exist", a.id, a.gpu),
                );
            }
        }
        for m in &p.memory.gpus {
            if m.gpu.index() >= ng || m.live_peak_at.index() >= nt.max(1) {
                self.err(
                    "ids",
                    format!("memory entry of {} refers to a missing gpu or task", m.gpu),
                );
            }
        }
        for r in &p.reshards {
            if r.task.index() >= nt {
                self.err(
                    "ids",
                    format!("a reshard names {}, which does not exist", r.task),
                );
            }
        }
        let mut names = std::collections::HashSet::new();
        for t in &p.tasks {
            if !names.insert(t.name.as_str()) {
                self.err("ids", format!("task name `{}` is used twice", t.name));
            }
        }
        let mut names = std::collections::HashSet::new();
        for b in &p.buffers {
            if !names.insert(b.name.as_str()) {
                self.err("ids", format!("buffer name `{}` is used twice", b.name));
            }
        }
    }

    pub(super) fn streams(&mut self) {
        let p = self.plan;
        let mut decode_tasks = vec![0u32; p.windows.len()];
        for t in &p.tasks {
            let s = &p.streams[t.stream.index()];
            if s.gpu != t.gpu {
                self.err(
                    "streams",
                    format!(
                        "{} `{}` is on {} but its stream {} is on {}",
                        t.id, t.name, t.gpu, s.id, s.gpu
                    ),
                );
            }
            let is_decode = matches!(t.op, Op::DecodeWindow { .. });
            match t.window {
                Some(wid) => {
                    let w = &p.windows[wid.index()];
                    if w.gpu != t.gpu {
                        self.err(
                            "streams",
                            format!(
                                "{} `{}` is on {} but its window {wid} is on {}",
                                t.id, t.name, t.gpu, w.gpu
                            ),
                        );
                    }
                    if t.stream != w.decode_stream && t.stream != w.side_stream {
                        self.err(
                            "streams",
                            format!(
                                "{} `{}` is in {wid} but on {}, neither of its streams",
                                t.id, t.name, t.stream
                            ),
                        );
                    }
                    if is_decode {
                        decode_tasks[wid.index()] += 1;
                        if t.stream != w.decode_stream {
                            self.err(
                                "streams",
                                format!(
                                    "decode task {} is not on the decode stream of {wid}",
                                    t.id
                                ),
                            );
                        }
                    }
                }
                None if is_decode => {
                    self.err(
                        "streams",
                        format!("decode task {} `{}` has no window", t.id, t.name),
                    );
                }
                None => {}
            }
        }
        for (i, n) in decode_tasks.iter().enumerate() {
            if *n != 1 {
                self.err(
                    "streams",
                    format!("win{i} has {n} decode tasks, expected exactly 1"),
                );
            }
        }
    }

    pub(super) fn sms(&mut self) {
        let p = self.plan;
        let (total, gran) = (p.target.sms, p.target.sm_granularity.max(1));
        for s in &p.streams {
            if s.sms == 0 || s.sms > total {
                self.err(
                    "sms",
                    format!("{} has {} SMs; the GPU has {total}", s.id, s.sms),
                );
            }
        }
        for w in &p.windows {
            let ok_decode = w.decode_sms > 0
                && w.decode_sms <= total
                && (w.decode_sms % gran == 0 || (w.side_sms == 0 && w.decode_sms == total));
            if !ok_decode {
                self.err(
                    "sms",
                    format!(
                        "{} gives decode {} SMs: not a positive multiple of {gran} within {total}",
                        w.id, w.decode_sms
                    ),
                );
            }
            let rest = total.saturating_sub(w.decode_sms);
            if w.decode_sms.saturating_add(w.side_sms) > total {
                self.err(
                    "sms",
                    format!(
                        "{} splits {} + {} SMs, more than the GPU's {total}",
                        w.id, w.decode_sms, w.side_sms
                    ),
                );
            } else if w.side_sms != 0 && w.side_sms % gran != 0 && w.side_sms != rest {
                self.err("sms", format!("{} gives side work {} SMs: not a multiple of {gran} nor the remaining {rest}", w.id, w.side_sms));
            }
        }
        for t in &p.tasks {
            if t.sms > total {
                self.err(
                    "sms",
                    format!(
                        "{} `{}` assumes {} SMs; the GPU has {total}",
                        t.id, t.name, t.sms
                    ),
                );
            }
            if let Some(wid) = t.window {
                let w = &p.windows[wid.index()];
                let cap = if t.stream == w.decode_stream {
                    w.decode_sms
                } else {
                    w.side_sms
                };
                if t.sms > cap {
                    self.err(
                        "sms",
                        format!(
                            "{} `{}` assumes {} SMs in {wid}, whose share is {cap}",
                            t.id, t.name, t.sms
                        ),
                    );
                }
            }
        }
    }
}
