#!/usr/bin/env python3
"""The PyTorch + transformers baseline of one RL iteration of examples/h200-3b-video.rpx.

What a user writes without Rollplex: the same iteration as the pipeline, done
the straightforward way with PyTorch + transformers on one GPU, timed phase by phase.

The iteration (defaults = examples/h200-3b-video.rpx):
- actor: Qwen2.5-VL-3B dimensions built from a config (no download), random weights
  (torch.manual_seed(7)), bf16 parameters, SDPA attention; the reference model is a second copy
  (copy.deepcopy), as users do;
- 16 prompts x GRPO group 8 = 128 samples; each prompt is one 8-frame 448x448 video (grid
  4 x 32 x 32 = 4,096 patches -> 1,024 LLM tokens between vision start/end) + 200 random text
  tokens = 1,226 prompt tokens; the video is fed to every sample of its group (HF has no shared
  prefix: each sample carries its own copy of the pixels);
- rollout: one `model.generate` over all 128 samples (KV cache, sampling at temperature 1, no
  top-p/top-k), max_new_tokens 512; each sample stops at the length Rollplex forces on it
  (log-normal, median 256, sigma 0.6, capped at 512, drawn exactly like
  runtime/src/exec/mod.rs `forced_length`: Philox4x32-10 keyed [iteration, sample, 0,
  0x4C454E47] / [seed lo, seed hi]), through a per-sample StoppingCriteria (generate runs until
  the longest sample stops; a stopped sample stays in the batch, its extra tokens are masked);
  EOS does not stop a sample (random weights never stop on their own);
- scoring: reference log-probs with the reference copy, then old log-probs with the actor, both in
  micro-batches of one group (8 samples) cut to the group's longest response, logits only for
  the response positions (logits_to_keep);
- reward: random 0/1 per sample (seeded; random weights answer nothing, so choice_letter would
  give all zeros and no gradient) and GRPO advantages (r - mean_group) / (std_group + 1e-6);
- training: vision tower + merger frozen, gradient checkpointing (= recompute full), GRPO loss
  (PPO clip 0.2/0.2, k3 KL to the reference with coefficient 0.001, token mean over the
  mini-batch), 16 micro-batches of 8 accumulated, grad clip 1.0, one AdamW step (lr 1e-6, betas
  0.9/0.999, eps 1e-8, weight decay 0.01; torch's AdamW on the bf16 parameters, its states in
  bf16).

Warm-up (not timed): a 4-token generate of 2 samples, one scoring forward, one training
micro-batch of 1 sample and an AdamW step at lr 0 (allocates the optimizer state, as it exists
from the second iteration on; leaves the weights unchanged), then the gradients are dropped.

Output: a table and one JSON object (`RESULT {...}` on stdout, and `hf_iteration.json` in
RESULTS_DIR) with the keys rollplex-run writes to metrics.jsonl where they mean the same thing
(time_s, rollout_s, scoring_s, training_s, response_tokens, response_len_mean, decode_steps,
micro_batches, optimizer_steps, loss, kl, grad_norm, tokens_per_s = response tokens / time_s)
plus peak memory per phase. A partial JSON is rewritten after every phase, so a run cut short
still says how far it got.

Knobs (environment): PROMPTS (16; `--prompts N` wins), G (8), MAX_NEW (512), MB (8), SEED (42),
ITERATION (0), MEDIAN (256), SIGMA (0.6),
GEN_BATCH (samples per generate call; default all), SMALL=1 (a tiny model, for a dry run on the
CPU), DEVICE (cuda if present, else cpu), RESULTS_DIR (.).

`--lengths N` prints the forced lengths of samples 0..N of ITERATION as JSON and exits (no torch
needed); `--write-golden PATH` writes them for runtime/tests/forced_lengths.rs, which checks that
the Rust draw gives the same numbers. The job, the length draw, the data and the result format
live in iteration_common.py, shared with strong_iteration.py (the tuned PyTorch peer).
"""
import copy
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import iteration_common as C  # noqa: E402

ENV = os.environ
JOB = C.Job(prompts=C.prompts_arg(sys.argv))
PROMPTS, G, MAX_NEW, MB, SEED, ITERATION = JOB.prompts, JOB.group, JOB.max_new, JOB.micro_batch, JOB.seed, JOB.iteration
MEDIAN, SIGMA = JOB.median, JOB.sigma
N = JOB.samples
lengths = JOB.lengths
JOB.handle_length_cli(sys.argv, "tests/reference/hf_iteration.py")

