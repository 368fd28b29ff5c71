//! AdamW with fp32 master weights and moments, gradient accumulation in a fixed order, global
//! grad-norm clipping and learning-rate schedules.
//!
//! Layout ("one buffer, carved by a table"): an [`OptTable`] lists the trainable tensors (name,
//! shape, whether they decay) with two offsets: into the model-sized gradient and compute-copy
//! buffers (the model's [`ParamTable`] offsets; frozen tensors keep their place there), and into
//! the optimizer's dense state buffers (master weights, first and second moments: one flat f32
//! buffer each, trainable tensors only). The compute copy (bf16 on the GPU, f32 on the CPU)
//! lives with the model; after each step the optimizer hands every updated master tensor to a
//! callback that writes the compute copy.
//!
//! The update is torch.optim.AdamW's (`_single_tensor_adamw`, amsgrad off), in f32, op by op:
//! ```text
//! p  = p * (1 - lr*wd)                      (only tensors that decay)
//! m  = lerp(m, g, 1 - beta1)
//! v  = v * beta2 + (1 - beta2) * g * g
//! p  = p + (-lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//! ```
//! with `t` the 1-based step count. Weight decay is decoupled and skipped for norms and biases
//! ([`default_decay`]: tensors of rank < 2, or whose name says norm or bias).
//!
//! Accumulation ([`GradAccumulator`]): micro-batch `i`'s gradient is computed whole, then
//! added element by element as `acc = acc + g_i` for `i = 0, 1, ..` in the plan's order; an
//! out-of-order micro-batch is refused, so the sum is bitwise the same whatever order the
//! micro-batches finished in.
//!
//! Clipping ([`clip_grad_norm`]): the norm is `sqrt(Σ g²)` summed in f64 over tensors in table
//! order, elements in order; like torch, grads are multiplied by `min(1, max / (norm + 1e-6))`.
//! A non-finite norm is an error and leaves weights and moments untouched.

use rollplex_plan::spec::{AdamWSpec, LrSchedule};
use rollplex_plan::OptimizerStream;

use super::{check_len, Result, TrainError};
use crate::model::ParamTable;

/// One trainable tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct OptParam {
    pub name: String,
    pub shape: Vec<usize>,
    pub numel: usize,
    /// First element in the gradient and compute-copy buffers (the model's own offsets).
    pub offset: usize,
    /// First element in the optimizer's master / moment buffers (dense over trainable tensors).
    pub state_offset: usize,
    /// Whether weight decay applies.
    pub decay: bool,
}

/// The trainable tensors, in a fixed order: where each lies in the model-sized gradient and
/// compute buffers, and in the optimizer's own dense state buffers.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OptTable {
    params: Vec<OptParam>,
    /// Elements of the gradient / compute buffers (frozen tensors included).
    buffer_len: usize,
    /// Elements of each state buffer (trainable tensors only).
    state_len: usize,
}

/// Whether a tensor gets weight decay: matrices do, norms and biases (rank < 2, or named so)
/// do not.
pub fn default_decay(name: &str, shape: &[usize]) -> bool {
    let module = name.rsplit('.').nth(1).unwrap_or("");
    shape.len() >= 2
        && !name.ends_with("bias")
        && !module.contains("norm")
        && !module.starts_with("ln")
}

impl OptTable {
    /// A table over a buffer that holds exactly these tensors, in this order, all trainable;
    /// decay decided by [`default_decay`].
    pub fn dense<S: Into<String>>(
        tensors: impl IntoIterator<Item = (S, Vec<usize>)>,
    ) -> Result<Self> {
        let mut t = OptTable::default();
        for (name, shape) in tensors {
            let name = name.into();
            let decay = default_decay(&name, &shape);
            let offset = t.buffer_len;
            t.push(name, shape, offset, decay)?;
            t.buffer_len = t.params.last().map_or(0, |p| p.offset + p.numel);
        }
        Ok(t)
    }

    /// The trainable subset of a model's parameter table (`trainable(name)` decides), with the
    /// model's offsets; decay by [`default_decay`].
    pub fn from_model(table: &ParamTable, trainable: impl Fn(&str) -> bool) -> Result<Self> {
        let mut t = OptTable {
            buffer_len: table.total(),
            ..Default::default()
        };
        for e in table.entries() {
            if trainable(&e.name) {
                t.push(
                    e.name.clone(),
                    e.shape.clone(),
                    e.offset,
                    default_decay(&e.name, &e.shape),
                )?;
            }
        }
        Ok(t)
    }

