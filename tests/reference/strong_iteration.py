#!/usr/bin/env python3
"""The tuned PyTorch peer of one RL iteration of examples/h200-3b-video.rpx.

hf_iteration.py is what a user writes first (transformers' generate, full forwards, gradient
checkpointing); this script is what a user who tunes the stack the way veRL with a serving
engine does would run on one GPU, in plain PyTorch (no vLLM, no flash-attn package): the same
job, the same forced lengths, the same seeded prompts and the same RESULT keys
(iteration_common.py holds what the two share), for side-by-side timing with rollplex-run.

The job (defaults = examples/h200-3b-video.rpx): Qwen2.5-VL-3B dimensions, random weights
(torch.manual_seed(7); normal(0, 0.02) matrices, zero biases, unit norms: the work does not
depend on the values); 16 prompts x GRPO group 8 = 128 samples; each prompt one 8-frame
448x448 video (4,096 patches -> 1,024 LLM tokens) + 200 text tokens = 1,226 prompt tokens;
response lengths forced (log-normal, median 256, sigma 0.6, cap 512: Rollplex's
`forced_length`, iteration ITERATION + i for iteration i); vision tower + merger frozen; GRPO
(PPO clip 0.2/0.2, k3 KL to the reference with coefficient 0.001, token mean over the
mini-batch), one AdamW step per iteration (lr 1e-6, betas 0.9/0.999, eps 1e-8, weight decay
0.01), grad-norm clip 1.0; random 0/1 rewards (seeded, as hf_iteration.py).

The model is a compact one written here with Qwen2.5-VL-3B's shapes and FLOPs: text decoder of
36 layers (RMSNorm with fp32 statistics, fused q|k|v with bias, GQA 16/2 heads of 128, M-RoPE
with sections 16/24/24 over the prompt's (t, h, w) positions and text positions after it,
SwiGLU FFN 11008 as fused gate|up, hidden 2048, lm head tied to the 151,936-row embedding);
vision tower of 32 blocks (hidden 1280, 16 heads of 80, 2D rotary, window attention over 4x4
merge units with full attention in blocks 7/15/23/31, as transformers' tower and
hf_iteration.py run it), patch merger to 2048. Window attention runs as one batched SDPA call
over equal windows (what flash-attn's varlen call does), not a loop per window. `--check-hf`
loads these weights into transformers' Qwen2_5_VLForConditionalGeneration at toy sizes in fp32
and compares the tower's output and a group's log-probs (agreement to ~1e-6), then checks the
rollout's log-probs against a scoring pass. (transformers computes M-RoPE positions only when
given `mm_token_type_ids`, which hf_iteration.py does not pass, so its positions are 1D; the
FLOPs are the same.)

What is tuned, phase by phase:
- rollout: each prompt's video encoded once per iteration (the tower is frozen, so the
  reference and the actor reuse that encoding in scoring and training, as the pipeline does);
  each group's prompt prefilled once (SDPA flash, all prompts in one batch) and its K/V kept
  once per group and shared by the group's 8 samples (what prefix caching gives a serving
  engine: the prefix is neither recomputed nor copied per sample); decode over a static KV
  cache [group prefixes | per-sample suffixes], each step one CUDA graph: the prefix part of
  attention reads a group's prefix once for its 8 samples (flash attention with the samples as
  query rows, returning its log-sum-exp), the suffix part is exact masked attention over the
  sample's own cache, the two merged by their log-sum-exps; groups are ordered by the step
  their last sample stops, so the alive groups are always the leading rows and a step runs the
  smallest batch bucket that holds them (BUCKETS groups: 16/12/8/6/4/3/2/1) and the smallest
  suffix length bucket (multiples of LEN_BUCKET, 64) that holds the step: one graph per
  (bucket, length) pair the forced lengths use, captured in the warm-up; sampling at
  temperature 1 on the device (Gumbel-max, vision special tokens suppressed) and each token's
  log-prob recorded in the graph; the host only replays graphs (forced lengths are known up
  front, so the stop test is host bookkeeping: no device sync until the rollout ends);
- scoring: reference log-probs per group with the group's prompt run once and the 8 responses
  attending to it (a lower-right causal mask over [prompt | response]), logits only for the
  response positions; the old log-probs are the sampler's (the pipeline runs no old-log-prob
  pass either: one optimizer step per iteration makes the actor the sampler), or an actor
  pass like the reference one with OLD_PASS=1 / --old-pass (veRL's default);
- training: micro-batches of one group (MB = 8 samples), each group's prompt run once with the
  8 responses attending to it and its gradient summed over them, activations kept (no
  recomputation; RECOMPUTE=1 / --recompute recomputes each decoder layer in backward from its
  kept input, what a user turns on when the step does not fit, as on an 80 GB card at 8
  prompts);
- compilation: the pieces between attention calls (RMSNorm + q|k|v + rotary; o projection +
  residual + RMSNorm + SwiGLU + residual), the lm head + log-softmax, the sampler and the
  decode attention's suffix and merge are `torch.compile`d (dynamic shapes; every phase uses
  them; compiled in the warm-up, `compiles_in_timed_iterations` says whether anything compiled
  later; COMPILE=0 / --no-compile runs eagerly, a compile error falls back to eager and is
  listed in `compile_failed`); attention calls stay outside, each checked at start-up against
  math attention (forward and backward) and required to run a fused SDPA kernel on the GPU;
- precision: bf16 compute weights; fp32 gradient sums (each micro-batch's bf16 gradients added
  into them), the clip on the fp32 sums, `torch.optim.AdamW(fused=True)` on fp32 master weights
  with fp32 moments, then the bf16 weights copied from the masters: what Rollplex keeps (fp32
  masters, moments and gradient sums, bf16 compute copy). hf_iteration.py instead runs AdamW on
  the bf16 parameters. The reference is a second bf16 copy of the text decoder (the frozen
  tower is shared).

Warm-up: iteration 0 runs the whole iteration (compiles, captures the decode graphs of every
(bucket, length) pair the run's forced lengths use, allocates the optimizer state); iterations
1..ITERS (2) are timed, each phase between `torch.cuda.synchronize()`s. The warm-up's time and
the graph capture's are reported separately (warmup_s, capture_s).

Output: a table per timed iteration and their mean, and one JSON object (`RESULT {...}` on
stdout, and `strong_iteration.json` in RESULTS_DIR) with hf_iteration.py's keys (time_s,
rollout_s, scoring_s, training_s, response_tokens, response_len_mean, decode_steps,
micro_batches, optimizer_steps, loss, kl, grad_norm, tokens_per_s, peaks per phase): the mean
of the timed iterations (tokens_per_s = their response tokens / their time), each timed
iteration under `iterations`.

Knobs: the job's (iteration_common.py: PROMPTS or --prompts N, G, MAX_NEW, MB, SEED,
ITERATION, MEDIAN, SIGMA), ITERS / --iters (timed iterations, 2), OLD_PASS=1 / --old-pass,
COMPILE=0 / --no-compile, GRAPHS=0 / --no-graphs (decode steps launched eagerly), RECOMPUTE=1 /
--recompute (training activations recomputed per layer), BUCKETS
(group counts of the decode batch buckets), LEN_BUCKET (64), DEVICE (cuda if present),
RESULTS_DIR (.). `--tiny`: a toy model (2 text layers, narrow widths, a 2 x 16 x 16 video grid),
2 prompts, responses of median 12 capped at 24: a dry run on the CPU (no graphs; no compile
unless COMPILE=1) or a quick check of the graph and compile paths on a GPU. `--check-hf` (needs
transformers): the checks above, then exit. `--lengths N` and `--write-golden PATH` work as in
hf_iteration.py.
"""
import argparse
import contextlib
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import iteration_common as C  # noqa: E402

