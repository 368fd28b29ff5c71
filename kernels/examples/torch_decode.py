# PyTorch side of the decode side-by-side (docs/perf.md), every workload in one process:
#  - "layers": the decode step of cost/profiles/reference/overlap_probe.py, unchanged (4 distinct layers
#    cycled to full depth; per layer qkv GEMM, SDPA over a [B, kv_heads, S, head_dim] cache with
#    enable_gqa, o GEMM + residual, gate|up GEMM, SiLU * up, down GEMM + residual; no embedding,
#    norms, qkv bias, rotary, KV append, lm_head or sampling);
#  - "full": the same work as rollplex's bench_decode step, written the way Hugging Face's
#    Qwen2 code runs it: embedding, per layer RMSNorm (fp32 inside), qkv nn.Linear with bias,
#    rotary (rotate_half), KV append (index_copy_ into a static cache), SDPA, o_proj, residual,
#    RMSNorm, gate|up, SiLU * up, down, residual; final RMSNorm, lm_head (tied for 3B), a T = 1
#    Gumbel-max sample written back as the next tokens. Weights in nn.Linear layout [out, in].
# Each step is captured as a CUDA graph; NDEC replays timed 3 times, median per step. SDPA reads
# each sample's whole cache: no prefix sharing. 4 distinct layers and caches are cycled (more
# than L2 holds, so every layer's bytes come from HBM).
# Usage: python3 torch_decode.py [NDEC]
import sys, time, json
import torch
import torch.nn.functional as F

dev = torch.device("cuda")
NDEC = int(sys.argv[1]) if len(sys.argv) > 1 else 60
props = torch.cuda.get_device_properties(0)
print(f"gpu={props.name} sms={props.multi_processor_count} torch={torch.__version__}", flush=True)