    /// Appends a trainable tensor at `offset` of the gradient / compute buffers.
    pub fn push(
        &mut self,
        name: String,
        shape: Vec<usize>,
        offset: usize,
        decay: bool,
    ) -> Result<()> {
        if self.params.iter().any(|e| e.name == name) {
            return Err(TrainError::Invalid(format!(
                "parameter `{name}` is listed twice"
            )));
        }
        let numel = shape.iter().product();
        if let Some(o) = self
            .params
            .iter()
            .find(|p| offset < p.offset + p.numel && p.offset < offset + numel)
        {
            return Err(TrainError::Invalid(format!(
                "parameter `{name}` overlaps `{}` in the buffer",
                o.name
            )));
        }
        self.params.push(OptParam {
            name,
            shape,
            numel,
            offset,
            state_offset: self.state_len,
            decay,
        });
        self.state_len += numel;
        self.buffer_len = self.buffer_len.max(offset + numel);
        Ok(())
    }

    pub fn params(&self) -> &[OptParam] {
        &self.params
    }
    pub fn find(&self, name: &str) -> Option<&OptParam> {
        self.params.iter().find(|p| p.name == name)
    }
    /// Elements of the gradient / compute buffers this table carves.
    pub fn buffer_len(&self) -> usize {
        self.buffer_len
    }
    /// Elements of each optimizer state buffer.
    pub fn state_len(&self) -> usize {
        self.state_len
    }
    /// Trainable elements.
    pub fn numel(&self) -> usize {
        self.state_len
    }
}

/// The learning rate of optimizer step `step` (0-based: the number of steps already taken).
///
/// Same lambdas as veRL / transformers: linear warmup `base * step / warmup` (so step 0 trains
/// with lr 0) then constant; cosine `min + (1 - min) * step / warmup` during warmup, then
/// `max(min, min + (1 - min) * (1 + cos(π p)) / 2)` with `p = (step - warmup) / (total - warmup)`,
/// all times `base` (`min` is `min_lr_ratio`). Unlike those, `p` stops at 1: past `total_steps`
/// the rate stays at the floor instead of rising along the cosine again.
pub fn lr_at(spec: &AdamWSpec, step: u64) -> f64 {
    let s = step as f64;
    let factor = match spec.lr_schedule {
        LrSchedule::Constant => 1.0,
        LrSchedule::LinearWarmup { warmup_steps } => {
            if step < warmup_steps as u64 {
                s / (warmup_steps.max(1) as f64)
            } else {
                1.0
            }
        }
        LrSchedule::Cosine {
            warmup_steps,
            total_steps,
            min_lr_ratio,
        } => {
            let min = min_lr_ratio;
            if step < warmup_steps as u64 {
                min + (1.0 - min) * s / (warmup_steps.max(1) as f64)
            } else {
                let span = total_steps.saturating_sub(warmup_steps).max(1) as f64;
                let p = ((s - warmup_steps as f64) / span).min(1.0);
                let x = (std::f64::consts::PI * p).cos();
                (x * (1.0 - min) * 0.5 + (1.0 + min) * 0.5).max(min)
            }
        }
    };
    spec.lr * factor
}

/// Checks an [`AdamWSpec`] for values the update cannot use.
pub fn validate_spec(spec: &AdamWSpec) -> Result<()> {
    let bad = |what: &str, v: f64, why: &str| {
        Err(TrainError::Invalid(format!("AdamW {what} = {v}: {why}")))
    };
    if !(spec.lr >= 0.0 && spec.lr.is_finite()) {
        return bad("lr", spec.lr, "must be finite and >= 0");
    }
    if !(0.0..1.0).contains(&spec.beta1) {
        return bad("beta1", spec.beta1, "must lie in [0, 1)");
    }
    if !(0.0..1.0).contains(&spec.beta2) {
        return bad("beta2", spec.beta2, "must lie in [0, 1)");
    }
    if !(spec.eps > 0.0 && spec.eps.is_finite()) {
        return bad("eps", spec.eps, "must be finite and > 0");
    }
    if !(spec.weight_decay >= 0.0 && spec.weight_decay.is_finite()) {
        return bad("weight_decay", spec.weight_decay, "must be finite and >= 0");
    }
    if spec.grad_clip.is_nan() || spec.grad_clip < 0.0 {
        return bad(
            "grad_clip",
            spec.grad_clip,
            "must be >= 0 (0 disables clipping)",
        );
    }
    if let LrSchedule::Cosine { min_lr_ratio, .. } = spec.lr_schedule {
        if !(0.0..=1.0).contains(&min_lr_ratio) {
            return bad("min_lr_ratio", min_lr_ratio, "must lie in [0, 1]");
        }
    }
    Ok(())
}

