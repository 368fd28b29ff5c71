#!/usr/bin/env python3
"""Builds tiny random Qwen2.5-VL checkpoints with Hugging Face transformers and records what
transformers computes on them, for `reference_forward` (runtime/examples) to compare against.

For every case, OUT/<case>/ gets:
  model/            config.json + safetensors: transformers' own save_pretrained (which writes
                    the released checkpoints' key names, `visual.*`, `model.layers.*`); the
                    `v5_names` case rewrites the weights with transformers 5 module names
                    (`model.visual.*`, `model.language_model.*`); the `legacy` case uses a flat
                    config.json and two shards with an index file
  inputs.safetensors input_ids [L] (i64), pixel_values [N, C*tp*p*p] (f32) and grid_thw [M, 3]
                    (i64) for images and videos, second_per_grid_ts [V] (f32), logits [L, vocab]
                    (f32, eager attention, float32), generated [32] (i64, greedy)
  case.json         the case's description

Usage: python make_tiny.py OUT [--device cpu|cuda]. Needs torch and transformers (5.17 was used).
"""
import argparse
import json
import math
import os
import shutil
import zlib

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

IMG, VID, VS, VE = 151655, 151656, 151652, 151653  # remapped into each case's vocab below
NEW_TOKENS = 32

CASES = [
    dict(
        name="image_gqa2",
        vision=dict(depth=4, hidden_size=48, num_heads=3, intermediate_size=77, patch_size=14,
                    window_size=56, fullatt_block_indexes=[1, 3], out_hidden_size=96, tokens_per_second=2),
        text=dict(num_hidden_layers=3, hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
                  intermediate_size=99, vocab_size=517, mrope_section=[2, 3, 3], rms_norm_eps=1e-6),
        tie=False,
        media=[("image", (1, 8, 12), None)],
    ),
    dict(
        name="video_gqa4_tied",
        vision=dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=50, patch_size=14,
                    window_size=112, fullatt_block_indexes=[2], out_hidden_size=64, tokens_per_second=2),
        text=dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                  intermediate_size=129, vocab_size=401, mrope_section=[1, 1, 2], rms_norm_eps=1e-6),
        tie=True,
        media=[("video", (4, 6, 8), 2.0)],
    ),
    dict(
        name="mixed_mha_odd",
        vision=dict(depth=3, hidden_size=32, num_heads=4, intermediate_size=45, patch_size=8,
                    window_size=32, fullatt_block_indexes=[0], out_hidden_size=60, tokens_per_second=4),
        text=dict(num_hidden_layers=3, hidden_size=60, num_attention_heads=5, num_key_value_heads=5,
                  intermediate_size=83, vocab_size=333, mrope_section=[2, 2, 2], rms_norm_eps=1e-5),
        tie=False,
        media=[("image", (1, 4, 4), None), ("video", (2, 4, 6), 0.5), ("image", (1, 6, 10), None)],
        v5_names=True,
    ),
    dict(
        name="legacy_sharded",
        vision=dict(depth=2, hidden_size=48, num_heads=3, intermediate_size=64, patch_size=14,
                    window_size=56, fullatt_block_indexes=[0], out_hidden_size=72, tokens_per_second=2),
        text=dict(num_hidden_layers=2, hidden_size=72, num_attention_heads=6, num_key_value_heads=2,
                  intermediate_size=100, vocab_size=450, mrope_section=[1, 2, 3], rms_norm_eps=1e-6),
        tie=False,
        media=[("image", (1, 6, 6), None)],
        legacy=True,
    ),
]


def special_ids(vocab):
    # the last four ids of the vocabulary play vision_start, vision_end, image, video
    return dict(vision_start_token_id=vocab - 4, vision_end_token_id=vocab - 3,
                image_token_id=vocab - 2, video_token_id=vocab - 1)


def build(case):
    t = dict(case["text"])
    sec = t.pop("mrope_section")
    vocab = t["vocab_size"]
    sp = special_ids(vocab)
    text_cfg = dict(t, hidden_act="silu", rope_scaling={"type": "mrope", "mrope_section": sec},
                    rope_theta=1000000.0, max_position_embeddings=4096, eos_token_id=vocab - 5,
                    tie_word_embeddings=case["tie"])
    vis = dict(case["vision"], in_channels=3, spatial_merge_size=2, temporal_patch_size=2, hidden_act="silu")
    cfg = Qwen2_5_VLConfig(vision_config=vis, text_config=text_cfg, tie_word_embeddings=case["tie"], **sp)
    model = Qwen2_5_VLForConditionalGeneration._from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    # random weights at scales that keep activations O(1) through the tiny stacks
    g = torch.Generator().manual_seed(zlib.crc32(case["name"].encode()))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and ("norm" in name or "ln_q" in name):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                fan_in = math.prod(p.shape[1:])
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))
    model.eval()
    return model, cfg, sp