def bench(fn, iters=10, warm=3):
    for _ in range(warm): fn()
    torch.cuda.synchronize()
    s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(iters):
        s.record(); fn(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
    ts.sort(); return ts[len(ts)//2]

x = torch.randn(2*1024**3//2, device=dev, dtype=torch.bfloat16); y = torch.empty_like(x)
copy = 2*x.numel()*2/bench(lambda: y.copy_(x))/1e9
del x, y; torch.cuda.empty_cache()
print(f"copy ceiling {copy:.2f} TB/s", flush=True)

def graph_step_ms(fn):
    st = torch.cuda.Stream()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.stream(st):
        fn(); torch.cuda.synchronize()
        with torch.cuda.graph(gr, stream=st):
            fn()
    torch.cuda.synchronize()
    def dec():
        with torch.cuda.stream(st):
            for _ in range(NDEC): gr.replay()
    dec(); torch.cuda.synchronize()
    ts = []
    for _ in range(3):
        torch.cuda.synchronize(); t0 = time.perf_counter(); dec(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
    ts.sort()
    del gr
    return ts[1] * 1e3 / NDEC

# (name, hidden, ffn, heads, kv heads, head_dim, layers, vocab, tied)
DIMS = {"3B": (2048, 11008, 16, 2, 128, 36, 151936, True), "7B": (3584, 18944, 28, 4, 128, 28, 152064, False)}
WORK = [("3B", 64), ("3B", 8), ("7B", 64), ("7B", 8)]
S = 2048
out = []
for name, B in WORK:
    H, I, NH, NKV, D, L, V, tied = DIMS[name]
    torch.manual_seed(0)
    def mk(*s): return (torch.randn(*s, device=dev, dtype=torch.bfloat16) * 0.02)
    kcache = [mk(B, NKV, S, D) for _ in range(4)]; vcache = [mk(B, NKV, S, D) for _ in range(4)]

    # ---- "layers": overlap_probe.py's decode step
    layers = [dict(qkv=mk(H, (NH + 2*NKV)*D), o=mk(NH*D, H), gu=mk(H, 2*I), dn=mk(I, H)) for _ in range(4)]
    hdec = mk(B, H)
    def layer_fwd(W, h, kv):
        qkv = h @ W["qkv"]
        q, k, v = qkv.split([NH*D, NKV*D, NKV*D], dim=-1)
        kc, vc = kv
        q = q.view(B, NH, 1, D)
        o = F.scaled_dot_product_attention(q, kc, vc, enable_gqa=True).reshape(B, NH*D)
        h = h + o @ W["o"]
        gu = h @ W["gu"]; g, u = gu.chunk(2, dim=-1)
        return h + (F.silu(g) * u) @ W["dn"]
    def probe_step():
        h = hdec
        for l in range(L):
            h = layer_fwd(layers[l % 4], h, (kcache[l % 4], vcache[l % 4]))
        return h
    t_probe = graph_step_ms(probe_step)
    wb_probe = L * sum(w.numel() for w in layers[0].values()) * 2
    kvb = L * 2 * B * NKV * S * D * 2
    del layers; torch.cuda.empty_cache()

    # ---- "full": the same work as bench_decode's step, as HF's Qwen2 code runs it
    QKV = (NH + 2*NKV) * D
    fl = [dict(n1=1.0 + mk(H), wqkv=mk(QKV, H), bqkv=mk(QKV), wo=mk(H, NH*D), n2=1.0 + mk(H),
               wgu=mk(2*I, H), wd=mk(H, I)) for _ in range(4)]
    embed = mk(V, H); lm = embed if tied else mk(V, H); nf = 1.0 + mk(H)
    tokens = torch.randint(0, V, (B,), device=dev)
    ang = torch.rand(B, D // 2, device=dev) * 6.0
    emb = torch.cat([ang, ang], dim=-1)
    cos = emb.cos().to(torch.bfloat16)[:, None, None, :]; sin = emb.sin().to(torch.bfloat16)[:, None, None, :]
    pos = torch.tensor([S - 1], device=dev)
    def rms(x, w, eps=1e-6):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return w * xf.to(torch.bfloat16)
    def rot(x):
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        return torch.cat((-x2, x1), dim=-1)
    def full_step():
        h = F.embedding(tokens, embed)
        for l in range(L):
            W = fl[l % 4]; kc = kcache[l % 4]; vc = vcache[l % 4]
            x = rms(h, W["n1"])
            qkv = F.linear(x, W["wqkv"], W["bqkv"])
            q, k, v = qkv.split([NH*D, NKV*D, NKV*D], dim=-1)
            q = q.view(B, NH, 1, D); k = k.view(B, NKV, 1, D); v = v.view(B, NKV, 1, D)
            q = q * cos + rot(q) * sin
            k = k * cos + rot(k) * sin
            kc.index_copy_(2, pos, k); vc.index_copy_(2, pos, v)
            o = F.scaled_dot_product_attention(q, kc, vc, enable_gqa=True).reshape(B, NH*D)
            h = h + F.linear(o, W["wo"])
            x = rms(h, W["n2"])
            g, u = F.linear(x, W["wgu"]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(g) * u, W["wd"])
        logits = F.linear(rms(h, nf), lm)
        u = torch.rand(B, V, device=dev)
        tokens.copy_(torch.argmax(logits.float() - torch.log(-torch.log(u)), dim=-1))
    t_full = graph_step_ms(full_step)
    per_layer = QKV * H + QKV + H * NH * D + 3 * I * H + 2 * H
    wb_full = (L * per_layer + H + V * H + B * H) * 2
    kvb_full = L * (B * S + B) * 2 * NKV * D * 2
    lgb = 2 * B * V * 2
    del fl, embed, lm, kcache, vcache; torch.cuda.empty_cache()

    bw_p = (wb_probe + kvb) / (t_probe * 1e-3) / 1e12
    bw_f = (wb_full + kvb_full + lgb) / (t_full * 1e-3) / 1e12
    r = dict(work=f"{name} B={B}", layers_ms=t_probe, layers_gb=(wb_probe + kvb) / 1e9, layers_tbs=bw_p,
             full_ms=t_full, full_gb=(wb_full + kvb_full + lgb) / 1e9, full_tbs=bw_f)
    out.append(r)
    print(f"torch {name} B={B} S={S}: layers-only step {t_probe:.3f} ms, {(wb_probe + kvb)/1e9:.2f} GB = {bw_p:.2f} TB/s = {100*bw_p/copy:.0f}% of copy; "
          f"full step {t_full:.3f} ms, {(wb_full + kvb_full + lgb)/1e9:.2f} GB = {bw_f:.2f} TB/s = {100*bw_f/copy:.0f}% of copy", flush=True)
print("FINAL", json.dumps(dict(copy_tbs=copy, rows=out)))