/// Sums micro-batch gradients in a fixed order (see the module doc).
#[derive(Clone, Debug)]
pub struct GradAccumulator {
    grads: Vec<f32>,
    /// Micro-batches added since the last [`GradAccumulator::reset`].
    added: u32,
}

impl GradAccumulator {
    /// A zeroed accumulator for gradient buffers of `buffer_len` elements
    /// ([`OptTable::buffer_len`]).
    pub fn new(buffer_len: usize) -> Self {
        GradAccumulator {
            grads: vec![0.0; buffer_len],
            added: 0,
        }
    }

    /// Adds micro-batch `index`'s whole gradient (a flat buffer of the table). `index` must be
    /// the next one in the plan's order (0 after a reset).
    pub fn add(&mut self, index: u32, micro_grads: &[f32]) -> Result<()> {
        if index != self.added {
            return Err(TrainError::Invalid(format!(
                "micro-batch {index} arrived for accumulation, but micro-batch {} is next: accumulate in plan order \
                 (hold a finished micro-batch until its predecessor is added)",
                self.added
            )));
        }
        check_len("micro-batch gradient", self.grads.len(), micro_grads.len())?;
        for (a, &g) in self.grads.iter_mut().zip(micro_grads) {
            *a += g;
        }
        self.added += 1;
        Ok(())
    }

    /// Micro-batches accumulated since the last reset.
    pub fn count(&self) -> u32 {
        self.added
    }
    pub fn grads(&self) -> &[f32] {
        &self.grads
    }
    pub fn grads_mut(&mut self) -> &mut [f32] {
        &mut self.grads
    }
    /// Zeroes the sum for the next optimizer step.
    pub fn reset(&mut self) {
        self.grads.iter_mut().for_each(|g| *g = 0.0);
        self.added = 0;
    }
}

/// Global L2 norm of the trainable tensors of `grads` (f64, tensors in table order, elements in
/// order), then torch's scaling by `min(1, max_norm / (norm + 1e-6))`. Returns the norm before
/// clipping. `max_norm == 0` only measures.
pub fn clip_grad_norm(table: &OptTable, grads: &mut [f32], max_norm: f64) -> Result<f64> {
    check_len("gradient buffer", table.buffer_len(), grads.len())?;
    let mut sq = 0.0f64;
    for p in table.params() {
        for &g in &grads[p.offset..p.offset + p.numel] {
            sq += (g as f64) * (g as f64);
        }
    }
    let norm = sq.sqrt();
    if !norm.is_finite() {
        let culprit = first_non_finite(table, grads)
            .map(|p| p.name.clone())
            .unwrap_or_else(|| "(overflow of the sum)".into());
        return Err(TrainError::Invalid(format!(
            "gradient norm is not finite (first non-finite tensor: {culprit}); the optimizer step was not taken"
        )));
    }
    if max_norm > 0.0 {
        let coef = (max_norm / (norm + 1e-6)).min(1.0) as f32;
        for p in table.params() {
            grads[p.offset..p.offset + p.numel]
                .iter_mut()
                .for_each(|g| *g *= coef);
        }
    }
    Ok(norm)
}

/// The first trainable tensor (table order) with a non-finite gradient: what an error about a
/// non-finite grad norm names.
pub fn first_non_finite<'t>(table: &'t OptTable, grads: &[f32]) -> Option<&'t OptParam> {
    table.params().iter().find(|p| {
        grads[p.offset..p.offset + p.numel]
            .iter()
            .any(|g| !g.is_finite())
    })
}

/// What one optimizer step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepReport {
    /// 1-based count of steps taken, including this one.
    pub step: u64,
    pub lr: f64,
    /// Global grad norm before clipping.
    pub grad_norm: f64,
}

/// AdamW state: master weights, moments, step count.
#[derive(Clone, Debug)]
pub struct AdamW {
    spec: AdamWSpec,
    table: OptTable,
    /// fp32 master weights `[table.state_len()]`, carved by `state_offset`.
    master: Vec<f32>,
    /// First moment, same carving.
    m: Vec<f32>,
    /// Second moment, same carving.
    v: Vec<f32>,
    /// Steps taken.
    step: u64,
}

impl AdamW {
    /// Starts from the compute copy's weights (`compute`: a buffer of `table.buffer_len()`).
    pub fn new(spec: AdamWSpec, table: OptTable, compute: &[f32]) -> Result<Self> {
        validate_spec(&spec)?;
        check_len("compute weights", table.buffer_len(), compute.len())?;
        let mut master = vec![0.0f32; table.state_len()];
        for p in table.params() {
            master[p.state_offset..p.state_offset + p.numel]
                .copy_from_slice(&compute[p.offset..p.offset + p.numel]);
        }
        let n = table.state_len();
        Ok(AdamW {
            spec,
            table,
            master,
            m: vec![0.0; n],
            v: vec![0.0; n],
            step: 0,
        })
    }