ENV = os.environ
ap = argparse.ArgumentParser(description="the tuned PyTorch peer of one RL iteration of examples/h200-3b-video.rpx")
ap.add_argument("--tiny", action="store_true", help="toy sizes for a dry run (CPU or GPU)")
ap.add_argument("--prompts", type=int, default=None, help="prompts per iteration (PROMPTS; default 16)")
ap.add_argument("--iters", type=int, default=int(ENV.get("ITERS", "2")), help="timed iterations after the warm-up")
ap.add_argument("--old-pass", action="store_true", default=ENV.get("OLD_PASS") == "1",
                help="score old log-probs with an actor pass instead of taking the sampler's")
ap.add_argument("--no-compile", action="store_true", default=ENV.get("COMPILE") == "0")
ap.add_argument("--no-graphs", action="store_true", default=ENV.get("GRAPHS") == "0")
ap.add_argument("--recompute", action="store_true", default=ENV.get("RECOMPUTE") == "1",
                help="training recomputes each decoder layer in backward (activation checkpointing)")
ap.add_argument("--check-hf", action="store_true",
                help="check the compact model against transformers' Qwen2.5-VL (toy sizes, fp32) and exit")
ap.add_argument("--lengths", type=int, default=None, help="print the forced lengths of samples 0..N and exit")
ap.add_argument("--write-golden", default=None, help="write the job's forced lengths to PATH and exit")
ARGS = ap.parse_args()

TINY = ARGS.tiny or ARGS.check_hf
JOB = C.Job(prompts=ARGS.prompts, defaults={"PROMPTS": 2, "MAX_NEW": 24, "MEDIAN": 12} if TINY else None)
JOB.handle_length_cli(sys.argv, "tests/reference/strong_iteration.py")

# ---------------------------------------------------------------------------------------------
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.utils.checkpoint  # noqa: E402
from torch.nn.attention.bias import causal_lower_right  # noqa: E402

DEV = torch.device(ENV.get("DEVICE", "cuda" if torch.cuda.is_available() else "cpu"))
CUDA = DEV.type == "cuda"
USE_GRAPHS = CUDA and not ARGS.no_graphs
USE_COMPILE = (CUDA or ENV.get("COMPILE") == "1") and not ARGS.no_compile  # COMPILE=1: on the CPU too
BF = torch.float32 if ARGS.check_hf else torch.bfloat16  # the check compares in fp32
if ARGS.check_hf:  # full fp32 on the GPU too (cuDNN's convolutions take TF32 by default)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
DIMS = C.Dims(small=TINY)
PROMPTS, G, MAX_NEW, N = JOB.prompts, JOB.group, JOB.max_new, JOB.samples
MB = JOB.micro_batch
assert MB % G == 0, f"MB ({MB}) must be whole groups of G ({G}): each group's prompt runs once"
P, NTOK, TEXT = DIMS.PROMPT_LEN, DIMS.NTOK, DIMS.TEXT
TX, VS = DIMS.txt, DIMS.vis
H, FFN, LAYERS = TX["hidden_size"], TX["intermediate_size"], TX["num_hidden_layers"]
NQ, NKV = TX["num_attention_heads"], TX["num_key_value_heads"]
HD = H // NQ
GRP = NQ // NKV
VOCAB, EPS = TX["vocab_size"], TX["rms_norm_eps"]
SCALE = 1.0 / math.sqrt(HD)
MROPE = TX["rope_scaling"]["mrope_section"]
TOKENS_PER_SECOND = VS.get("tokens_per_second", 4)  # transformers' default; the config sets none
BUCKETS = sorted({b for b in (int(x) for x in ENV.get("BUCKETS", "16,12,8,6,4,3,2,1").split(",")) if 0 < b < PROMPTS}
                 | {PROMPTS})
LEN_BUCKET = int(ENV.get("LEN_BUCKET", "64"))
ITERS = ARGS.iters

res = {"baseline": "pytorch, tuned", "peer": "tests/reference/strong_iteration.py", "pipeline": "examples/h200-3b-video.rpx",
       "device": str(DEV), "torch": torch.__version__, "small": TINY, "prompts": PROMPTS, "group": G, "samples": N,
       "prompt_len": P, "max_new_tokens": MAX_NEW, "micro_batch": MB, "seed": JOB.seed, "iteration": JOB.iteration,
       "gen_batch": N, "response_len": JOB.response_len_text(), "cuda_graphs": USE_GRAPHS, "torch_compile": USE_COMPILE,
       "old_logprobs": "actor pass" if ARGS.old_pass else "sampler", "buckets_groups": BUCKETS,
       "training_activations": "recomputed per layer" if ARGS.recompute else "kept",
       "len_bucket": LEN_BUCKET, "precision": "bf16 compute, fp32 masters + moments + gradient sums"}
if CUDA:
    res["gpu"] = torch.cuda.get_device_name()
REC = C.Recorder("strong_iteration.json", CUDA, res)
print(f"torch {torch.__version__} on {res.get('gpu', DEV)}; cuda graphs {USE_GRAPHS}, torch.compile {USE_COMPILE}",
      flush=True)

# ---------------------------------------------------------------------------------------------
# weights


def normal(*shape):
    return (torch.randn(*shape, device=DEV, dtype=torch.float32) * 0.02).to(BF)


def ones(n):
    return torch.ones(n, device=DEV, dtype=BF)


def zeros(n):
    return torch.zeros(n, device=DEV, dtype=BF)


class Text:
    """The text decoder's weights: `embed` (also the lm head), per layer n1, wqkv, bqkv, wo, n2,
    wgu (gate | up), wd, and the final `norm`."""
    NAMES = ["n1", "wqkv", "bqkv", "wo", "n2", "wgu", "wd"]

    def __init__(self, src=None):
        if src is None:
            qkv = (NQ + 2 * NKV) * HD
            self.embed = normal(VOCAB, H)
            self.layers = [dict(n1=ones(H), wqkv=normal(qkv, H), bqkv=zeros(qkv), wo=normal(H, NQ * HD), n2=ones(H),
                                wgu=normal(2 * FFN, H), wd=normal(H, FFN)) for _ in range(LAYERS)]
            self.norm = ones(H)
        else:
            self.embed = src.embed.detach().clone()
            self.layers = [{k: v.detach().clone() for k, v in lw.items()} for lw in src.layers]
            self.norm = src.norm.detach().clone()

    def tensors(self):
        return [self.embed] + [lw[k] for lw in self.layers for k in self.NAMES] + [self.norm]


