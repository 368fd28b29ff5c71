#!/usr/bin/env python3
"""Tiny random Qwen2.5-VL cases for the CUDA (bf16) forward, compared with transformers in bf16.

Same construction as make_tiny.py (its `build`, `make_inputs` and checkpoint layouts), with dims
the CUDA attention kernels take (head dims multiples of 16: text 32 uses the tensor-core decode,
text 16 the varlen one); odd FFN / vocabulary sizes, GQA ratios 1, 2, 3, 4, images, a video,
a mixed prompt, window attention with full-attention indexes, tied and untied heads.

For every case, OUT/<case>/ gets model/ (float32 weights, as make_tiny.py saves them),
inputs.safetensors (input_ids, pixels, grids as make_tiny.py, plus:
  logits [L, vocab]      transformers in bfloat16 on DEVICE (eager attention), as f32
  generated [32]         bf16 greedy generate
  logits_f32, generated_f32   the same model in float32 (no TF32), for context)
and case.json.

Usage: python make_tiny_bf16.py OUT [--device cuda]. Needs torch and transformers (5.17 was used).
"""
import argparse
import json
import os
import shutil
import sys

import torch
import transformers
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_tiny import NEW_TOKENS, build, legacy_save, make_inputs  # noqa: E402

CASES = [
    dict(
        name="image_gqa2",
        vision=dict(depth=4, hidden_size=64, num_heads=4, intermediate_size=77, patch_size=14,
                    window_size=56, fullatt_block_indexes=[1, 3], out_hidden_size=128, tokens_per_second=2),
        text=dict(num_hidden_layers=3, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=99, vocab_size=517, mrope_section=[4, 6, 6], rms_norm_eps=1e-6),
        tie=False,
        media=[("image", (1, 8, 12), None)],
    ),
    dict(
        name="video_gqa4_tied",
        vision=dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=50, patch_size=14,
                    window_size=112, fullatt_block_indexes=[2], out_hidden_size=256, tokens_per_second=2),
        text=dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                  intermediate_size=129, vocab_size=401, mrope_section=[4, 6, 6], rms_norm_eps=1e-6),
        tie=True,
        media=[("video", (4, 6, 8), 2.0)],
    ),
    dict(
        name="mixed_mha_odd",
        vision=dict(depth=3, hidden_size=48, num_heads=3, intermediate_size=45, patch_size=8,
                    window_size=32, fullatt_block_indexes=[0], out_hidden_size=96, tokens_per_second=4),
        text=dict(num_hidden_layers=3, hidden_size=96, num_attention_heads=3, num_key_value_heads=3,
                  intermediate_size=83, vocab_size=333, mrope_section=[4, 6, 6], rms_norm_eps=1e-5),
        tie=False,
        media=[("image", (1, 4, 4), None), ("video", (2, 4, 6), 0.5), ("image", (1, 6, 10), None)],
        v5_names=True,
    ),
    dict(
        name="hd16_gqa3_sharded",
        vision=dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=14,
                    window_size=56, fullatt_block_indexes=[0], out_hidden_size=96, tokens_per_second=2),
        text=dict(num_hidden_layers=2, hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                  intermediate_size=100, vocab_size=450, mrope_section=[2, 3, 3], rms_norm_eps=1e-6),
        tie=False,
        media=[("image", (1, 6, 6), None)],
        legacy=True,
    ),
]


def run(model, kw, device):
    kwd = {k: v.to(device) for k, v in kw.items()}
    with torch.no_grad():
        logits = model(**kwd).logits[0].float().cpu()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        gen = model.generate(**kwd, max_new_tokens=NEW_TOKENS, do_sample=False, num_beams=1)
    generated = gen[0, kw["input_ids"].shape[1]:].cpu()
    assert generated.numel() == NEW_TOKENS, generated.shape
    return logits, generated


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    print("transformers", transformers.__version__, "torch", torch.__version__, flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.makedirs(args.out, exist_ok=True)
    for case in CASES:
        d = os.path.join(args.out, case["name"])
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(os.path.join(d, "model"))
        model, cfg, sp = build(case)
        model.save_pretrained(os.path.join(d, "model"))
        if case.get("legacy"):
            legacy_save(model, os.path.join(d, "model"))
        if case.get("v5_names"):
            sd = {k: v.contiguous().clone() for k, v in model.state_dict().items()}
            save_file(sd, os.path.join(d, "model", "model.safetensors"), metadata={"format": "pt"})
        model.to(args.device)
        g = torch.Generator().manual_seed(1234)
        kw = make_inputs(case, cfg, sp, g)
        logits32, gen32 = run(model, kw, args.device)
        model.to(torch.bfloat16)
        logits, gen = run(model, kw, args.device)
        tensors = {"input_ids": kw["input_ids"][0].to(torch.int64), "logits": logits.contiguous(),
                   "generated": gen.to(torch.int64), "logits_f32": logits32.contiguous(),
                   "generated_f32": gen32.to(torch.int64)}
        if "pixel_values" in kw:
            tensors["image_pixels"] = kw["pixel_values"].contiguous()
            tensors["image_grid_thw"] = kw["image_grid_thw"].to(torch.int64)
        if "pixel_values_videos" in kw:
            tensors["video_pixels"] = kw["pixel_values_videos"].contiguous()
            tensors["video_grid_thw"] = kw["video_grid_thw"].to(torch.int64)
            tensors["second_per_grid_ts"] = kw["second_per_grid_ts"]
        save_file(tensors, os.path.join(d, "inputs.safetensors"))
        with open(os.path.join(d, "case.json"), "w") as f:
            json.dump(dict(case, transformers=transformers.__version__, torch=torch.__version__,
                           prompt_len=int(kw["input_ids"].shape[1]), device=args.device, dtype="bfloat16"),
                      f, indent=1)
        agree = int((gen == gen32).long().cumprod(0).sum())
        print(f"{case['name']}: prompt {kw['input_ids'].shape[1]} tokens, bf16 vs f32 logits max_abs "
              f"{(logits - logits32).abs().max().item():.3e}, greedy bf16 vs f32 agree {agree}/{NEW_TOKENS}",
              flush=True)


if __name__ == "__main__":
    main()