    pub fn table(&self) -> &OptTable {
        &self.table
    }
    pub fn spec(&self) -> &AdamWSpec {
        &self.spec
    }
    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.step
    }
    /// The master weights of one tensor.
    pub fn master(&self, p: &OptParam) -> &[f32] {
        &self.master[p.state_offset..p.state_offset + p.numel]
    }
    /// The flat (master, first moment, second moment) buffers, for checkpoints.
    pub fn state(&self) -> (&[f32], &[f32], &[f32]) {
        (&self.master, &self.m, &self.v)
    }
    /// Restores a checkpointed state (buffers as [`AdamW::state`] returned them).
    pub fn restore(&mut self, master: &[f32], m: &[f32], v: &[f32], step: u64) -> Result<()> {
        let n = self.table.state_len();
        check_len("master weights", n, master.len())?;
        check_len("first moment", n, m.len())?;
        check_len("second moment", n, v.len())?;
        self.master.copy_from_slice(master);
        self.m.copy_from_slice(m);
        self.v.copy_from_slice(v);
        self.step = step;
        Ok(())
    }

    /// One optimizer step with the accumulated gradients: clip (in place), update master
    /// weights and moments, then `write_compute(param, master)` for every trainable tensor in
    /// table order (the GPU casts to bf16 there). On error nothing was changed.
    pub fn step(
        &mut self,
        grads: &mut [f32],
        write_compute: impl FnMut(&OptParam, &[f32]),
    ) -> Result<StepReport> {
        self.step_with(grads, None, write_compute)
    }

    /// [`AdamW::step`], the state streamed as the plan's `stream` says when given: the masters
    /// and moments here stay the source of truth, each chunk is copied into a staging slot,
    /// updated there and written back (the plan's fixed order, [`OptimizerStream`]; its
    /// `gpu` and `chunks` are the plan's business, the chunks here follow from the table's
    /// state length). AdamW is elementwise and
    /// the clip is computed over every gradient first, so the numbers are bitwise the same.
    pub fn step_with(
        &mut self,
        grads: &mut [f32],
        stream: Option<&OptimizerStream>,
        mut write_compute: impl FnMut(&OptParam, &[f32]),
    ) -> Result<StepReport> {
        let grad_norm = clip_grad_norm(&self.table, grads, self.spec.grad_clip)?;
        let lr = lr_at(&self.spec, self.step);
        self.step += 1;
        let t = self.step as f64;
        let (b1, b2) = (self.spec.beta1, self.spec.beta2);
        let k = Update {
            decay_mul: (1.0 - lr * self.spec.weight_decay) as f32,
            w1: (1.0 - b1) as f32,
            b2f: b2 as f32,
            one_minus_b2: (1.0 - b2) as f32,
            neg_step_size: (-(lr / (1.0 - b1.powf(t)))) as f32,
            bc2_sqrt: ((1.0 - b2.powf(t)).sqrt()) as f32,
            eps: self.spec.eps as f32,
        };
        let decays = self.spec.weight_decay != 0.0;
        match stream {
            None => {
                for prm in self.table.params() {
                    let r = prm.state_offset..prm.state_offset + prm.numel;
                    k.apply(
                        &mut self.master[r.clone()],
                        &mut self.m[r.clone()],
                        &mut self.v[r],
                        &grads[prm.offset..prm.offset + prm.numel],
                        prm.decay && decays,
                    );
                    write_compute(
                        prm,
                        &self.master[prm.state_offset..prm.state_offset + prm.numel],
                    );
                }
            }
            Some(c) => self.streamed(grads, c, &k, decays, &mut write_compute)?,
        }
        Ok(StepReport {
            step: self.step,
            lr,
            grad_norm,
        })
    }

    /// The streamed update: chunk `k + 1` is copied into its slot (once the chunk that last
    /// used it, `k + 1 - slots`, is written back), chunk `k` is updated in its slot, chunk
    /// `k - 1` is written back; each tensor's compute copy is written once its last chunk is
    /// back, in table order.
    fn streamed(
        &mut self,
        grads: &[f32],
        c: &OptimizerStream,
        k: &Update,
        decays: bool,
        write_compute: &mut impl FnMut(&OptParam, &[f32]),
    ) -> Result<()> {
        let n = self.table.state_len();
        if c.chunk_elems == 0 || c.slots < 2 {
            return Err(TrainError::Invalid(format!(
                "a streamed optimizer step of {} parameters a chunk through {} slots",
                c.chunk_elems, c.slots
            )));
        }
        let (ce, slots) = (c.chunk_elems as usize, c.slots as usize);
        let count = n.div_ceil(ce);
        let range = |i: usize| {
            let r = c.chunk(i as u32, n as u64);
            r.start as usize..r.end as usize
        };
        // slot j: masters, first moments, second moments, `ce` each
        let mut staging = vec![0f32; 3 * ce * slots];
        let slot = |i: usize| 3 * ce * (i % slots);
        let copy_in = |st: &mut [f32], s: &Self, i: usize| {
            let r = range(i);
            let (o, l) = (slot(i), r.len());
            st[o..o + l].copy_from_slice(&s.master[r.clone()]);
            st[o + ce..o + ce + l].copy_from_slice(&s.m[r.clone()]);
            st[o + 2 * ce..o + 2 * ce + l].copy_from_slice(&s.v[r]);
        };
        let mut written = 0usize; // chunks written back
        let mut computed = 0usize; // tensors whose compute copy is written
        let mut write_back = |st: &[f32], s: &mut Self, i: usize, computed: &mut usize| {
            let r = range(i);
            let (o, l) = (slot(i), r.len());
            s.master[r.clone()].copy_from_slice(&st[o..o + l]);
            s.m[r.clone()].copy_from_slice(&st[o + ce..o + ce + l]);
            s.v[r.clone()].copy_from_slice(&st[o + 2 * ce..o + 2 * ce + l]);
            let params = s.table.params();
            while let Some(prm) = params.get(*computed) {
                if prm.state_offset + prm.numel > r.end {
                    break;
                }
                write_compute(
                    prm,
                    &s.master[prm.state_offset..prm.state_offset + prm.numel],
                );
                *computed += 1;
            }
        };
        if count > 0 {
            copy_in(&mut staging, self, 0);
        }
        for i in 0..count {
            if i + 1 < count {
                while written + slots < i + 2 {
                    write_back(&staging, self, written, &mut computed);
                    written += 1;
                }
                copy_in(&mut staging, self, i + 1);
            }
            // update chunk i in its slot, tensor piece by tensor piece
            let r = range(i);
            let o = slot(i);
            let (sp, rest) = staging[o..o + 3 * ce].split_at_mut(ce);
            let (sm, sv) = rest.split_at_mut(ce);
            for prm in self.table.params() {
                let (a, b) = (
                    prm.state_offset.max(r.start),
                    (prm.state_offset + prm.numel).min(r.end),
                );
                if a >= b {
                    continue;
                }
                let g0 = prm.offset + (a - prm.state_offset);
                let (x, y) = (a - r.start, b - r.start);
                k.apply(
                    &mut sp[x..y],
                    &mut sm[x..y],
                    &mut sv[x..y],
                    &grads[g0..g0 + (b - a)],
                    prm.decay && decays,
                );
            }
            if i >= 1 && written < i {
                write_back(&staging, self, i - 1, &mut computed);
                written = i;
            }
        }
        while written < count {
            write_back(&staging, self, written, &mut computed);
            written += 1;
        }
        // tensors of no element (none in practice) still get their compute copy
        for prm in &self.table.params()[computed..] {
            write_compute(prm, &[]);
        }
        Ok(())
    }

    /// [`AdamW::step`] for an f32 compute copy laid out like the gradients (the CPU backend).
    pub fn step_f32(&mut self, grads: &mut [f32], compute: &mut [f32]) -> Result<StepReport> {
        self.step_f32_with(grads, compute, None)
    }

    /// [`AdamW::step_with`] for an f32 compute copy laid out like the gradients.
    pub fn step_f32_with(
        &mut self,
        grads: &mut [f32],
        compute: &mut [f32],
        stream: Option<&OptimizerStream>,
    ) -> Result<StepReport> {
        check_len("compute weights", self.table.buffer_len(), compute.len())?;
        self.step_with(grads, stream, |p, w| {
            compute[p.offset..p.offset + w.len()].copy_from_slice(w)
        })
    }
}

