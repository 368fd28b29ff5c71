# PyTorch side of the decode side-by-side (docs/perf.md): the decode step of
# shared/bench/overlap_probe.py, unchanged (4 distinct layers cycled to full depth; per layer
# qkv GEMM, SDPA over a [B, kv_heads, S, head_dim] cache with enable_gqa, o GEMM + residual,
# gate|up GEMM, SiLU * up, down GEMM + residual; no norms, rotary, KV append, lm_head or
# sampling), captured as a CUDA graph, NDEC replays timed 3 times, median, for every workload
# in one process. SDPA reads each sample's whole cache: no prefix sharing.
# Usage: python3 torch_decode.py [NDEC]   (prints one line per workload and a copy ceiling)
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

WORK = [("3B", "2048,11008,16,2,128", 36, 64), ("3B", "2048,11008,16,2,128", 36, 8),
        ("7B", "3584,18944,28,4,128", 28, 64), ("7B", "3584,18944,28,4,128", 28, 8)]
S = 2048
out = []
for name, dims, L, B in WORK:
    torch.manual_seed(0)
    H, I, NH, NKV, D = [int(v) for v in dims.split(",")]
    def mk(*s): return (torch.randn(*s, device=dev, dtype=torch.bfloat16) * 0.02)
    layers = [dict(qkv=mk(H, (NH + 2*NKV)*D), o=mk(NH*D, H), gu=mk(H, 2*I), dn=mk(I, H)) for _ in range(4)]
    kcache = [mk(B, NKV, S, D) for _ in range(4)]; vcache = [mk(B, NKV, S, D) for _ in range(4)]
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
    def decode_step():
        h = hdec
        for l in range(L):
            h = layer_fwd(layers[l % 4], h, (kcache[l % 4], vcache[l % 4]))
        return h
    st = torch.cuda.Stream()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.stream(st):
        decode_step(); torch.cuda.synchronize()
        with torch.cuda.graph(gr, stream=st):
            decode_step()
    torch.cuda.synchronize()
    def dec():
        with torch.cuda.stream(st):
            for _ in range(NDEC): gr.replay()
    dec(); torch.cuda.synchronize()
    ts = []
    for _ in range(3):
        torch.cuda.synchronize(); t0 = time.perf_counter(); dec(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
    ts.sort(); step_ms = ts[1] * 1e3 / NDEC
    wbytes = L * sum(w.numel() for w in layers[0].values()) * 2
    kvbytes = L * 2 * B * NKV * S * D * 2
    bw = (wbytes + kvbytes) / (step_ms * 1e-3) / 1e12
    r = dict(work=f"{name} B={B}", step_ms=step_ms, weights_gb=wbytes/1e9, kv_gb=kvbytes/1e9, tbs=bw, pct_copy=100*bw/copy)
    out.append(r)
    print(f"torch {name} B={B} S={S}: step {step_ms:.3f} ms, moves {(wbytes+kvbytes)/1e9:.2f} GB (w {wbytes/1e9:.2f} + kv {kvbytes/1e9:.2f}) = {bw:.2f} TB/s = {100*bw/copy:.0f}% of copy", flush=True)
    del layers, kcache, vcache, gr; torch.cuda.empty_cache()
print("FINAL", json.dumps(dict(copy_tbs=copy, rows=out)))