def make_inputs(case, cfg, sp, g):
    vocab = case["text"]["vocab_size"]
    merge = 2
    pd = 3 * 2 * case["vision"]["patch_size"] ** 2
    ids = torch.randint(0, vocab - 5, (5,), generator=g).tolist()
    pix_i, pix_v, grid_i, grid_v, secs = [], [], [], [], []
    for kind, grid, sec in case["media"]:
        n = grid[0] * grid[1] * grid[2]
        tok = n // (merge * merge)
        ph = sp["image_token_id"] if kind == "image" else sp["video_token_id"]
        ids += [sp["vision_start_token_id"]] + [ph] * tok + [sp["vision_end_token_id"]]
        ids += torch.randint(0, vocab - 5, (3,), generator=g).tolist()
        px = torch.randn(n, pd, generator=g)
        if kind == "image":
            pix_i.append(px); grid_i.append(list(grid))
        else:
            pix_v.append(px); grid_v.append(list(grid)); secs.append(sec)
    ids += torch.randint(0, vocab - 5, (4,), generator=g).tolist()
    input_ids = torch.tensor([ids])
    mm = torch.zeros_like(input_ids)
    mm[input_ids == sp["image_token_id"]] = 1
    mm[input_ids == sp["video_token_id"]] = 2
    kw = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), mm_token_type_ids=mm)
    if pix_i:
        kw["pixel_values"] = torch.cat(pix_i)
        kw["image_grid_thw"] = torch.tensor(grid_i)
    if pix_v:
        kw["pixel_values_videos"] = torch.cat(pix_v)
        kw["video_grid_thw"] = torch.tensor(grid_v)
        kw["second_per_grid_ts"] = torch.tensor(secs, dtype=torch.float32)
    return kw


def legacy_save(model, d):
    """Older checkpoint layout: `visual.*`, `model.layers.*`, two shards with an index file."""
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    out = {}
    for k, v in sd.items():
        if k.startswith("model.visual."):
            k = k[len("model."):]
        elif k.startswith("model.language_model."):
            k = "model." + k[len("model.language_model."):]
        out[k] = v.clone()
    keys = sorted(out)
    half = len(keys) // 2
    shards = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
    weight_map = {}
    for fname, ks in shards.items():
        save_file({k: out[k] for k in ks}, os.path.join(d, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in ks})
    for f in os.listdir(d):
        if f == "model.safetensors":
            os.remove(os.path.join(d, f))
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    # flatten the text config to the top level, as the released checkpoints do
    with open(os.path.join(d, "config.json")) as f:
        c = json.load(f)
    tc = c.pop("text_config")
    rp = tc.pop("rope_parameters", {})
    for k, v in tc.items():
        c.setdefault(k, v)
    c["rope_theta"] = rp.get("rope_theta", 1000000.0)
    c["rope_scaling"] = {"type": "mrope", "mrope_section": rp["mrope_section"]}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(c, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    print("transformers", transformers.__version__, "torch", torch.__version__, flush=True)
    # plain float32 on GPUs too: no TF32 in matmuls or in the patch embedding's Conv3d
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
            # transformers 5 module names (`model.visual.*`, `model.language_model.*`)
            sd = {k: v.contiguous().clone() for k, v in model.state_dict().items()}
            save_file(sd, os.path.join(d, "model", "model.safetensors"), metadata={"format": "pt"})
        model.to(args.device)
        g = torch.Generator().manual_seed(1234)
        kw = make_inputs(case, cfg, sp, g)
        kwd = {k: v.to(args.device) for k, v in kw.items()}
        with torch.no_grad():
            logits = model(**kwd).logits[0].float().cpu()
            model.generation_config.eos_token_id = None
            model.generation_config.pad_token_id = 0
            gen = model.generate(**kwd, max_new_tokens=NEW_TOKENS, do_sample=False, num_beams=1)
        generated = gen[0, kw["input_ids"].shape[1]:].cpu()
        assert generated.numel() == NEW_TOKENS, generated.shape
        tensors = {"input_ids": kw["input_ids"][0].to(torch.int64), "logits": logits.contiguous(),
                   "generated": generated.to(torch.int64)}
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
                           prompt_len=int(kw["input_ids"].shape[1]), device=args.device), f, indent=1)
        print(f"{case['name']}: prompt {kw['input_ids'].shape[1]} tokens, logits {tuple(logits.shape)}, "
              f"params {sum(p.numel() for p in model.parameters())}", flush=True)


if __name__ == "__main__":
    main()