/// The step's constants, and the update of a run of elements (torch's op order).
struct Update {
    decay_mul: f32,
    w1: f32,
    b2f: f32,
    one_minus_b2: f32,
    neg_step_size: f32,
    bc2_sqrt: f32,
    eps: f32,
}

impl Update {
    fn apply(&self, p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], decay: bool) {
        for i in 0..p.len() {
            if decay {
                p[i] *= self.decay_mul;
            }
            m[i] = lerp(m[i], g[i], self.w1);
            v[i] = v[i] * self.b2f + self.one_minus_b2 * g[i] * g[i];
            let denom = v[i].sqrt() / self.bc2_sqrt + self.eps;
            p[i] += self.neg_step_size * m[i] / denom;
        }
    }
}

/// torch's `lerp(start, end, w)` for f32 (two formulas for accuracy, switched at w = 0.5).
fn lerp(start: f32, end: f32, w: f32) -> f32 {
    if w.abs() < 0.5 {
        start + w * (end - start)
    } else {
        end - (end - start) * (1.0 - w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(schedule: LrSchedule, clip: f64) -> AdamWSpec {
        AdamWSpec {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            grad_clip: clip,
            lr_schedule: schedule,
        }
    }

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> f32 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
    }

    /// torch.optim.AdamW's formula in f64, one tensor, with clipping applied outside.
    struct Reference {
        p: Vec<f64>,
        m: Vec<f64>,
        v: Vec<f64>,
        t: i32,
    }
    impl Reference {
        fn step(&mut self, g: &[f64], lr: f64, s: &AdamWSpec, decay: bool) {
            self.t += 1;
            for (i, &gi) in g.iter().enumerate() {
                if decay {
                    self.p[i] *= 1.0 - lr * s.weight_decay;
                }
                self.m[i] = s.beta1 * self.m[i] + (1.0 - s.beta1) * gi;
                self.v[i] = s.beta2 * self.v[i] + (1.0 - s.beta2) * gi * gi;
                let mh = self.m[i] / (1.0 - s.beta1.powi(self.t));
                let vh = self.v[i] / (1.0 - s.beta2.powi(self.t));
                self.p[i] -= lr * mh / (vh.sqrt() + s.eps);
            }
        }
    }

    #[test]
    fn decay_exclusions_follow_names_and_shapes() {
        assert!(default_decay(
            "model.layers.0.self_attn.q_proj.weight",
            &[8, 8]
        ));
        assert!(default_decay("model.embed_tokens.weight", &[100, 8]));
        assert!(!default_decay("model.layers.0.self_attn.q_proj.bias", &[8]));
        assert!(!default_decay(
            "model.layers.0.input_layernorm.weight",
            &[8]
        ));
        assert!(!default_decay("model.norm.weight", &[8]));
        assert!(!default_decay("visual.merger.ln_q.weight", &[8]));
        assert!(!default_decay("visual.blocks.0.norm1.weight", &[8]));
        assert!(
            !default_decay("some.layernorm.weight", &[4, 8]),
            "a 2-D tensor named norm is still a norm"
        );
    }

    /// A streamed step (chunks that split tensors, 2 and 3 staging slots, a chunk larger than
    /// the state) leaves bitwise the masters, moments and compute copy of the whole step, over
    /// three steps with decay and clipping.
    #[test]
    fn streamed_steps_are_bitwise_the_whole_step() {
        let shapes = [
            ("a.weight", vec![5, 7]),
            ("b.bias", vec![3]),
            ("c.weight", vec![4, 4]),
            ("norm.weight", vec![9]),
        ];
        let table = OptTable::dense(shapes.iter().map(|(n, s)| (*n, s.clone()))).unwrap();
        let n = table.buffer_len();
        let mut rng = Rng(7);
        let init: Vec<f32> = (0..n).map(|_| rng.next()).collect();
        let grads: Vec<Vec<f32>> = (0..3)
            .map(|_| (0..n).map(|_| rng.next() * 3.0).collect())
            .collect();
        let run = |stream: Option<&OptimizerStream>| {
            let mut opt =
                AdamW::new(spec(LrSchedule::Constant, 1.0), table.clone(), &init).unwrap();
            let mut w = init.clone();
            for g in &grads {
                let mut g = g.clone();
                opt.step_f32_with(&mut g, &mut w, stream).unwrap();
            }
            let (p, m, v) = opt.state();
            let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<u32>>();
            (bits(p), bits(m), bits(v), bits(&w))
        };
        let want = run(None);
        for (chunk_elems, slots) in [(1, 2), (6, 2), (6, 3), (13, 3), (64, 2), (1000, 3)] {
            let st = OptimizerStream {
                gpu: rollplex_plan::GpuId(0),
                chunk_elems,
                chunks: (n as u64).div_ceil(chunk_elems) as u32,
                slots,
            };
            let got = run(Some(&st));
            assert!(got == want, "chunks of {chunk_elems} through {slots} slots");
        }
    }

    #[test]
    fn lr_schedules() {
        let c = spec(LrSchedule::Constant, 0.0);
        assert_eq!(lr_at(&c, 0), 1e-2);
        assert_eq!(lr_at(&c, 1000), 1e-2);
        let w = spec(LrSchedule::LinearWarmup { warmup_steps: 4 }, 0.0);
        let got: Vec<f64> = (0..6).map(|s| lr_at(&w, s) / 1e-2).collect();
        assert_eq!(got, vec![0.0, 0.25, 0.5, 0.75, 1.0, 1.0]);
        let cos = spec(
            LrSchedule::Cosine {
                warmup_steps: 2,
                total_steps: 12,
                min_lr_ratio: 0.1,
            },
            0.0,
        );
        let f = |s| lr_at(&cos, s) / 1e-2;
        assert!((f(0) - 0.1).abs() < 1e-12 && (f(1) - 0.55).abs() < 1e-12);
        assert!((f(2) - 1.0).abs() < 1e-12, "peak right after warmup");
        assert!((f(7) - 0.55).abs() < 1e-12, "half way: (1 + min) / 2");
        assert!(
            (f(12) - 0.1).abs() < 1e-12 && (f(30) - 0.1).abs() < 1e-12,
            "floors at min_lr_ratio"
        );
        for s in 2..12 {
            assert!(f(s + 1) < f(s), "decreasing after warmup");
        }
    }

    #[test]
    fn clipping_matches_torch_rule() {
        let table = OptTable::dense([("a.weight", vec![2, 2]), ("b.bias", vec![1])]).unwrap();
        let mut g = vec![3.0, 0.0, 0.0, 0.0, 4.0];
        let n = clip_grad_norm(&table, &mut g, 1.0).unwrap();
        assert_eq!(n, 5.0);
        let c = (1.0 / (5.0 + 1e-6)) as f32;
        assert_eq!(g, vec![3.0 * c, 0.0, 0.0, 0.0, 4.0 * c]);
        let mut g2 = vec![0.3, 0.0, 0.0, 0.0, 0.4];
        assert!((clip_grad_norm(&table, &mut g2, 1.0).unwrap() - 0.5).abs() < 1e-7);
        assert_eq!(
            g2,
            vec![0.3, 0.0, 0.0, 0.0, 0.4],
            "below the bound: unchanged"
        );
        let mut bad = vec![f32::NAN, 0.0, 0.0, 0.0, 1.0];
        let e = clip_grad_norm(&table, &mut bad, 1.0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("a.weight"), "{e}");
    }

    /// Frozen tensors (absent from the table) neither count in the norm nor move.
    #[test]
    fn frozen_tensors_are_skipped() {
        let mut t = OptTable::default();
        t.push("b.weight".into(), vec![2, 1], 3, true).unwrap();
        assert_eq!((t.buffer_len(), t.state_len()), (5, 2));
        assert!(
            t.push("c.weight".into(), vec![2], 4, true).is_err(),
            "overlap"
        );
        let t = OptTable { buffer_len: 6, ..t };
        let mut compute = vec![1.0f32, 1.0, 1.0, 2.0, 2.0, 7.0];
        let mut opt = AdamW::new(spec(LrSchedule::Constant, 1.0), t, &compute).unwrap();
        let mut g = vec![100.0f32, 100.0, 100.0, 0.6, 0.8, 100.0];
        let rep = opt.step_f32(&mut g, &mut compute).unwrap();
        assert!(
            (rep.grad_norm - 1.0).abs() < 1e-6,
            "only the trainable tensor counts: {}",
            rep.grad_norm
        );
        assert_eq!(&compute[..3], &[1.0, 1.0, 1.0]);
        assert_eq!(compute[5], 7.0);
        assert!(compute[3] < 2.0 && compute[4] < 2.0);
    }

    /// Our f32 AdamW against the f64 formula over many steps, with decay exclusions, clipping,
    /// and a cosine schedule.
    #[test]
    fn adamw_matches_f64_reference() {
        let table = OptTable::dense([
            ("l.weight", vec![4, 8]),
            ("l.bias", vec![4]),
            ("norm.weight", vec![8]),
        ])
        .unwrap();
        let s = spec(
            LrSchedule::Cosine {
                warmup_steps: 3,
                total_steps: 30,
                min_lr_ratio: 0.05,
            },
            0.5,
        );
        let mut rng = Rng(3);
        let mut compute: Vec<f32> = (0..table.buffer_len()).map(|_| rng.next()).collect();
        let mut opt = AdamW::new(s.clone(), table.clone(), &compute).unwrap();
        let mut refs: Vec<Reference> = table
            .params()
            .iter()
            .map(|p| Reference {
                p: compute[p.offset..p.offset + p.numel]
                    .iter()
                    .map(|&x| x as f64)
                    .collect(),
                m: vec![0.0; p.numel],
                v: vec![0.0; p.numel],
                t: 0,
            })
            .collect();
        for step in 0..30u64 {
            let mut g: Vec<f32> = (0..table.buffer_len()).map(|_| rng.next() * 0.3).collect();
            let g64: Vec<f64> = g.iter().map(|&x| x as f64).collect();
            let norm = g64.iter().map(|x| x * x).sum::<f64>().sqrt();
            let coef = (0.5 / (norm + 1e-6)).min(1.0);
            let rep = opt.step_f32(&mut g, &mut compute).unwrap();
            assert_eq!(rep.step, step + 1);
            assert!((rep.grad_norm - norm).abs() < 1e-12);
            for (p, r) in table.params().iter().zip(refs.iter_mut()) {
                let gi: Vec<f64> = g64[p.offset..p.offset + p.numel]
                    .iter()
                    .map(|x| x * coef)
                    .collect();
                r.step(&gi, rep.lr, &s, p.decay);
            }
        }
        let mut max_err = 0.0f64;
        for (p, r) in table.params().iter().zip(&refs) {
            let ours = opt.master(p);
            assert_eq!(
                ours,
                &compute[p.offset..p.offset + p.numel],
                "compute copy is the master (f32 on the CPU)"
            );
            for (a, b) in ours.iter().zip(&r.p) {
                max_err = max_err.max((*a as f64 - b).abs());
            }
        }
        assert!(max_err < 2e-6, "max |f32 - f64| after 30 steps: {max_err}");
        let decays: Vec<bool> = table.params().iter().map(|p| p.decay).collect();
        assert_eq!(decays, vec![true, false, false]);
    }

    /// The first step by hand: with bias correction, step 1 moves each weight by ~lr * sign(g).
    #[test]
    fn first_step_by_hand() {
        let table = OptTable::dense([("w", vec![1, 2])]).unwrap();
        let s = AdamWSpec {
            weight_decay: 0.5,
            ..spec(LrSchedule::Constant, 0.0)
        };
        let mut w = vec![1.0f32, -1.0];
        let mut opt = AdamW::new(s, table, &w).unwrap();
        let mut g = vec![0.5f32, -2.0];
        opt.step_f32(&mut g, &mut w).unwrap();
        // p = p (1 - 0.01 * 0.5) - 0.01 * g / (|g| + eps')
        let want = [1.0 * 0.995 - 0.01, -0.995 + 0.01];
        assert!(
            (w[0] as f64 - want[0]).abs() < 1e-6 && (w[1] as f64 - want[1]).abs() < 1e-6,
            "{w:?}"
        );
    }

    #[test]
    fn accumulation_is_ordered_and_exact() {
        let mut acc = GradAccumulator::new(3);
        let g0 = [0.1f32, 1e8, -3.0];
        let g1 = [0.2f32, 1.0, 3.0];
        assert!(acc
            .add(1, &g1)
            .unwrap_err()
            .to_string()
            .contains("micro-batch 0 is next"));
        acc.add(0, &g0).unwrap();
        acc.add(1, &g1).unwrap();
        assert_eq!(acc.grads(), &[0.1f32 + 0.2, 1e8 + 1.0, 0.0]);
        assert_eq!(acc.count(), 2);
        acc.reset();
        assert_eq!((acc.grads(), acc.count()), (&[0.0f32; 3][..], 0));
        assert!(acc.add(0, &[1.0]).is_err());
    }

    #[test]
    fn bad_specs_are_errors() {
        let table = OptTable::dense([("w", vec![1])]).unwrap();
        let init = [0.0f32];
        for bad in [
            AdamWSpec {
                beta1: 1.0,
                ..spec(LrSchedule::Constant, 0.0)
            },
            AdamWSpec {
                eps: 0.0,
                ..spec(LrSchedule::Constant, 0.0)
            },
            spec(
                LrSchedule::Cosine {
                    warmup_steps: 0,
                    total_steps: 5,
                    min_lr_ratio: 2.0,
                },
                0.0,
            ),
        ] {
            assert!(AdamW::new(bad, table.clone(), &init).is_err());
        }
        assert!(OptTable::dense([("w", vec![1]), ("w", vec![2])]).is_err());
        assert!(AdamW::new(spec(LrSchedule::Constant, 0.0), table, &[]).is_err());
    }
}
