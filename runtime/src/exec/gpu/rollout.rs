//! The rollout's ops: media encoding, prefill of each group's prompt, the KV arena and the
//! decode windows.

use std::sync::Arc;
use std::time::Instant;

use rollplex_kernels::cuda::{CudaStream, Gpu};
use rollplex_plan::{Span, TrainPrefixSource};

use super::super::book::range;
use super::super::placement::Role;
use super::super::{DecodeWindow, ExecError, PromptData};
use super::held::Held;
use super::ops::no_reference;
use super::pacing::HostSplit;
use super::{GpuIteration, Media};
use crate::gpu::arena::Region;
use crate::gpu::decode::{DecodeOutput, DecodeStart, DeviceDecode, StepLaunch, NOT_DONE};
use crate::gpu::generate::sample_params;
use crate::gpu::{GpuEncodedMedia, GpuKvArena, GpuModel, GpuPrefixState, GpuPrompt};
use crate::model::{DecodeSlot, MediaInput};

/// Decode steps the host launches ahead of the device.
const STEPS_AHEAD: usize = 2;

impl GpuIteration<'_, '_> {
    pub(super) fn media_inputs(p: &PromptData) -> Vec<MediaInput<'_>> {
        p.media
            .iter()
            .map(|m| MediaInput {
                kind: m.kind,
                pixels: &m.pixels,
                grid: m.grid,
            })
            .collect()
    }

    /// Encodes the media of `groups` with `model`, one call per group (`copies` copies of the
    /// group's media in it, the ablation's cost); returns each group's first copy. One call per
    /// group keeps every GEMM's shape a function of the group alone, so the bits do not depend
    /// on how a plan cut its tasks.
    pub(super) fn encode(
        gpu: &Gpu,
        s: &Arc<CudaStream>,
        model: &GpuModel,
        prompts: &[PromptData],
        groups: &[usize],
        copies: u32,
        region: Option<&Region>,
    ) -> Result<Vec<Media>, ExecError> {
        let mut out = Vec::with_capacity(groups.len());
        for &g in groups {
            let inputs = Self::media_inputs(&prompts[g]);
            if inputs.is_empty() {
                out.push(Arc::new(Vec::new()));
                continue;
            }
            let n = inputs.len();
            let mut items = Vec::with_capacity(n * copies.max(1) as usize);
            for _ in 0..copies.max(1) {
                items.extend_from_slice(&inputs);
            }
            let mut m = model.encode_media_in(gpu, s, &items, region)?;
            m.truncate(n);
            out.push(Arc::new(m));
        }
        Ok(out)
    }

    /// Prefills the prompts of `groups` with `model`, one packed call per group (`copies`
    /// copies of its prompt); returns each group's first copy (see [`Self::encode`] on why per
    /// group), its keys and values in `region` of the plan's arena when given.
    #[allow(clippy::too_many_arguments)] // the state it reads, borrowed apart from `self`
    pub(super) fn prefill(
        gpu: &Gpu,
        s: &Arc<CudaStream>,
        model: &GpuModel,
        prompts: &[PromptData],
        groups: &[usize],
        media: &[Media],
        copies: u32,
        region: Option<&Region>,
    ) -> Result<Vec<GpuPrefixState>, ExecError> {
        let mut out = Vec::with_capacity(groups.len());
        for (i, &g) in groups.iter().enumerate() {
            let refs: Vec<&GpuEncodedMedia> = media[i].iter().collect();
            let prompt = GpuPrompt {
                ids: &prompts[g].ids,
                media: &refs,
            };
            let batch = vec![prompt; copies.max(1) as usize];
            let state = model
                .prefill_in(gpu, s, &batch, region)?
                .into_iter()
                .next()
                .ok_or_else(|| ExecError::Plan("prefill returned no state".into()))?;
            out.push(state);
        }
        Ok(out)
    }

    /// The actor's (rollout) media of `groups`, encoding those not encoded yet on `s`.
    pub(super) fn actor_media(
        &mut self,
        s: &Arc<CudaStream>,
        groups: &[usize],
    ) -> Result<Vec<Media>, ExecError> {
        let missing: Vec<usize> = groups
            .iter()
            .copied()
            .filter(|&g| self.encoded[g].is_none())
            .collect();
        if !missing.is_empty() {
            self.note_made(Held::Media, s);
            let m = Self::encode(
                &self.models.gpu,
                s,
                self.models.trainer.model(),
                self.book.prompts,
                &missing,
                1,
                None,
            )?;
            for (g, m) in missing.into_iter().zip(m) {
                self.encoded[g] = Some(m);
            }
        }
        for &g in groups {
            if let Some((ready, on)) = &self.encoded_ready[g] {
                if on.cu_stream() != s.cu_stream() {
                    s.wait(ready)?;
                }
            }
        }
        Ok(groups
            .iter()
            .map(|&g| self.encoded[g].clone().expect("encoded above"))
            .collect())
    }

    /// The reference's media of `groups`: the actor's when the tower is frozen (same weights),
    /// else encoded with the reference (`copies` times, the ablation's cost).
    pub(super) fn ref_media(
        &mut self,
        s: &Arc<CudaStream>,
        groups: &[usize],
        copies: u32,
    ) -> Result<Vec<Media>, ExecError> {
        if self.book.frozen_tower() {
            return self.actor_media(s, groups);
        }
        let missing: Vec<usize> = groups
            .iter()
            .copied()
            .filter(|&g| self.ref_encoded[g].is_none())
            .collect();
        if !missing.is_empty() {
            let reference = self.models.reference.as_ref().ok_or_else(no_reference)?;
            let m = Self::encode(
                &self.models.gpu,
                s,
                reference,
                self.book.prompts,
                &missing,
                copies,
                None,
            )?;
            for (g, m) in missing.into_iter().zip(m) {
                self.ref_encoded[g] = Some(m);
            }
        }
        Ok(groups
            .iter()
            .map(|&g| self.ref_encoded[g].clone().expect("encoded above"))
            .collect())
    }

    pub(super) fn run_prefill(
        &mut self,
        s: &Arc<CudaStream>,
        groups: Span,
        copies: u32,
    ) -> Result<(), ExecError> {
        let groups: Vec<usize> = range(groups).collect();
        let states = if self.plan.train_prefix == TrainPrefixSource::Rollout {
            // the training forward of each group's prompt, kept for the micro-batches; decode
            // takes the prompt's keys, values and first logits from it
            self.note_made(Held::TrainPrefixes, s);
            self.run_train_prefix(s, &groups, copies)?;
            let (store, _) = self
                .train_prefixes
                .as_ref()
                .expect("made by run_train_prefix");
            let t = &self.models.trainer;
            groups
                .iter()
                .map(|&g| t.prefix_state(&self.models.gpu, s, store, g))
                .collect::<Result<Vec<_>, _>>()?
        } else {
            let media = self.actor_media(s, &groups)?;
            Self::prefill(
                &self.models.gpu,
                s,
                self.models.trainer.model(),
                self.book.prompts,
                &groups,
                &media,
                copies,
                None,
            )?
        };
        for (g, st) in groups.into_iter().zip(states) {
            self.prefixes[g] = Some(st);
        }
        if self.prefixes.iter().all(Option::is_some) && self.arena.is_none() {
            self.lay_out(s)?;
        }
        Ok(())
    }

    /// Once every group's prefix is known: the KV arena `[group prefixes | sample suffixes]`,
    /// the decode slots, and the device decode loop started with every sample's first logits
    /// (its group's last prompt logits).
    pub(super) fn lay_out(&mut self, s: &Arc<CudaStream>) -> Result<(), ExecError> {
        let region = self.region(Role::DecodeKv);
        let model = self.models.trainer.model();
        let gpu = &self.models.gpu;
        let mut arena =
            GpuKvArena::for_model_in(model, gpu, s, self.arena_rows, region.as_deref())?;
        let mut off = 0u32;
        let mut spans = Vec::with_capacity(self.prefixes.len());
        for p in self.prefixes.iter().flatten() {
            spans.push(arena.store_prefix(s, off, p)?);
            off += p.len;
        }
        let max_new = self.book.spec.rollout.max_new_tokens;
        let samples = self.book.samples();
        let group = self.book.group_size;
        let mut slots = Vec::with_capacity(samples);
        for smp in 0..samples {
            let p = self.prefixes[smp / group]
                .as_ref()
                .expect("all prefixes known");
            slots.push(DecodeSlot::new(
                spans[smp / group],
                p.rope_delta,
                off,
                max_new,
            ));
            off += max_new;
        }
        let max_prefix = spans.iter().map(|sp| sp.len as usize).max().unwrap_or(1);
        let dd = match self.models.decode.take() {
            Some(d) if d.fits(samples, group, max_new as usize, max_prefix) => d,
            _ => DeviceDecode::new(model, gpu, s, samples, group, max_new as usize, max_prefix)?,
        };
        let dd = self.models.decode.insert(dd);
        dd.set_eager(self.eager_decode);
        for smp in 0..samples {
            let p = self.prefixes[smp / group]
                .as_ref()
                .expect("all prefixes known");
            s.memcpy_dtod(&*p.last_logits, &mut dd.first_logits_mut(smp))?;
        }
        let (stop_ids, forced) = self.book.stop_rule();
        let sp = &self.book.sampling;
        let start = DecodeStart {
            slots: &slots,
            keys: None,
            group,
            max_new,
            stop_ids,
            forced,
            sampling: sample_params(sp, self.book.spec.seed, self.book.iteration),
            logprob_temperature: self.book.temperature(),
        };
        let model = self.models.trainer.model();
        dd.start(
            model,
            gpu,
            s,
            &arena,
            &start,
            self.book.spec.seed,
            self.book.iteration,
        )?;
        self.arena = Some(arena);
        self.active = (0..samples).collect();
        // the prefill states are in the arena now (without prefix dedup each holds every
        // copy's KV, the plan's `kv.prompt`): their frees wait for the copies above
        let copied = self.models.gpu.event()?;
        copied.record(s)?;
        crate::gpu::wait_before_free(&self.made_on[Held::DecodeKv.index()], s, &copied)?;
        self.prefixes.iter_mut().for_each(|p| *p = None);
        Ok(())
    }

    /// Decode steps `first_step..first_step + steps` (or until every sample stopped, with
    /// `until_done`) on the device ([`DeviceDecode`]): the host launches each step (one graph)
    /// and a paced piece of the window's side work, and never waits for a step it launched;
    /// at the window's end the tokens come back once and the book takes them step by step.
    pub(super) fn run_decode(
        &mut self,
        s: &Arc<CudaStream>,
        first_step: u32,
        steps: u32,
        until_done: bool,
    ) -> Result<(), ExecError> {
        if self.arena.is_none() {
            return Err(ExecError::Plan(
                "decode before every group's prefill".into(),
            ));
        }
        let mut step = first_step;
        self.step_marks.clear();
        self.step_ends.clear();
        let mut host = HostSplit::default();
        let window_start = Instant::now();
        while (until_done || step < first_step + steps) && !self.active.is_empty() {
            let t_step = Instant::now();
            let mark = self.models.gpu.timing_event()?;
            mark.record(s)?;
            let models = &mut *self.models;
            let dd = models.decode.as_mut().expect("started by lay_out");
            let arena = self.arena.as_mut().expect("laid out with the slots");
            let Some(how) = dd.step(models.trainer.model(), &models.gpu, s, arena, step)? else {
                break;
            };
            let burst = matches!(how, StepLaunch::Burst { .. });
            if how == (StepLaunch::Burst { captured: true }) {
                host.captures += 1;
            }
            let end = models.gpu.timing_event()?;
            end.record(s)?;
            self.step_marks.push(mark);
            self.step_ends.push(end);
            step += 1;
            host.launch_decode += t_step.elapsed();
            // at most STEPS_AHEAD steps queued: the host paces the side pieces by decode's
            // progress (as when it waited for every step's tokens), while the device always
            // has the next step queued
            let n = self.step_marks.len();
            if n > STEPS_AHEAD {
                let t_wait = Instant::now();
                self.step_marks[n - STEPS_AHEAD].synchronize()?;
                host.wait += t_wait.elapsed();
            }
            // a piece of the window's side work, launched while the device runs the steps;
            // not after a step the host launched eagerly or captured (its own burst of
            // milliseconds, which a piece's launches on top would stretch past the steps queued)
            let t_side = Instant::now();
            if !burst {
                host.pieces += self.launch_paced()?;
            }
            let side = t_side.elapsed();
            host.launch_side += side;
            host.longest_side = host.longest_side.max(side);
            host.steps += 1;
        }
        let mark = self.models.gpu.timing_event()?;
        mark.record(s)?;
        self.step_marks.push(mark);
        let t_wait = Instant::now();
        let out = self
            .models
            .decode
            .as_mut()
            .expect("started by lay_out")
            .collect(s)?;
        host.wait += t_wait.elapsed();
        let bytes_before = self.book.metrics.decode_bytes;
        self.take_tokens(&out, first_step, step)?;
        // the window's device time (its stream is synchronised; `step_marks` holds a mark before
        // each launched step and one after the last), least bytes and the device's longest wait
        // for the host between two steps (the last step's end against the closing mark is not
        // between steps)
        let launched = self.step_ends.len();
        let mut device = String::new();
        if launched > 0 {
            let device_s = self.step_marks[0].elapsed_ms(&self.step_marks[launched])? as f64 / 1e3;
            let mut max_gap_s = 0f64;
            for (end, next) in self.step_ends.iter().zip(&self.step_marks[1..launched]) {
                max_gap_s = max_gap_s.max(end.elapsed_ms(next)? as f64 / 1e3);
            }
            let w = DecodeWindow {
                first_step,
                steps: launched as u32,
                device_s,
                bytes: self.book.metrics.decode_bytes - bytes_before,
                max_gap_s,
            };
            self.book.metrics.decode_device_s += device_s;
            self.book.metrics.decode_windows.push(w);
            if self.task_log {
                device = format!(
                    "device {:.1} ms, {:.2} GB ({:.0} GB/s), longest gap between steps {:.1} us; ",
                    device_s * 1e3,
                    w.bytes / 1e9,
                    w.bytes / device_s.max(1e-12) / 1e9,
                    max_gap_s * 1e6
                );
            }
        }
        if self.task_log {
            eprintln!(
                "[decode steps {first_step}..{step}] {device}host {:.1} ms: {}",
                window_start.elapsed().as_secs_f64() * 1e3,
                host
            );
        }
        // side pieces still deferred stay queued: the next window's decode loop launches them
        // paced (launching them all here would hold the host, and so the next window's first
        // step, until the side partition had drained them); the first task outside a window
        // launches what is left (`run`)
        self.book.end_window();
        Ok(())
    }

    /// The book takes steps `from..to` of the device's output in step order, as if each step's
    /// tokens had come back on their own; the device's stop decisions must be the book's.
    fn take_tokens(&mut self, out: &DecodeOutput, from: u32, to: u32) -> Result<(), ExecError> {
        let max_new = self.book.spec.rollout.max_new_tokens as usize;
        for step in from..to {
            if self.active.is_empty() {
                break;
            }
            let live = self.active.len();
            let dd = self.models.decode.as_ref().expect("started by lay_out");
            self.book.metrics.decode_bytes += dd.step_bytes(step, live);
            self.book.metrics.decode_rows += dd.step_rows(step) as u64;
            self.book.metrics.decode_live_rows += live as u64;
            let mut next = Vec::with_capacity(self.active.len());
            for &smp in &self.active {
                self.book.check_step(smp, step)?;
                let at = smp * max_new + step as usize;
                let goes_on = self
                    .book
                    .push_token(smp, out.tokens[at], out.logprobs[at], step);
                let device_goes_on = out.done_step[smp] == NOT_DONE || out.done_step[smp] > step;
                if goes_on != device_goes_on {
                    return Err(ExecError::Plan(format!(
                        "sample {smp} at decode step {step}: the device's stop decision \
                         (step {}) is not the book's",
                        out.done_step[smp]
                    )));
                }
                if goes_on {
                    next.push(smp);
                }
            }
            self.active = next;
            self.book.step_done(step);
        }
        Ok(())
    }
}
