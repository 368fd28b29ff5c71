#!/usr/bin/env python3
"""PyTorch side of runtime/examples/gpu_train_bench.rs: one GRPO-style training micro-batch of the
Qwen2.5-VL-3B text decoder's widths with fewer layers, in bf16 on the GPU, eager and
`torch.compile`, timed the same way (CUDA events around one step on an idle device, WARMUP
warm-up steps, median of ITERS); then AdamW (`torch.optim.AdamW(fused=True)`) on fp32 parameters
of the same shapes; then the two ceilings of this GPU in this run (bf16 GEMM 8192^3, device copy).

The model is plain torch modules with the text decoder's math (transformers' Qwen2.5-VL text
model for text-only input): token embedding; per layer RMSNorm (fp32 statistics, as
transformers), fused q|k|v projection with bias, RoPE (text positions: the three M-RoPE sections
see the same position), SDPA causal attention with GQA, o projection, residual, RMSNorm, fused
gate|up, SiLU(gate) * up, down projection, residual; final RMSNorm; lm head tied to the
embedding. Fused q|k|v and gate|up are what our trainer runs too (the same FLOPs as separate
projections).

The step (as gpu_train_bench's micro-batch): SEQS sequences of SEQ_LEN tokens, each a prompt of
PROMPT_LEN tokens followed by a response; the lm head runs on the SEQ_LEN - PROMPT_LEN + 1 rows
that score response tokens; per-token log-probs (fp32 log-softmax of logits / T) -> GRPO clipped
surrogate (ratio exp(logp - old), clip 0.2 / 0.28, dual clip 3, token mean over a mask) ->
backward into bf16 parameter gradients. Activations are kept (no recomputation).

FLOPs counted (the same formula as gpu_train_bench, model FLOPs, recomputation not counted):
  6 * (layer weight params) * tokens * layers + 6 * vocab * hidden * head_rows
  + 12 * heads * head_dim * causal_pairs * layers      (attention: 4 forward + 8 backward)

Usage: python bench_train.py [--layers 4] [--seqs 8] [--seq-len 1024] [--prompt-len 512]
       [--iters 10] [--no-compile] [--no-step] [--device cuda] [--hidden 2048 --ffn 11008 --heads 16
       --kv-heads 2 --vocab 151936]   (small dims and --device cpu only to dry-run the script)
"""
import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, h, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Layer(nn.Module):
    def __init__(self, h, ffn, nq, nkv, hd, eps):
        super().__init__()
        self.nq, self.nkv, self.hd, self.ffn = nq, nkv, hd, ffn
        self.norm1 = RMSNorm(h, eps)
        self.qkv = nn.Linear(h, (nq + 2 * nkv) * hd, bias=True)
        self.o = nn.Linear(nq * hd, h, bias=False)
        self.norm2 = RMSNorm(h, eps)
        self.gate_up = nn.Linear(h, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, h, bias=False)

    def forward(self, x, cos, sin):
        b, l, _ = x.shape
        qkv = self.qkv(self.norm1(x))
        q, k, v = qkv.split([self.nq * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        q = q.view(b, l, self.nq, self.hd).transpose(1, 2)
        k = k.view(b, l, self.nkv, self.hd).transpose(1, 2)
        v = v.view(b, l, self.nkv, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, l, self.nq * self.hd))
        g, u = self.gate_up(self.norm2(x)).split([self.ffn, self.ffn], dim=-1)
        return x + self.down(F.silu(g) * u)


class TextModel(nn.Module):
    def __init__(self, layers, h, ffn, nq, nkv, vocab, eps=1e-6):
        super().__init__()
        self.embed = nn.Embedding(vocab, h)
        self.layers = nn.ModuleList(Layer(h, ffn, nq, nkv, h // nq, eps) for _ in range(layers))
        self.norm = RMSNorm(h, eps)

    def forward(self, ids, cos, sin, head_from):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        x = self.norm(x[:, head_from:])
        return x @ self.embed.weight.t()  # tied lm head


def grpo_loss(model, ids, cos, sin, head_from, targets, old, adv, mask, temp):
    logits = model(ids, cos, sin, head_from).float() / temp
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - 0.2, 1 + 0.28)
    clip1 = torch.maximum(l1, l2)
    pg = torch.where(adv < 0, torch.minimum(-adv * 3.0, clip1), clip1)
    return (pg * mask).sum() / mask.sum(), logp.detach()


def sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, iters, warmup, dev):
    """Median milliseconds of one call on an idle device (events on cuda, wall clock on cpu)."""
    for _ in range(warmup):
        fn()
    sync(dev)
    ts = []
    for _ in range(iters):
        if dev == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    for k, d in [("layers", 4), ("seqs", 8), ("seq-len", 1024), ("prompt-len", 512), ("iters", 10),
                 ("hidden", 2048), ("ffn", 11008), ("heads", 16), ("kv-heads", 2), ("vocab", 151936)]:
        ap.add_argument("--" + k, type=int, default=d)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-step", action="store_true", help="skip the fwd+bwd step (AdamW, ceilings)")
    a = ap.parse_args()
    dev = a.device
    torch.manual_seed(0)
    h, ffn, nq, nkv, vocab = a.hidden, a.ffn, a.heads, a.kv_heads, a.vocab
    hd = h // nq
    B, L, P = a.seqs, a.seq_len, a.prompt_len
    R = L - P + 1  # response tokens scored per sequence (rows P-1 .. L-1)
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"torch {torch.__version__}, device {name}", flush=True)
    model = TextModel(a.layers, h, ffn, nq, nkv, vocab).to(dev)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "embed" in n:
                p.copy_(torch.randn_like(p) / math.sqrt(h))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[1]))
    model = model.to(torch.bfloat16)
    ids = torch.randint(0, min(150000, vocab), (B, L), device=dev)
    resp = torch.randint(0, min(150000, vocab), (B, R), device=dev)
    ids[:, P:] = resp[:, :-1]
    targets = resp
    pos = torch.arange(L, device=dev, dtype=torch.float32)
    inv = 1.0 / (1000000.0 ** (torch.arange(0, hd, 2, device=dev, dtype=torch.float32) / hd))
    ang = torch.outer(pos, inv)
    emb = torch.cat([ang, ang], dim=-1)
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    adv = (torch.rand(B, 1, device=dev) * 2 - 1).expand(B, R).contiguous()
    mask = (torch.arange(R, device=dev) % 5 != 3).float().expand(B, R).contiguous()
    temp = 1.0
    with torch.no_grad():
        _, logp0 = grpo_loss(model, ids, cos, sin, P - 1, targets, torch.zeros(B, R, device=dev), adv,
                             mask, temp)
    old = logp0 + 0.05 * (torch.rand(B, R, device=dev) * 2 - 1)

    layer_w = h * (nq + 2 * nkv) * hd + nq * hd * h + h * 2 * ffn + ffn * h
    tokens = B * L
    pairs = B * L * (L + 1) / 2
    flops = (6 * layer_w * tokens * a.layers + 6 * vocab * h * B * R
             + 12 * nq * hd * pairs * a.layers)
    print(f"step: {B} x {L} tokens (prompt {P}, {R} scored rows each), {a.layers} layers; "
          f"{flops / 1e12:.3f} TFLOP a step (model FLOPs)", flush=True)

    def make_step(fn):
        def step():
            for p in model.parameters():
                p.grad = None
            loss, _ = fn(model, ids, cos, sin, P - 1, targets, old, adv, mask, temp)
            loss.backward()
        return step

    variants = [] if a.no_step else [("eager", grpo_loss)]
    if not (a.no_compile or a.no_step):
        variants.append(("torch.compile", torch.compile(grpo_loss, dynamic=False)))
    for label, fn in variants:
        try:
            t0 = time.perf_counter()
            step = make_step(fn)
            step()
            sync(dev)
            first = time.perf_counter() - t0
            ms = time_ms(step, a.iters, 2, dev)
        except Exception as e:  # a compile failure must not cost the rest of the run
            print(f"pytorch {label} failed: {type(e).__name__}: {e}", flush=True)
            continue
        print(f"pytorch {label} fwd+bwd: {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s "
              f"(first call {first:.1f} s)", flush=True)
    with torch.no_grad():
        loss, _ = grpo_loss(model, ids, cos, sin, P - 1, targets, old, adv, mask, temp)
    print(f"loss {loss.item():.6f}", flush=True)
    shapes = [p.shape for p in model.parameters()]
    del model, variants
    if dev == "cuda":
        torch.cuda.empty_cache()

    # ---- AdamW on fp32 parameters of the same shapes
    params = [torch.randn(s, device=dev, dtype=torch.float32) * 0.02 for s in shapes]
    for p in params:
        p.requires_grad_(True)
        p.grad = torch.randn_like(p) * 1e-3
    n = sum(p.numel() for p in params)
    fused = dev == "cuda"
    opt = torch.optim.AdamW(params, lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                            fused=fused)
    ms = time_ms(opt.step, a.iters, 2, dev)
    nb = 28 * n  # p r+w, m r+w, v r+w (fp32), grad read
    print(f"pytorch AdamW(fused={fused}) {n} params ({len(params)} tensors): {ms:.3f} ms, "
          f"{nb / ms / 1e6:.1f} GB/s counting {nb / 1e9:.2f} GB (28 B/param)", flush=True)
    copies = [p.detach().to(torch.bfloat16) for p in params]
    masters = [p.detach() for p in params]

    def step_copy():
        opt.step()
        torch._foreach_copy_(copies, masters)

    ms = time_ms(step_copy, a.iters, 2, dev)
    nb = 34 * n  # + fp32 master read, bf16 copy write
    print(f"pytorch AdamW(fused={fused}) + bf16 copy: {ms:.3f} ms, {nb / ms / 1e6:.1f} GB/s "
          f"counting {nb / 1e9:.2f} GB (34 B/param)", flush=True)
    del params, copies, masters, opt
    if dev == "cuda":
        torch.cuda.empty_cache()

    # ---- ceilings
    s = 8192 if dev == "cuda" else 512
    x = torch.randn(s, s, device=dev, dtype=torch.bfloat16)
    y = torch.randn(s, s, device=dev, dtype=torch.bfloat16)
    ms = time_ms(lambda: torch.matmul(x, y), a.iters, 2, dev)
    print(f"bf16 GEMM {s}^3: {ms:.3f} ms, {2 * s ** 3 / ms / 1e9:.1f} TFLOP/s", flush=True)
    del x, y
    nbytes = (2 << 30) if dev == "cuda" else (64 << 20)
    src = torch.randn(nbytes // 4, device=dev)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), a.iters, 2, dev)
    print(f"device copy {nbytes / 2**30:.3f} GiB: {ms:.3f} ms, {2 * nbytes / ms / 1e6:.1f} GB/s "
          f"(read + write)", flush=True)


if __name__ == "__main__":
    main()