class Vision:
    """The frozen vision tower and merger: patch embedding (the Conv3d as a matrix), per block
    n1, wqkv, bqkv, wo, bo, n2, wgu (gate | up), bgu, wd, bd; merger ln, w1, b1, w2, b2."""

    def __init__(self):
        c, f, m = VS["hidden_size"], VS["intermediate_size"], VS["spatial_merge_size"] ** 2
        self.patch = normal(c, DIMS.PATCH_DIM)
        self.blocks = [dict(n1=ones(c), wqkv=normal(3 * c, c), bqkv=zeros(3 * c), wo=normal(c, c), bo=zeros(c),
                            n2=ones(c), wgu=normal(2 * f, c), bgu=zeros(2 * f), wd=normal(c, f), bd=zeros(c))
                       for _ in range(VS["depth"])]
        self.ln, self.w1, self.b1 = ones(c), normal(m * c, m * c), zeros(m * c)
        self.w2, self.b2 = normal(VS["out_hidden_size"], m * c), zeros(VS["out_hidden_size"])

    def tensors(self):
        return ([self.patch] + [t for b in self.blocks for t in b.values()]
                + [self.ln, self.w1, self.b1, self.w2, self.b2])


t0 = time.perf_counter()
torch.manual_seed(7)
VISION = Vision()
ACTOR = Text()
REFERENCE = Text(ACTOR)  # the reference policy: the actor's initial text decoder (the tower is shared)
TRAINABLE = ACTOR.tensors()
for t in TRAINABLE:
    t.requires_grad_(True)
MASTERS = [t.detach().float().clone().requires_grad_(True) for t in TRAINABLE]
for m in MASTERS:
    m.grad = torch.zeros_like(m)  # the fp32 gradient sums, kept across iterations
OPT = torch.optim.AdamW(MASTERS, lr=C.LR, betas=C.BETAS, eps=C.ADAM_EPS, weight_decay=C.WEIGHT_DECAY,
                        **({"fused": True} if CUDA else {}))
REC.sync()
res["build_s"] = time.perf_counter() - t0
res["trainable_params_b"] = sum(t.numel() for t in TRAINABLE) / 1e9
res["params_b"] = res["trainable_params_b"] + sum(t.numel() for t in VISION.tensors()) / 1e9
print(f"weights built in {res['build_s']:.1f} s: {res['params_b']:.3f} B parameters "
      f"({res['trainable_params_b']:.3f} B trainable)", flush=True)

# ---------------------------------------------------------------------------------------------
# rotary tables


def text_rope():
    """cos / sin [rows, 1, HD] of the prompt (M-RoPE: (t, h, w) positions for the video tokens,
    as transformers' get_rope_index) and of the response tokens (text positions after it)."""
    gt, gh, gw = DIMS.T, DIMS.GH // 2, DIMS.GW // 2
    t_i = torch.arange(gt).view(-1, 1, 1).expand(gt, gh, gw).reshape(-1) * TOKENS_PER_SECOND + 1
    h_i = torch.arange(gh).view(1, -1, 1).expand(gt, gh, gw).reshape(-1) + 1
    w_i = torch.arange(gw).view(1, 1, -1).expand(gt, gh, gw).reshape(-1) + 1
    cur = 1 + max(gh, gw)
    text = torch.arange(cur, cur + 1 + TEXT)  # vision end, then the text
    pos = torch.stack([torch.cat([torch.zeros(1, dtype=torch.long), a, text]) for a in (t_i, h_i, w_i)])  # [3, P]
    resp = torch.arange(cur + 1 + TEXT, cur + 1 + TEXT + MAX_NEW)
    inv = 1.0 / (TX["rope_theta"] ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD))
    sec = torch.repeat_interleave(torch.arange(3), torch.tensor(MROPE))  # axis of each frequency

    def table(p3):
        f = (p3.double()[:, :, None] * inv[None, None, :])  # [3, rows, HD/2]
        f = f.gather(0, sec.view(1, 1, -1).expand(1, f.shape[1], -1))[0]
        e = torch.cat([f, f], -1)
        return e.cos().to(DEV, BF)[:, None, :], e.sin().to(DEV, BF)[:, None, :]

    return table(pos), table(resp.view(1, -1).expand(3, -1))


(COS_P, SIN_P), (COS_R, SIN_R) = text_rope()
COS_R2, SIN_R2 = COS_R[:, 0], SIN_R[:, 0]  # [MAX_NEW, HD]: the decode step reads one row


