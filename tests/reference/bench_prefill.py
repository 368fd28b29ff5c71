#!/usr/bin/env python3
"""PyTorch side of runtime/examples/gpu_bench.rs: the same Qwen2.5-VL-3B widths with fewer layers,
bf16 on the GPU, transformers' own modules (sdpa attention), timed the same way (CUDA events,
2 warm-up runs, median of ITERS):

  prefill  PROMPTS x PROMPT_LEN text tokens through the language model (3D position ids as
           generate builds them for text), final norm, lm head on each prompt's last token;
  vision   IMAGES images of [1, GRID, GRID] patches through model.visual (window attention,
           the last block full);
  gemm     a bf16 8192^3 matmul: the measured GEMM ceiling of this GPU in this run.

Each workload is also timed back to back (ITERS calls without waiting in between), as
gpu_bench does.

Usage: python bench_prefill.py [--text-layers 4] [--vision-blocks 4] [--prompts 8]
       [--prompt-len 1024] [--images 2] [--grid 64] [--iters 10]
"""
import argparse

import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration


def time_ms(fn, iters):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def back_to_back_ms(fn, iters):
    """Milliseconds a call of ITERS calls issued without waiting in between (after 2 warm-ups):
    what gpu_bench prints as "back to back"."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / iters


def main():
    ap = argparse.ArgumentParser()
    for k, d in [("text-layers", 4), ("vision-blocks", 4), ("prompts", 8), ("prompt-len", 1024),
                 ("images", 2), ("grid", 64), ("iters", 10)]:
        ap.add_argument("--" + k, type=int, default=d)
    a = ap.parse_args()
    vis = dict(depth=a.vision_blocks, hidden_size=1280, num_heads=16, intermediate_size=3420, patch_size=14,
               temporal_patch_size=2, spatial_merge_size=2, window_size=112, in_channels=3,
               fullatt_block_indexes=[a.vision_blocks - 1], out_hidden_size=2048, hidden_act="silu")
    txt = dict(num_hidden_layers=a.text_layers, hidden_size=2048, num_attention_heads=16, num_key_value_heads=2,
               intermediate_size=11008, vocab_size=151936, hidden_act="silu", rms_norm_eps=1e-6,
               rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}, rope_theta=1000000.0,
               max_position_embeddings=128000, tie_word_embeddings=True)
    cfg = Qwen2_5_VLConfig(vision_config=vis, text_config=txt, tie_word_embeddings=True)
    model = Qwen2_5_VLForConditionalGeneration._from_config(cfg, attn_implementation="sdpa",
                                                            dtype=torch.bfloat16).cuda().eval()
    print("torch", torch.__version__, "device", torch.cuda.get_device_name(), "attention",
          model.config._attn_implementation, flush=True)
    lm = model.model.language_model
    B, L = a.prompts, a.prompt_len
    ids = torch.randint(0, 150000, (B, L), device="cuda")
    pos = torch.arange(L, device="cuda").view(1, 1, L).expand(3, B, L)

    def prefill():
        with torch.no_grad():
            h = lm(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
            model.lm_head(h[:, -1])

    ms = time_ms(prefill, a.iters)
    bb = back_to_back_ms(prefill, a.iters)
    print(f"pytorch prefill {B} x {L} tokens, {a.text_layers} layers: {ms:.3f} ms; back to back "
          f"{bb:.3f} ms a call", flush=True)
    n = a.grid * a.grid
    pix = torch.randn(a.images * n, 3 * 2 * 14 * 14, device="cuda", dtype=torch.bfloat16)
    thw = torch.tensor([[1, a.grid, a.grid]] * a.images, device="cuda")

    def vision():
        with torch.no_grad():
            model.model.visual(pix, grid_thw=thw)

    ms = time_ms(vision, a.iters)
    bb = back_to_back_ms(vision, a.iters)
    print(f"pytorch vision {a.images} x [1, {a.grid}, {a.grid}] ({a.images * n} patches), "
          f"{a.vision_blocks} blocks: {ms:.3f} ms; back to back {bb:.3f} ms a call", flush=True)
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: torch.matmul(x, y), a.iters)
    print(f"bf16 GEMM 8192^3: {ms:.3} ms, {2 * 8192 ** 3 / ms / 1e9:.1f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