# ---------------------------------------------------------------------------------------------
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration  # noqa: E402
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList  # noqa: E402

SMALL = ENV.get("SMALL") == "1"
DEV = ENV.get("DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
CUDA = DEV.startswith("cuda")
GEN_BATCH = int(ENV.get("GEN_BATCH", str(N)))
EOS_PAD, VSTART, VEND, VIDEO, SPECIAL = C.EOS_PAD, C.VSTART, C.VEND, C.VIDEO, C.SPECIAL
CLIP_LO, CLIP_HI, KL_COEF = C.CLIP_LO, C.CLIP_HI, C.KL_COEF
print("transformers", transformers.__version__, "torch", torch.__version__, "device", DEV, flush=True)

DIMS = C.Dims(small=SMALL)
vis, txt = DIMS.vis, DIMS.txt
T, GH, GW, TEXT = DIMS.T, DIMS.GH, DIMS.GW, DIMS.TEXT
cfg = Qwen2_5_VLConfig(vision_config=vis, text_config=txt, image_token_id=151655, video_token_id=VIDEO,
                       vision_start_token_id=VSTART, vision_end_token_id=VEND, tie_word_embeddings=True)
for k, v in txt.items():
    try:
        setattr(cfg, k, v)
    except Exception:
        pass
cfg._attn_implementation = "sdpa"
NPATCH = DIMS.NPATCH
NTOK = DIMS.NTOK
PROMPT_LEN = DIMS.PROMPT_LEN

res = {"baseline": "pytorch+transformers", "pipeline": "examples/h200-3b-video.rpx", "device": DEV,
       "torch": torch.__version__, "transformers": transformers.__version__, "small": SMALL,
       "prompts": PROMPTS, "group": G, "samples": N, "prompt_len": PROMPT_LEN, "max_new_tokens": MAX_NEW,
       "micro_batch": MB, "gen_batch": GEN_BATCH, "seed": SEED, "iteration": ITERATION,
       "response_len": JOB.response_len_text()}
if CUDA:
    res["gpu"] = torch.cuda.get_device_name()
REC = C.Recorder("hf_iteration.json", CUDA, res)
save, sync = REC.save, REC.sync
Phase = REC.phase


# ---------------------------------------------------------------------------------------------
# models and data

t0 = time.perf_counter()
torch.manual_seed(7)
prev_dtype = torch.get_default_dtype()
torch.set_default_dtype(torch.bfloat16)
with torch.device(DEV):
    actor = Qwen2_5_VLForConditionalGeneration(cfg)
torch.set_default_dtype(prev_dtype)
actor.to(torch.bfloat16)
reference = copy.deepcopy(actor).eval().requires_grad_(False)
sync()
res["build_s"] = time.perf_counter() - t0
res["params_b"] = sum(p.numel() for p in actor.parameters()) / 1e9
visual = actor.model.visual
visual.requires_grad_(False)  # freeze = [vision, merger]: the merger is part of `visual`
trainable = [p for p in actor.parameters() if p.requires_grad]
res["trainable_params_b"] = sum(p.numel() for p in trainable) / 1e9
actor.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
actor.generation_config.eos_token_id = None  # stopping is the forced length's job
actor.generation_config.pad_token_id = EOS_PAD
print(f"models built in {res['build_s']:.1f} s: {res['params_b']:.3f} B parameters each "
      f"({res['trainable_params_b']:.3f} B trainable)", flush=True)

prompt_rows, videos, rewards, gen = C.make_data(JOB, DIMS, DEV)
prompt_ids = torch.tensor(prompt_rows, device=DEV).repeat_interleave(G, 0)  # sample s is of group s // G
pix_of = lambda samples: torch.cat([videos[s // G] for s in samples])  # noqa: E731
grid_of = lambda samples: torch.tensor([[T, GH, GW]] * len(samples), device=DEV)  # noqa: E731
forced = lengths(N)
res["forced_len_mean"] = sum(forced) / N
res["forced_len_max"] = max(forced)


class ForcedLengths(StoppingCriteria):
    """Stops sample i once it has `lengths[i]` new tokens (a per-sample bool, as generate wants)."""

    def __init__(self, prompt_len, lens, record=None):
        self.prompt_len = prompt_len
        self.lens = torch.tensor(lens, device=DEV)
        self.record = record  # host times of each call (generate syncs once per step)

    def __call__(self, input_ids, scores, **kwargs):
        if self.record is not None:
            self.record.append(time.perf_counter())
            if len(self.record) % 64 == 0:
                res["rollout_steps_done"] = len(self.record)
                save()
        return self.lens <= (input_ids.shape[1] - self.prompt_len)


def generate(samples, max_new, record=None):
    ids = prompt_ids[samples]
    return actor.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values_videos=pix_of(samples),
        video_grid_thw=grid_of(samples), max_new_tokens=max_new, do_sample=True, temperature=1.0, top_p=1.0,
        top_k=0, suppress_tokens=SPECIAL, stopping_criteria=StoppingCriteriaList([ForcedLengths(PROMPT_LEN, [min(forced[s], max_new) for s in samples], record)]))


def token_logp(model, seqs, mask, samples, resp_len):
    """Log-probs of the response tokens seqs[:, PROMPT_LEN:PROMPT_LEN+resp_len] (f32)."""
    out = model(input_ids=seqs, attention_mask=mask, pixel_values_videos=pix_of(samples),
                video_grid_thw=grid_of(samples), use_cache=False, logits_to_keep=resp_len + 1)
    logits = out.logits[:, :-1].float()
    tgt = seqs[:, PROMPT_LEN:PROMPT_LEN + resp_len]
    return torch.log_softmax(logits, -1).gather(-1, tgt[..., None]).squeeze(-1)


def micro_batches():
    for i in range(0, N, MB):
        samples = list(range(i, min(i + MB, N)))
        resp = max(forced[s] for s in samples)  # cut to the micro-batch's longest response
        seqs = sequences[samples, :PROMPT_LEN + resp]
        lens = torch.tensor([forced[s] for s in samples], device=DEV)
        pos = torch.arange(PROMPT_LEN + resp, device=DEV)
        mask = (pos[None, :] < PROMPT_LEN + lens[:, None]).long()
        rmask = mask[:, PROMPT_LEN:].float()
        yield samples, seqs, mask, rmask, resp


def step_loss(samples, seqs, mask, rmask, resp, total_tokens):
    new = token_logp(actor, seqs, mask, samples, resp)
    old, ref = old_logp[samples[0]][:, :resp], ref_logp[samples[0]][:, :resp]
    adv = advantages[samples][:, None]
    ratio = torch.exp(new - old)
    pg = -torch.minimum(ratio * adv, ratio.clamp(1 - CLIP_LO, 1 + CLIP_HI) * adv)
    kl = torch.exp(ref - new) - (ref - new) - 1  # k3
    tok = pg + KL_COEF * kl
    return (tok * rmask).sum() / total_tokens, (pg * rmask).sum() / total_tokens, (kl * rmask).sum() / total_tokens


opt = torch.optim.AdamW(trainable, lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

# ---------------------------------------------------------------------------------------------
# warm-up (untimed)

t0 = time.perf_counter()
with torch.no_grad():
    actor.eval()
    w = generate([0, 1], 4)
    wmask = torch.ones_like(w)
    token_logp(reference, w, wmask, [0, 1], 4)
actor.train()
wl = token_logp(actor, w[:1], wmask[:1], [0], 4).mean()
wl.backward()
for grp in opt.param_groups:
    grp["lr"] = 0.0
opt.step()
for grp in opt.param_groups:
    grp["lr"] = 1e-6
opt.zero_grad(set_to_none=True)
del w, wmask, wl
sync()
res["warmup_s"] = time.perf_counter() - t0
print(f"warm-up {res['warmup_s']:.1f} s", flush=True)

# ---------------------------------------------------------------------------------------------
# the iteration

t_iter = time.perf_counter()
actor.eval()


def rollout():
    """One generate per GEN_BATCH samples; returns the sequences and the host time of each step."""
    outs = []
    step_times = [time.perf_counter()]
    for i in range(0, N, GEN_BATCH):
        outs.append(generate(list(range(i, min(i + GEN_BATCH, N))), MAX_NEW, step_times))
    width = max(o.shape[1] for o in outs)
    return torch.cat([torch.nn.functional.pad(o, (0, width - o.shape[1]), value=EOS_PAD) for o in outs]), step_times


SKIP_ROLLOUT = ENV.get("SKIP_ROLLOUT") == "1"
if SKIP_ROLLOUT:
    # scoring and training only: random response tokens of the forced lengths (their values do not
    # change the work); the rollout is measured by a run without this knob
    sequences = torch.cat([prompt_ids, torch.randint(1000, 100000, (N, max(forced)), generator=gen).to(DEV)], 1)
    res["rollout_s"], res["rollout_peak_gib"], res["skipped"] = 0.0, None, "rollout"
else:
    with Phase("rollout"), torch.no_grad():
        sequences, step_times = rollout()
res["decode_steps"] = sequences.shape[1] - PROMPT_LEN
# generate ran until the longest sample stopped (a finished sample keeps decoding in the batch:
# generate pads it only when an EOS criterion exists); the tokens past each length are masked
assert res["decode_steps"] == max(forced), (res["decode_steps"], max(forced))
for s in range(N):
    sequences[s, PROMPT_LEN + forced[s]:] = EOS_PAD
res["response_tokens"] = sum(forced)
res["response_len_mean"] = sum(forced) / N
if not SKIP_ROLLOUT:
    res["rollout_tokens_per_s"] = res["response_tokens"] / res["rollout_s"]
if not SKIP_ROLLOUT and GEN_BATCH == N:
    # host clock at each step's stopping check: the first is after vision + prefill + one sample
    gaps = sorted(b - a for a, b in zip(step_times[1:], step_times[2:]))
    res["rollout_prefill_s"] = step_times[1] - step_times[0]
    res["decode_step_ms_median"] = 1000 * gaps[len(gaps) // 2] if gaps else None
    res["decode_step_ms_first64"] = 1000 * (step_times[65] - step_times[1]) / 64 if len(step_times) > 65 else None
    res["decode_step_ms_last64"] = 1000 * (step_times[-1] - step_times[-65]) / 64 if len(step_times) > 65 else None
total_tokens = float(sum(forced))

ref_logp, old_logp = {}, {}
with torch.no_grad():
    with Phase("scoring_ref"):
        for samples, seqs, mask, rmask, resp in micro_batches():
            ref_logp[samples[0]] = token_logp(reference, seqs, mask, samples, resp)
    with Phase("scoring_old"):
        for samples, seqs, mask, rmask, resp in micro_batches():
            old_logp[samples[0]] = token_logp(actor, seqs, mask, samples, resp)
res["scoring_s"] = res["scoring_ref_s"] + res["scoring_old_s"]
res["scoring_peak_gib"] = res["scoring_ref_peak_gib"] and max(res["scoring_ref_peak_gib"], res["scoring_old_peak_gib"])

with Phase("reward"):
    advantages = C.grpo_advantages(rewards, PROMPTS, G).to(DEV)

actor.train()
t_train = time.perf_counter()
with Phase("training"):
    loss_sum = pg_sum = kl_sum = 0.0
    n_mb = 0
    for samples, seqs, mask, rmask, resp in micro_batches():
        loss, pg, kl = step_loss(samples, seqs, mask, rmask, resp, total_tokens)
        loss.backward()
        loss_sum += loss.item()
        res.setdefault("training_micro_batch_done_s", []).append(time.perf_counter() - t_train)
        save()
        pg_sum += pg.item()
        kl_sum += kl.item()
        n_mb += 1
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable, 1.0).item()
    opt.step()
    opt.zero_grad(set_to_none=True)
sync()
res["time_s"] = time.perf_counter() - t_iter
res["iteration_s"] = res["time_s"]
res["micro_batches"] = n_mb
res["optimizer_steps"] = 1
res["loss"], res["pg_loss"], res["kl"], res["grad_norm"] = loss_sum, pg_sum, kl_sum, grad_norm
res["tokens_per_s"] = res["response_tokens"] / res["time_s"]
res["sequence_tokens"] = N * PROMPT_LEN + res["response_tokens"]
if CUDA:
    res["peak_gib"] = max(res[k] for k in res if k.endswith("_peak_gib") and res[k] is not None)
save()

print()
print(f"PyTorch {torch.__version__} + transformers {transformers.__version__} on {res.get('gpu', DEV)}: "
      f"{PROMPTS} prompts x group {G} = {N} samples, prompt {PROMPT_LEN} tokens, responses {res['response_len']} "
      f"(mean {res['response_len_mean']:.1f}, max {res['forced_len_max']})")
print(C.phase_table(res))
print(f"decode steps {res['decode_steps']} (vision + prefill {res.get('rollout_prefill_s', float('nan')):.2f} s, "
      f"median step {res.get('decode_step_ms_median') or float('nan'):.1f} ms), "
      f"rollout {res.get('rollout_tokens_per_s', float('nan')):.0f} response tokens/s, iteration {res['tokens_per_s']:.0f} response tokens/s")
print("RESULT", json.dumps(res), flush=True)