def vision_layout():
    """The window permutation of the merge units (transformers' get_vision_window_index for one
    video), the vision rotary table in window order, and the attention segment sizes."""
    gt, gh, gw = DIMS.T, DIMS.GH // 2, DIMS.GW // 2
    ws = VS["window_size"] // VS["spatial_merge_size"] // VS["patch_size"]
    assert gh % ws == 0 and gw % ws == 0, "the batched window attention needs whole windows"
    idx = torch.arange(gt * gh * gw).view(gt, gh // ws, ws, gw // ws, ws).permute(0, 1, 3, 2, 4).reshape(-1)
    hd = VS["hidden_size"] // VS["num_heads"]
    inv = 1.0 / (10000.0 ** (torch.arange(0, hd // 2, 2, dtype=torch.float32) / (hd // 2)))
    ms = VS["spatial_merge_size"]
    hh = (torch.arange(gh).view(-1, 1, 1, 1) * ms + torch.arange(ms).view(1, 1, -1, 1)).expand(gh, gw, ms, ms)
    ww = (torch.arange(gw).view(1, -1, 1, 1) * ms + torch.arange(ms).view(1, 1, 1, -1)).expand(gh, gw, ms, ms)
    hh = hh.reshape(1, -1).expand(gt, -1).reshape(-1)  # per patch, processor order (t, h/2, w/2, 2, 2)
    ww = ww.reshape(1, -1).expand(gt, -1).reshape(-1)
    f = torch.cat([hh[:, None] * inv, ww[:, None] * inv], -1)
    e = torch.cat([f, f], -1)
    unit = ms * ms
    e = e.view(-1, unit, hd)[idx].reshape(-1, hd)  # window order
    return (idx.to(DEV), torch.argsort(idx).to(DEV), e.cos().to(DEV)[:, None, :], e.sin().to(DEV)[:, None, :],
            ws * ws * unit, DIMS.GH * DIMS.GW)


WIN_IDX, WIN_REV, VCOS, VSIN, WIN_LEN, FRAME_LEN = vision_layout()
SPECIAL_NEG = torch.zeros(VOCAB, device=DEV)
SPECIAL_NEG[C.SPECIAL] = float("-inf")

# ---------------------------------------------------------------------------------------------
# the model's pieces (compiled where it pays; attention stays outside the compiled regions)


def rms(x, w):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def rot(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def layer_pre(x, n1, wqkv, bqkv, cos, sin):
    """RMSNorm, q|k|v projection, rotary: x [rows, H] -> q [rows, NQ, HD], k, v [rows, NKV, HD]."""
    qkv = F.linear(rms(x, n1), wqkv, bqkv)
    q, k, v = qkv.split([NQ * HD, NKV * HD, NKV * HD], dim=-1)
    q = q.unflatten(-1, (NQ, HD))
    k = k.unflatten(-1, (NKV, HD))
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin, v.unflatten(-1, (NKV, HD)).contiguous()


def layer_post(x, a, wo, n2, wgu, wd):
    """o projection + residual, RMSNorm, SwiGLU FFN + residual."""
    x = x + F.linear(a, wo)
    g, u = F.linear(rms(x, n2), wgu).split([FFN, FFN], dim=-1)
    return x + F.linear(F.silu(g) * u, wd)


def head_logits(x, norm, embed):
    return F.linear(rms(x, norm), embed)


def head_logp(h, norm, embed, tgt):
    """Log-probs (f32) of the targets under the lm head of the final hidden states h [.., H]."""
    logits = F.linear(rms(h, norm), embed).float()
    return logits.log_softmax(-1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)


def sample(logits, u, neg):
    """Gumbel-max at temperature 1 with the special tokens suppressed; the token's log-prob
    under the full distribution (what a scoring pass computes)."""
    lf = logits.float()
    lse = torch.logsumexp(lf, -1)
    tok = torch.argmax(lf + neg - torch.log(-torch.log(u)), -1)
    return tok, lf.gather(1, tok[:, None]).squeeze(1) - lse


def dec_suffix(qs, ks, vs, bias):
    """Decode attention over a sample's own cache: qs [B, NKV, GRP, HD], ks / vs [B, NKV, Lc, HD],
    bias [Lc] (0 up to the step, -inf after); returns the output and its log-sum-exp."""
    s = torch.matmul(qs, ks.transpose(-1, -2)).float() * SCALE + bias
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)).to(qs.dtype), vs), lse


def dec_merge(op, lp, os_, ls):
    """Merges the prefix and suffix parts of attention by their log-sum-exps -> [B, NQ * HD]."""
    w = torch.sigmoid(lp - ls).unsqueeze(-1)
    return (op.float() * w + os_.float() * (1.0 - w)).to(op.dtype).reshape(op.shape[0], -1)


COMPILE_FAILED = []


class Piece:
    """A function run compiled (torch.compile, dynamic shapes) or eagerly; a compile error falls
    back to eager once, and is reported (`compile_failed`)."""

    def __init__(self, fn):
        self.eager, self.name = fn, fn.__name__
        self.fn = torch.compile(fn, dynamic=None) if USE_COMPILE else fn

    def __call__(self, *a):
        if self.fn is self.eager:
            return self.eager(*a)
        try:
            return self.fn(*a)
        except Exception as e:  # noqa: BLE001 - the measurement goes on eagerly, and says so
            print(f"torch.compile of {self.name} failed ({type(e).__name__}: {str(e)[:300]}); running it eagerly",
                  flush=True)
            COMPILE_FAILED.append(self.name)
            self.fn = self.eager
            return self.eager(*a)


if USE_COMPILE:
    import torch._dynamo
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 4096
PRE, POST = Piece(layer_pre), Piece(layer_post)
HEAD_LOGITS, HEAD_LOGP, SAMPLE = Piece(head_logits), Piece(head_logp), Piece(sample)
DEC_SUFFIX, DEC_MERGE = Piece(dec_suffix), Piece(dec_merge)

# ---------------------------------------------------------------------------------------------
# attention: each candidate checked against plain math on small inputs of the model's head
# shapes (forward and backward); the first that agrees is used


def expand_kv(k):
    return k.repeat_interleave(NQ // k.shape[1], dim=1)


def lower_right_mask(lq, lk, device):
    return torch.ones(lq, lk, dtype=torch.bool, device=device).tril(lk - lq)


PREFIX_CANDIDATES = {  # causal self-attention of a prompt: q [b, NQ, L, HD], k / v [b, NKV, L, HD]
    "sdpa causal, gqa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
    "sdpa causal, kv expanded": lambda q, k, v: F.scaled_dot_product_attention(
        q, expand_kv(k), expand_kv(v), is_causal=True),
}
SUFFIX_CANDIDATES = {  # responses over [prompt | response]: q [b, NQ, R, HD], k / v [b, NKV, P + R, HD]
    "sdpa lower-right causal, gqa": lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]), enable_gqa=True),
    "sdpa lower-right causal, kv expanded": lambda q, k, v: F.scaled_dot_product_attention(
        q, expand_kv(k), expand_kv(v), attn_mask=causal_lower_right(q.shape[2], k.shape[2])),
    "sdpa boolean mask, kv expanded": lambda q, k, v: F.scaled_dot_product_attention(
        q, expand_kv(k), expand_kv(v), attn_mask=lower_right_mask(q.shape[2], k.shape[2], q.device)),
}


def flash_lse(q, k, v):
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=SCALE)[:2]
    return o, lse


def math_lse(q, k, v):
    s = torch.matmul(q, k.transpose(-1, -2)).float() * SCALE
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)).to(q.dtype), v), lse


DECODE_PREFIX_CANDIDATES = {  # a group's prefix for its samples' queries: q [nb, NKV, G * GRP, HD]
    "flash with log-sum-exp": flash_lse,
    "math": math_lse,
}


def reference_attention(q, k, v, mask):
    """fp32 math attention with expanded heads; mask [lq, lk] bool (True = attend)."""
    q, k, v = q.float(), expand_kv(k).float(), expand_kv(v).float()
    s = torch.matmul(q, k.transpose(-1, -2)) * SCALE
    s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, -1), v)


def close(a, b):
    a, b = a.detach().float(), b.detach().float()
    return bool(torch.isfinite(a).all()) and float((a - b).abs().max()) <= 2e-2 * max(1.0, float(b.abs().max()))


def fused_only():
    """On the GPU, SDPA without its math fallback: a candidate that would silently run unfused
    (materialised scores, slow and memory-hungry at these lengths) fails its check instead."""
    if not CUDA:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION])


def pick(kind, candidates, check):
    for name, fn in candidates.items():
        try:
            with fused_only():
                ok = check(fn)
            if ok:
                res[f"attention_{kind}"] = name
                print(f"attention ({kind}): {name}", flush=True)
                return fn
            print(f"attention ({kind}): {name} disagrees with math, not used", flush=True)
        except Exception as e:  # noqa: BLE001 - an unsupported kernel is a candidate less
            print(f"attention ({kind}): {name} unavailable ({type(e).__name__}: {str(e)[:200]})", flush=True)
    raise RuntimeError(f"no attention candidate for {kind} agrees with math")


def check_grad(fn, shapes, mask):
    torch.manual_seed(0)
    q, k, v = (torch.randn(*s, device=DEV, dtype=BF).requires_grad_(True) for s in shapes)
    out = fn(q, k, v)
    ref = reference_attention(q, k, v, mask)
    if not close(out, ref):
        return False
    go = torch.randn_like(out)
    g1 = torch.autograd.grad(out, (q, k, v), go)
    g2 = torch.autograd.grad(ref, (q, k, v), go.float())
    return all(close(a, b) for a, b in zip(g1, g2))


def check_decode_prefix(fn):
    torch.manual_seed(0)
    q = torch.randn(3, NKV, G * GRP, HD, device=DEV, dtype=BF)
    k, v = (torch.randn(3, NKV, 45, HD, device=DEV, dtype=BF) for _ in range(2))
    o, lse = fn(q, k, v)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * SCALE
    return (tuple(lse.shape) == (3, NKV, G * GRP) and close(o, torch.matmul(torch.softmax(s, -1), v.float()))
            and close(lse, torch.logsumexp(s, -1)))


Lq, Lp = 11, 37
ATT_PREFIX = pick("prompt", PREFIX_CANDIDATES, lambda fn: check_grad(
    fn, [(2, NQ, Lp, HD), (2, NKV, Lp, HD), (2, NKV, Lp, HD)], lower_right_mask(Lp, Lp, DEV)))
ATT_SUFFIX = pick("responses over the prompt", SUFFIX_CANDIDATES, lambda fn: check_grad(
    fn, [(3, NQ, Lq, HD), (3, NKV, Lp + Lq, HD), (3, NKV, Lp + Lq, HD)], lower_right_mask(Lq, Lp + Lq, DEV)))
DEC_PREFIX = pick("decode prefix", DECODE_PREFIX_CANDIDATES, check_decode_prefix)


