"""PyTorch's side of kernels/examples/bench_backward.rs: autograd backward of the same ops at the
same shapes (Qwen2.5-VL 3B: 4096 tokens, hidden 2048, intermediate 11008, vocab 151936 over 1024
rows, attention 4 causal sequences of 1024 with 16/2 heads of 128), bf16, eager. Each number is
the median of CUDA-event-timed backward calls (forward excluded; retain_graph).

Run: python3 kernels/examples/torch_backward.py (needs a GPU and torch).
"""
import torch
import torch.nn.functional as F


def med_ms(fn, warm=3, reps=20):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def bwd_ms(out, inputs, grad, **kw):
    return med_ms(lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True), **kw)


def main():
    dev, bf = "cuda", torch.bfloat16
    t, d, f, vocab = 4096, 2048, 11008, 151936
    print("device:", torch.cuda.get_device_name(), "torch", torch.__version__)

    x = torch.randn(t, d, device=dev, dtype=bf, requires_grad=True)
    w = torch.randn(d, device=dev, dtype=bf, requires_grad=True)
    y = F.rms_norm(x, (d,), w, 1e-6)
    print(f"torch rms_norm backward {t}x{d} (dx + dw): {bwd_ms(y, [x, w], torch.randn_like(y)):.3f} ms")

    gu = torch.randn(t, 2 * f, device=dev, dtype=bf, requires_grad=True)
    gate, up = gu.chunk(2, dim=-1)
    act = F.silu(gate) * up
    print(f"torch silu(gate)*up backward {t}x{f} (fused gate|up input): "
          f"{bwd_ms(act, [gu], torch.randn_like(act)):.3f} ms")

    table = torch.randn(vocab, d, device=dev, dtype=bf, requires_grad=True)
    ids = (torch.arange(t, device=dev) * 2654435761 >> 3) % vocab % 60000
    e = F.embedding(ids, table)
    print(f"torch embedding backward {t} tokens x {d} (vocab {vocab}): "
          f"{bwd_ms(e, [table], torch.randn_like(e), reps=10):.3f} ms")

    rows = 1024
    logits = (torch.randn(rows, vocab, device=dev, dtype=bf) * 4).requires_grad_(True)
    tg = torch.arange(rows, device=dev) * 97 % vocab
    lp = torch.log_softmax(logits.float(), -1)
    logp = lp.gather(-1, tg[:, None])[:, 0]
    ent = -(lp.exp() * lp).sum(-1)
    print(f"torch logprob backward {rows}x{vocab} (fp32 log_softmax, gather): "
          f"{bwd_ms(logp, [logits], torch.full_like(logp, 0.3)):.3f} ms")
    both = logp * 0.3 + ent * 0.01
    print(f"torch logprob + entropy backward {rows}x{vocab}: "
          f"{bwd_ms(both, [logits], torch.ones_like(both)):.3f} ms")

    b, ln, nh, nkv, hd = 4, 1024, 16, 2, 128
    q = torch.randn(b, nh, ln, hd, device=dev, dtype=bf, requires_grad=True)
    k = torch.randn(b, nkv, ln, hd, device=dev, dtype=bf, requires_grad=True)
    v = torch.randn(b, nkv, ln, hd, device=dev, dtype=bf, requires_grad=True)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ms = bwd_ms(o, [q, k, v], torch.randn_like(o))
    pairs = b * ln * (ln + 1) / 2
    flops = 5 * 2 * pairs * hd * nh
    print(f"torch sdpa backward 4x{ln} causal, 16/2 heads, hd 128 (enable_gqa): {ms:.3f} ms, "
          f"{flops / ms / 1e9:.2f} TFLOP/s")
    # The same with k, v expanded to 16 heads (the flash kernel's layout; gradients of the
    # expanded copies, so this is PyTorch's attention kernel alone).
    ke = k.detach().repeat_interleave(nh // nkv, 1).requires_grad_(True)
    ve = v.detach().repeat_interleave(nh // nkv, 1).requires_grad_(True)
    o = F.scaled_dot_product_attention(q, ke, ve, is_causal=True)
    ms = bwd_ms(o, [q, ke, ve], torch.randn_like(o))
    print(f"torch sdpa backward, k/v expanded to 16 heads: {ms:.3f} ms, "
          f"{flops / ms / 1e9:.2f} TFLOP/s")


if __name__ == "__main__":
    main()