def decode_attention(q, kp, vp, ks, vs, bias):
    """One decode step's attention. q [B, NQ, HD] (B = nb groups x G samples, group-major),
    kp / vp [nb, NKV, P, HD] the groups' prompts (read once per group), ks / vs [B, NKV, Lc, HD]
    the samples' own caches, bias [Lc]."""
    nb, b = kp.shape[0], q.shape[0]
    qg = q.view(nb, G, NKV, GRP, HD).transpose(1, 2).reshape(nb, NKV, G * GRP, HD)
    op, lp = DEC_PREFIX(qg, kp, vp)
    op = op.view(nb, NKV, G, GRP, HD).transpose(1, 2).reshape(b, NKV, GRP, HD)
    lp = lp.view(nb, NKV, G, GRP).transpose(1, 2).reshape(b, NKV, GRP)
    os_, ls = DEC_SUFFIX(q.view(b, NKV, GRP, HD), ks, vs, bias)
    return DEC_MERGE(op, lp, os_, ls)


def check_decode_attention():
    """The whole decode attention (prefix + suffix merged) against math over [prompt | suffix]."""
    torch.manual_seed(0)
    nb, lc, step, lp = 2, 16, 9, 23
    b = nb * G
    q = torch.randn(b, NQ, HD, device=DEV, dtype=BF)
    kp, vp = (torch.randn(nb, NKV, lp, HD, device=DEV, dtype=BF) for _ in range(2))
    ks, vs = (torch.randn(b, NKV, lc, HD, device=DEV, dtype=BF) for _ in range(2))
    bias = torch.where(torch.arange(lc, device=DEV) <= step, 0.0, float("-inf"))
    out = decode_attention(q, kp, vp, ks, vs, bias).view(b, NQ, HD)
    kf = torch.cat([kp.repeat_interleave(G, 0), ks[:, :, :step + 1]], 2)
    vf = torch.cat([vp.repeat_interleave(G, 0), vs[:, :, :step + 1]], 2)
    ref = reference_attention(q[:, :, None, :], kf, vf, torch.ones(1, kf.shape[2], dtype=torch.bool, device=DEV))
    assert close(out, ref[:, :, 0]), "decode attention disagrees with math"


check_decode_attention()


def vision_encode(pix):
    """The frozen tower + merger over S videos: pix [S, NPATCH, PATCH_DIM] -> [S, NTOK, H]."""
    s = pix.shape[0]
    c, nh = VS["hidden_size"], VS["num_heads"]
    hd, unit = c // nh, VS["spatial_merge_size"] ** 2
    x = F.linear(pix.reshape(-1, DIMS.PATCH_DIM), VISION.patch)
    x = x.view(s, -1, unit, c)[:, WIN_IDX].reshape(-1, c)
    cos, sin = VCOS.repeat(s, 1, 1), VSIN.repeat(s, 1, 1)
    for i, bw in enumerate(VISION.blocks):
        seg = FRAME_LEN if i in VS["fullatt_block_indexes"] else WIN_LEN
        q, k, v = F.linear(rms(x, bw["n1"]), bw["wqkv"], bw["bqkv"]).view(-1, 3, nh, hd).unbind(1)
        q = (q.float() * cos + rot(q.float()) * sin).to(BF)
        k = (k.float() * cos + rot(k.float()) * sin).to(BF)
        q, k, v = (t.reshape(-1, seg, nh, hd).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(-1, c)
        x = x + F.linear(a, bw["wo"], bw["bo"])
        g, u = F.linear(rms(x, bw["n2"]), bw["wgu"], bw["bgu"]).chunk(2, dim=-1)
        x = x + F.linear(F.silu(g) * u, bw["wd"], bw["bd"])
    y = rms(x, VISION.ln).view(-1, unit * c)
    y = F.linear(F.gelu(F.linear(y, VISION.w1, VISION.b1)), VISION.w2, VISION.b2)
    return y.view(s, -1, VS["out_hidden_size"])[:, WIN_REV]


def prompt_embeddings(w, ids, feats):
    """ids [S, P], feats [S, NTOK, H] -> [S, P, H]: the video rows are the tower's output."""
    e = F.embedding(ids, w.embed)
    return torch.cat([e[:, :1], feats.to(e.dtype), e[:, 1 + NTOK:]], 1)


def group_logp(w, ids, feats, resp):
    """Log-probs [G, R] of one group's responses resp [G, R] (right-padded) under weights `w`:
    the group's prompt runs once, the G responses attend to it (prompt gradients summed over
    them); logits only at the response positions. Builds a graph when grad is enabled."""
    g_, r = resp.shape
    rin = r - 1  # response tokens fed as inputs; token 0 is scored from the prompt's last row
    xp = prompt_embeddings(w, ids[None], feats[None])[0]
    x = torch.cat([xp, F.embedding(resp[:, :rin], w.embed).reshape(g_ * rin, H)])
    cos = torch.cat([COS_P, COS_R[:rin].repeat(g_, 1, 1)])
    sin = torch.cat([SIN_P, SIN_R[:rin].repeat(g_, 1, 1)])

    def layer(x, lw):
        q, k, v = PRE(x, lw["n1"], lw["wqkv"], lw["bqkv"], cos, sin)
        qp, kp, vp = (t[:P].transpose(0, 1)[None] for t in (q, k, v))
        a = [ATT_PREFIX(qp, kp, vp)[0].transpose(0, 1).reshape(P, NQ * HD)]
        if rin > 0:
            qs, ks, vs = (t[P:].view(g_, rin, -1, HD).transpose(1, 2) for t in (q, k, v))
            kc = torch.cat([kp.expand(g_, -1, -1, -1), ks], 2)
            vc = torch.cat([vp.expand(g_, -1, -1, -1), vs], 2)
            a.append(ATT_SUFFIX(qs, kc, vc).transpose(1, 2).reshape(g_ * rin, NQ * HD))
        return POST(x, torch.cat(a) if rin > 0 else a[0], lw["wo"], lw["n2"], lw["wgu"], lw["wd"])

    recompute = ARGS.recompute and torch.is_grad_enabled()
    for lw in w.layers:
        # --recompute: only each layer's input is kept; backward runs the layer again
        x = torch.utils.checkpoint.checkpoint(layer, x, lw, use_reentrant=False) if recompute else layer(x, lw)
    hs = torch.cat([x[P - 1:P].expand(g_, H)[:, None], x[P:].view(g_, rin, H)], 1)
    return HEAD_LOGP(hs, w.norm, w.embed, resp)


def check_against_transformers():
    """Loads these weights into transformers' Qwen2.5-VL (the class hf_iteration.py runs) and
    compares the vision tower + merger output and one group's response log-probs."""
    import transformers
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    cfg = Qwen2_5_VLConfig(vision_config=VS, text_config=TX, image_token_id=151655, video_token_id=C.VIDEO,
                           vision_start_token_id=C.VSTART, vision_end_token_id=C.VEND, tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    hf = Qwen2_5_VLForConditionalGeneration(cfg).to(DEV, BF).eval()
    v, t, sd = "model.visual.", "model.language_model.", {}
    sd[v + "patch_embed.proj.weight"] = VISION.patch.view(
        -1, VS["in_channels"], VS["temporal_patch_size"], VS["patch_size"], VS["patch_size"])
    for i, b in enumerate(VISION.blocks):
        p = f"{v}blocks.{i}."
        gate, up = b["wgu"].chunk(2)
        bgate, bup = b["bgu"].chunk(2)
        sd.update({p + "norm1.weight": b["n1"], p + "norm2.weight": b["n2"], p + "attn.qkv.weight": b["wqkv"],
                   p + "attn.qkv.bias": b["bqkv"], p + "attn.proj.weight": b["wo"], p + "attn.proj.bias": b["bo"],
                   p + "mlp.gate_proj.weight": gate, p + "mlp.gate_proj.bias": bgate, p + "mlp.up_proj.weight": up,
                   p + "mlp.up_proj.bias": bup, p + "mlp.down_proj.weight": b["wd"], p + "mlp.down_proj.bias": b["bd"]})
    sd.update({v + "merger.ln_q.weight": VISION.ln, v + "merger.mlp.0.weight": VISION.w1,
               v + "merger.mlp.0.bias": VISION.b1, v + "merger.mlp.2.weight": VISION.w2,
               v + "merger.mlp.2.bias": VISION.b2})
    sd.update({t + "embed_tokens.weight": ACTOR.embed, "lm_head.weight": ACTOR.embed, t + "norm.weight": ACTOR.norm})
    for i, lw in enumerate(ACTOR.layers):
        p = f"{t}layers.{i}."
        q, k, vv = lw["wqkv"].split([NQ * HD, NKV * HD, NKV * HD])
        bq, bk, bv = lw["bqkv"].split([NQ * HD, NKV * HD, NKV * HD])
        gate, up = lw["wgu"].chunk(2)
        sd.update({p + "input_layernorm.weight": lw["n1"], p + "post_attention_layernorm.weight": lw["n2"],
                   p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                   p + "self_attn.v_proj.weight": vv, p + "self_attn.q_proj.bias": bq,
                   p + "self_attn.k_proj.bias": bk, p + "self_attn.v_proj.bias": bv,
                   p + "self_attn.o_proj.weight": lw["wo"], p + "mlp.gate_proj.weight": gate,
                   p + "mlp.up_proj.weight": up, p + "mlp.down_proj.weight": lw["wd"]})
    hf.load_state_dict({k: x.detach() for k, x in sd.items()}, strict=True)
    gen = torch.Generator(device="cpu").manual_seed(1)
    pix = torch.randn(DIMS.NPATCH, DIMS.PATCH_DIM, generator=gen).to(DEV, BF)
    ids = torch.randint(1000, 100000, (P,), generator=gen).to(DEV)
    ids[0], ids[1:1 + NTOK], ids[1 + NTOK] = C.VSTART, C.VIDEO, C.VEND
    r = 7
    resp = torch.randint(1000, 100000, (G, r), generator=gen).to(DEV)
    grid = torch.tensor([[DIMS.T, DIMS.GH, DIMS.GW]], device=DEV)
    with torch.no_grad():
        mine_v = vision_encode(pix[None])[0]
        hf_v = hf.model.visual(pix, grid_thw=grid).pooler_output
        mine = group_logp(ACTOR, ids, mine_v, resp)
        seqs = torch.cat([ids[None].expand(G, -1), resp], 1)
        types = (seqs == C.VIDEO).int() * 2  # video tokens: without them transformers uses 1D positions
        out = hf(input_ids=seqs, attention_mask=torch.ones_like(seqs), pixel_values_videos=pix.repeat(G, 1),
                 video_grid_thw=grid.repeat(G, 1), mm_token_type_ids=types, use_cache=False,
                 logits_to_keep=r + 1)
        theirs = torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, resp[..., None]).squeeze(-1)
    dv = float((mine_v - hf_v).abs().max() / hf_v.abs().max())
    dl = float((mine - theirs).abs().max())
    print(f"against transformers {transformers.__version__} (fp32, toy sizes): vision + merger max relative "
          f"difference {dv:.2e}, response log-probs max difference {dl:.2e}", flush=True)
    assert dv < 1e-4 and dl < 1e-3, "the compact model disagrees with transformers' Qwen2.5-VL"


# ---------------------------------------------------------------------------------------------
# the rollout's static state and its decode step


KP = torch.zeros(LAYERS, PROMPTS, NKV, P, HD, device=DEV, dtype=BF)  # group prefixes, slot order
VP = torch.zeros_like(KP)
KS = torch.zeros(LAYERS, N, NKV, MAX_NEW, HD, device=DEV, dtype=BF)  # per-sample suffixes, row order
VS_ = torch.zeros_like(KS)
CUR = torch.zeros(N, dtype=torch.long, device=DEV)  # the token each row feeds next
STEP = torch.zeros(1, dtype=torch.long, device=DEV)  # decode step: the response token fed now
OUT_TOK = torch.full((N, MAX_NEW), C.EOS_PAD, dtype=torch.long, device=DEV)
OUT_LOGP = torch.zeros(N, MAX_NEW, device=DEV)
ARANGE = torch.arange(MAX_NEW, device=DEV)
NEG_INF = torch.tensor(float("-inf"), device=DEV)
ZERO = torch.tensor(0.0, device=DEV)


def decode_step(nb, lc):
    """One decode step of the first nb slots' G samples each over suffix length bucket lc: feeds
    CUR (response token STEP), writes its K/V at suffix slot STEP, samples token STEP + 1 into
    OUT_TOK / OUT_LOGP and CUR, advances STEP. Device tensors only: capturable as a graph."""
    b = nb * G
    x = F.embedding(CUR[:b], ACTOR.embed)
    cos = COS_R2.index_select(0, STEP)[:, None, :]
    sin = SIN_R2.index_select(0, STEP)[:, None, :]
    bias = torch.where(ARANGE[:lc] <= STEP, ZERO, NEG_INF)
    for i, lw in enumerate(ACTOR.layers):
        q, k, v = PRE(x, lw["n1"], lw["wqkv"], lw["bqkv"], cos, sin)
        ks, vs = KS[i, :b], VS_[i, :b]
        ks.index_copy_(2, STEP, k[:, :, None, :])
        vs.index_copy_(2, STEP, v[:, :, None, :])
        a = decode_attention(q, KP[i, :nb], VP[i, :nb], ks[:, :, :lc], vs[:, :, :lc], bias)
        x = POST(x, a, lw["wo"], lw["n2"], lw["wgu"], lw["wd"])
    logits = HEAD_LOGITS(x, ACTOR.norm, ACTOR.embed)
    tok, lp = SAMPLE(logits, torch.rand(b, VOCAB, device=DEV), SPECIAL_NEG)
    CUR[:b].copy_(tok)
    nxt = STEP + 1
    OUT_TOK[:b].index_copy_(1, nxt, tok[:, None])
    OUT_LOGP[:b].index_copy_(1, nxt, lp[:, None])
    STEP.add_(1)


def bucket(alive):
    return next(b for b in BUCKETS if b >= alive)


def len_bucket(n):
    return min(MAX_NEW, -(-n // LEN_BUCKET) * LEN_BUCKET)


def schedule(forced):
    """Slot order (groups by the step their last sample stops, latest first) and the decode
    steps' (bucket, length) pairs: step s feeds response token s and samples token s + 1."""
    gmax = [max(forced[g * G:(g + 1) * G]) for g in range(PROMPTS)]
    order = sorted(range(PROMPTS), key=lambda g: (-gmax[g], g))
    steps = []
    for s in range(max(forced) - 1):
        alive = sum(1 for g in range(PROMPTS) if gmax[g] > s + 1)
        steps.append((bucket(alive), len_bucket(s + 1)))
    return order, steps


GRAPHS = {}
POOL = torch.cuda.graph_pool_handle() if USE_GRAPHS else None


def capture(keys):
    """Captures a decode graph for each (bucket, length) pair not captured yet (after one eager
    run on a side stream, which compiles the pieces for that shape)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    for key in sorted(set(keys) - set(GRAPHS), reverse=True):
        capture_one(key, side)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


@torch.no_grad()
def capture_one(key, side):
    with torch.cuda.stream(side):
        STEP.zero_()
        decode_step(*key)
        STEP.zero_()
    side.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=POOL, stream=side):
        decode_step(*key)
    GRAPHS[key] = g


class Marks:
    """Points in a phase, as CUDA events (read after the phase's sync) or host clocks."""

    def __init__(self):
        self.m = []

    def mark(self, name):
        if CUDA:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.m.append((name, e))
        else:
            self.m.append((name, time.perf_counter()))

    def spans(self):
        out = {}
        for (_, a), (name, b) in zip(self.m, self.m[1:]):
            out[name] = a.elapsed_time(b) / 1000 if CUDA else b - a
        return out


# ---------------------------------------------------------------------------------------------
# the iteration

PROMPT_ROWS, VIDEOS, REWARDS0, GEN = C.make_data(JOB, DIMS, DEV)
PROMPT_IDS = torch.tensor(PROMPT_ROWS, device=DEV)  # [PROMPTS, P]
PIXELS = torch.stack(VIDEOS).to(BF)  # [PROMPTS, NPATCH, PATCH_DIM]


def rollout(forced, order, steps, it_res):
    """Vision, prefill, decode. Returns tokens [N, MAX_NEW] and the sampler's log-probs, in
    sample order, and the videos' encodings [PROMPTS, NTOK, H] in group order."""
    marks = Marks()
    marks.mark("start")
    slot = torch.tensor(order, device=DEV)
    feats = vision_encode(PIXELS[slot])  # slot order
    marks.mark("media_s")
    x = prompt_embeddings(ACTOR, PROMPT_IDS[slot], feats).reshape(PROMPTS * P, H)
    cos, sin = COS_P.repeat(PROMPTS, 1, 1), SIN_P.repeat(PROMPTS, 1, 1)
    for i, lw in enumerate(ACTOR.layers):
        q, k, v = PRE(x, lw["n1"], lw["wqkv"], lw["bqkv"], cos, sin)
        q, k, v = (t.view(PROMPTS, P, -1, HD).transpose(1, 2) for t in (q, k, v))
        KP[i].copy_(k)
        VP[i].copy_(v)
        a = ATT_PREFIX(q, k, v).transpose(1, 2).reshape(PROMPTS * P, NQ * HD)
        x = POST(x, a, lw["wo"], lw["n2"], lw["wgu"], lw["wd"])
    last = HEAD_LOGITS(x.view(PROMPTS, P, H)[:, -1], ACTOR.norm, ACTOR.embed).repeat_interleave(G, 0)
    tok, lp = SAMPLE(last, torch.rand(N, VOCAB, device=DEV), SPECIAL_NEG)
    CUR.copy_(tok)
    OUT_TOK[:, 0].copy_(tok)
    OUT_LOGP[:, 0].copy_(lp)
    STEP.zero_()
    marks.mark("prefill_s")
    for key in steps:
        if USE_GRAPHS:
            GRAPHS[key].replay()
        else:
            decode_step(*key)
    marks.mark("decode_s")
    # rows are slot-major: row r * G + j is sample order[r] * G + j
    row_of = torch.tensor([order.index(s // G) * G + s % G for s in range(N)], device=DEV)
    toks, logp = OUT_TOK[row_of], OUT_LOGP[row_of]
    feats = feats[torch.argsort(slot)]
    it_res["_marks"] = marks
    return toks, logp, feats


def score(w, toks, feats, forced, into):
    """Per-token log-probs [N, MAX_NEW] under w, one group at a time."""
    for g in range(PROMPTS):
        r = max(forced[g * G:(g + 1) * G])
        into[g * G:(g + 1) * G, :r] = group_logp(w, PROMPT_IDS[g], feats[g], toks[g * G:(g + 1) * G, :r])


def train(toks, feats, forced, old, ref, adv, sums):
    """Micro-batches of whole groups (each group one forward + backward), fp32 gradient sums,
    clip, fused AdamW on the fp32 masters, bf16 weights copied from them."""
    total = float(sum(forced))
    first = True
    for mb in range(0, PROMPTS, MB // G):
        for g in range(mb, min(mb + MB // G, PROMPTS)):
            rows = slice(g * G, (g + 1) * G)
            r = max(forced[rows])
            lens = torch.tensor(forced[rows], device=DEV)
            mask = (torch.arange(r, device=DEV)[None, :] < lens[:, None]).float()
            new = group_logp(ACTOR, PROMPT_IDS[g], feats[g], toks[rows, :r])
            a = adv[rows, None]
            ratio = torch.exp(new - old[rows, :r])
            pg = -torch.minimum(ratio * a, ratio.clamp(1 - C.CLIP_LO, 1 + C.CLIP_HI) * a)
            d = ref[rows, :r] - new
            kl = torch.exp(d) - d - 1  # k3
            loss = ((pg + C.KL_COEF * kl) * mask).sum() / total
            loss.backward()
            sums[0] += loss.detach()
            sums[1] += (pg.detach() * mask).sum() / total
            sums[2] += (kl.detach() * mask).sum() / total
        with torch.no_grad():
            grads = [t.grad for t in TRAINABLE]
            if first:
                torch._foreach_copy_([m.grad for m in MASTERS], grads)
                first = False
            else:
                torch._foreach_add_([m.grad for m in MASTERS], grads)
        for t in TRAINABLE:
            t.grad = None
        sums[3] += 1
    norm = torch.nn.utils.clip_grad_norm_(MASTERS, C.GRAD_CLIP)
    OPT.step()
    with torch.no_grad():
        torch._foreach_copy_(TRAINABLE, MASTERS)
    return norm


def unique_graphs():
    try:
        from torch._dynamo.utils import counters
        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - a diagnostic only
        return None


def iteration(i):
    """Iteration i of the run (0 = the warm-up): its phases' times and metrics."""
    it = JOB.iteration + i
    forced = JOB.lengths(iteration=it)
    rewards = REWARDS0 if i == 0 else torch.randint(0, 2, (N,), generator=GEN).float()
    order, steps = schedule(forced)
    r = {"iteration": it, "forced_len_mean": sum(forced) / N, "forced_len_max": max(forced)}
    t_iter = time.perf_counter()
    with REC.phase("rollout", into=r), torch.no_grad():
        toks, sampler_logp, feats = rollout(forced, order, steps, r)
    r.update(r.pop("_marks").spans())
    r["rollout_prefill_s"] = r["media_s"] + r["prefill_s"]  # hf_iteration.py's: vision + prefill + first token
    pos = torch.arange(MAX_NEW, device=DEV)
    lens = torch.tensor(forced, device=DEV)
    toks[pos[None, :] >= lens[:, None]] = C.EOS_PAD
    ref_logp = torch.zeros(N, MAX_NEW, device=DEV)
    with REC.phase("scoring_ref", into=r), torch.no_grad():
        score(REFERENCE, toks, feats, forced, ref_logp)
    if ARGS.old_pass:
        old_logp = torch.zeros(N, MAX_NEW, device=DEV)
        with REC.phase("scoring_old", into=r), torch.no_grad():
            score(ACTOR, toks, feats, forced, old_logp)
    else:
        old_logp = sampler_logp
        r["scoring_old_s"], r["scoring_old_peak_gib"] = 0.0, None
    r["scoring_s"] = r["scoring_ref_s"] + r["scoring_old_s"]
    r["scoring_peak_gib"] = max((p for p in (r["scoring_ref_peak_gib"], r["scoring_old_peak_gib"]) if p is not None),
                                default=None)
    with REC.phase("reward", into=r):
        adv = C.grpo_advantages(rewards, PROMPTS, G).to(DEV)
    sums = [torch.zeros((), device=DEV) for _ in range(3)] + [0]
    with REC.phase("training", into=r):
        norm = train(toks, feats, forced, old_logp, ref_logp, adv, sums)
    REC.sync()
    r["time_s"] = time.perf_counter() - t_iter
    r["iteration_s"] = r["time_s"]
    r["decode_steps"] = max(forced)
    r["decode_graph_replays"] = len(steps)
    r["response_tokens"] = sum(forced)
    r["response_len_mean"] = sum(forced) / N
    r["sequence_tokens"] = N * P + r["response_tokens"]
    r["rollout_tokens_per_s"] = r["response_tokens"] / r["rollout_s"]
    r["decode_step_ms_mean"] = 1000 * r["decode_s"] / max(1, len(steps))
    r["micro_batches"], r["optimizer_steps"] = sums[3], 1
    r["loss"], r["pg_loss"], r["kl"] = (float(s) for s in sums[:3])
    r["grad_norm"] = float(norm)
    r["tokens_per_s"] = r["response_tokens"] / r["time_s"]
    # agreement of the sampler's log-probs with the reference's (equal weights in iteration 0)
    m = (pos[None, :] < lens[:, None]).float()
    r["sampler_vs_reference_logp_mean_abs"] = float(((sampler_logp - ref_logp).abs() * m).sum() / m.sum())
    if CUDA:
        r["peak_gib"] = max(r[k] for k in r if k.endswith("_peak_gib") and r[k] is not None)
    return r


def print_iteration(r, title):
    print(f"\n{title}: iteration {r['iteration']}, responses mean {r['response_len_mean']:.1f} / max "
          f"{r['forced_len_max']} ({r['response_tokens']} tokens)")
    print(C.phase_table(r))
    print(f"rollout: media {r['media_s']:.3f} s, prefill {r['prefill_s']:.3f} s, decode {r['decode_s']:.3f} s "
          f"({r['decode_graph_replays']} steps, {r['decode_step_ms_mean']:.2f} ms a step); "
          f"{r['tokens_per_s']:.0f} response tokens/s over the iteration", flush=True)


def check_decode():
    """The rollout's log-probs of its own tokens (prefill + decode over the KV cache, batch and
    length buckets) against a scoring pass over the whole sequences, same weights."""
    forced = JOB.lengths()
    order, steps = schedule(forced)
    with torch.no_grad():
        toks, lp, feats = rollout(forced, order, steps, {})
        pos = torch.arange(MAX_NEW, device=DEV)
        valid = pos[None, :] < torch.tensor(forced, device=DEV)[:, None]
        toks[~valid] = C.EOS_PAD
        ref = torch.zeros(N, MAX_NEW, device=DEV)
        score(ACTOR, toks, feats, forced, ref)
    d = float((lp - ref).abs()[valid].max())
    print(f"rollout log-probs against a scoring pass: max difference {d:.2e}", flush=True)
    assert d < 1e-3, "the decode path disagrees with the scoring path"


if ARGS.check_hf:
    check_against_transformers()
    check_decode()
    print("checks: ok")
    sys.exit(0)

t0 = time.perf_counter()
keys = set()
for i in range(ITERS + 1):
    keys |= set(schedule(JOB.lengths(iteration=JOB.iteration + i))[1])
res["decode_graphs"] = sorted(keys)
if USE_GRAPHS:
    t_cap = time.perf_counter()
    try:
        capture(keys)
        res["capture_s"] = time.perf_counter() - t_cap
        res["capture_gib"] = torch.cuda.memory_reserved() / 2**30
        print(f"captured {len(GRAPHS)} decode graphs in {res['capture_s']:.1f} s", flush=True)
    except Exception as e:  # noqa: BLE001 - the measurement goes on with eager decode steps, and says so
        print(f"decode graph capture failed ({type(e).__name__}: {str(e)[:300]}); decoding eagerly", flush=True)
        res["graph_capture_failed"] = f"{type(e).__name__}: {str(e)[:300]}"
        GRAPHS.clear()
        USE_GRAPHS = False
        res["cuda_graphs"] = False
        torch.cuda.synchronize()
warm = iteration(0)
res["warmup_s"] = time.perf_counter() - t0
res["warmup"] = warm
print_iteration(warm, f"warm-up ({res['warmup_s']:.1f} s with graph capture and compiles)")
graphs_before = unique_graphs()
timed = []
for i in range(1, ITERS + 1):
    timed.append(iteration(i))
    res["iterations"] = timed
    REC.save()
    print_iteration(timed[-1], f"timed iteration {i}")
graphs_after = unique_graphs()
if graphs_before is not None and graphs_after is not None:
    res["compiles_in_timed_iterations"] = graphs_after - graphs_before
res["compile_failed"] = COMPILE_FAILED

if timed:
    mean = lambda k: sum(t[k] for t in timed) / len(timed)  # noqa: E731
    for k in ["time_s", "iteration_s", "rollout_s", "scoring_s", "scoring_ref_s", "scoring_old_s", "reward_s",
              "training_s", "media_s", "prefill_s", "rollout_prefill_s", "decode_s", "decode_step_ms_mean", "response_tokens",
              "response_len_mean", "sequence_tokens", "decode_steps", "micro_batches", "optimizer_steps",
              "forced_len_mean"]:
        res[k] = mean(k)
    res["forced_len_max"] = max(t["forced_len_max"] for t in timed)
    for k in [k for k in timed[0] if k.endswith("_peak_gib")] + ["peak_gib"]:
        vals = [t[k] for t in timed if t.get(k) is not None]
        res[k] = max(vals) if vals else None
    for k in ["loss", "pg_loss", "kl", "grad_norm"]:
        res[k] = timed[-1][k]
    res["tokens_per_s"] = sum(t["response_tokens"] for t in timed) / sum(t["time_s"] for t in timed)
    res["rollout_tokens_per_s"] = sum(t["response_tokens"] for t in timed) / sum(t["rollout_s"] for t in timed)
    res["timed_iterations"] = [t["iteration"] for t in timed]
    REC.save()
    print(f"\nPyTorch {torch.__version__}, tuned, on {res.get('gpu', DEV)}: {PROMPTS} prompts x group {G} = {N} "
          f"samples, prompt {P} tokens, responses {res['response_len']}; mean of iterations {res['timed_iterations']}")
    print(C.phase_table(res))
    print(f"warm-up {res['warmup_s']:.1f} s (graph capture {res.get('capture_s', 0.0):.1f} s); "
          f"{res['tokens_per_s']:.0f} response tokens/s")
REC.save()
print("RESULT", __import__("json").dumps(res), flush=True)
