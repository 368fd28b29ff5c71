#!/usr/bin/env python3
"""Compare rollplex's image/video preprocessing with Hugging Face transformers'.

Needs `pip install transformers pillow numpy` (no torch: transformers then uses its PIL
backend, `Qwen2VLImageProcessorPil`). Run from the repository root:

    python3 tests/reference/preprocess_compare.py

It writes test images (noise, smooth gradients, hard-edged shapes; many sizes), runs
transformers on them, runs ours through the ignored Rust test
`preprocess::tests::dump_for_reference`, and prints the max and mean absolute error of
`pixel_values` per case. Exit status 1 if a grid
differs or an error exceeds --tol.

Videos: transformers' `Qwen2VLVideoProcessor` needs torch/torchvision, so the video reference
here is the PIL path frame by frame (resize, rescale, normalise as the image processor does)
followed by a numpy transcription of the video processor's temporal padding and patchify
(`patches.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)`). The torchvision resize itself is not
compared (see the module doc of runtime/src/preprocess.rs).
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

import numpy as np
from PIL import Image

import transformers
from transformers.image_utils import SizeDict
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil


def make_image(rng, h, w, kind):
    if kind == "noise":
        return rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    if kind == "smooth":
        y, x = np.mgrid[0:h, 0:w]
        r = 127.5 + 127.5 * np.sin(x / max(w, 1) * 6.0 + y / max(h, 1) * 2.0)
        g = 255.0 * x / max(w - 1, 1)
        b = 255.0 * y / max(h - 1, 1)
        return np.stack([r, g, b], axis=-1).round().clip(0, 255).astype(np.uint8)
    # hard-edged shapes on a plain background, like the moving-shapes task
    img = np.zeros((h, w, 3), dtype=np.uint8)
    img[:] = (30, 30, 70)
    for _ in range(4):
        s = max(2, min(h, w) // 5)
        y0, x0 = rng.integers(0, h - s + 1), rng.integers(0, w - s + 1)
        img[y0 : y0 + s, x0 : x0 + s] = rng.integers(0, 256, size=3)
    return img


def processor(cfg):
    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": cfg["min_pixels"], "longest_edge": cfg["max_pixels"]},
        patch_size=cfg["patch_size"],
        temporal_patch_size=cfg["temporal_patch_size"],
        merge_size=cfg["merge_size"],
    )


def hf_image(path, cfg):
    out = processor(cfg)(images=[np.array(Image.open(path).convert("RGB"))], return_tensors="np")
    return out["pixel_values"], [int(v) for v in out["image_grid_thw"][0]]


def hf_video(paths, cfg):
    proc = processor(cfg)
    size = SizeDict(shortest_edge=cfg["min_pixels"], longest_edge=cfg["max_pixels"])
    p, m, tp = cfg["patch_size"], cfg["merge_size"], cfg["temporal_patch_size"]
    frames = []
    for path in paths:
        chw = np.moveaxis(np.array(Image.open(path).convert("RGB")), -1, 0)
        chw = proc.resize(chw, size=size, resample=proc.resample, factor=p * m)
        chw = proc.rescale(chw, proc.rescale_factor)
        chw = proc.normalize(chw, proc.image_mean, proc.image_std)
        frames.append(chw)
    v = np.stack(frames)  # (T, C, H, W)
    pad = -v.shape[0] % tp
    if pad:
        v = np.concatenate([v, np.repeat(v[-1:], pad, axis=0)], axis=0)
    t, c, h, w = v.shape
    gt, gh, gw = t // tp, h // p, w // p
    v = v.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p)
    v = v.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return v.reshape(gt * gh * gw, c * tp * p * p), [gt, gh, gw]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tol", type=float, default=1e-6, help="max abs error allowed (default 1e-6)")
    ap.add_argument(
        "--cargo-test",
        default=os.environ.get("ROLLPLEX_CARGO_TEST", "cargo test -p rollplex-runtime --lib"),
        help="command that runs rollplex-runtime's lib tests (default: %(default)s)",
    )
    ap.add_argument("--keep", help="write the cases into this directory and keep them")
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    work = args.keep or tempfile.mkdtemp(prefix="rollplex-preprocess-")
    os.makedirs(work, exist_ok=True)
    base = {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}
    qwen_img = dict(base, min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
    tiny = dict(base, min_pixels=28 * 28, max_pixels=28 * 28 * 1280)
    qwen25 = dict(base, min_pixels=56 * 56, max_pixels=12845056)
    video = dict(base, min_pixels=128 * 28 * 28, max_pixels=28 * 28 * 768)
    specs = [
        # name, kind, frames, (h, w), content, config
        ("img_28_tiny", "image", 1, (28, 28), "shapes", tiny),
        ("img_28_upscaled", "image", 1, (28, 28), "noise", qwen_img),
        ("img_56", "image", 1, (56, 56), "noise", tiny),
        ("img_50x70", "image", 1, (50, 70), "noise", qwen_img),
        ("img_333x517", "image", 1, (333, 517), "smooth", qwen_img),
        ("img_480x640", "image", 1, (480, 640), "noise", qwen_img),
        ("img_1000x200_shapes", "image", 1, (1000, 200), "shapes", qwen_img),
        ("img_2000x1500_maxpix", "image", 1, (2000, 1500), "smooth", qwen_img),
        ("img_1500x2000_noise_down", "image", 1, (1500, 2000), "noise", qwen_img),
        ("img_900x1000_noise_mixed", "image", 1, (900, 1000), "noise", qwen_img),
        ("img_1200x900_qwen25", "image", 1, (1200, 900), "noise", qwen25),
        ("vid_tiny_4x28", "video", 4, (28, 28), "shapes", tiny),
        ("vid_tiny_4x56", "video", 4, (56, 56), "shapes", tiny),
        ("vid_3x100x150_pad", "video", 3, (100, 150), "noise", qwen_img),
        ("vid_8x448", "video", 8, (448, 448), "shapes", tiny),
        ("vid_5x240x320_default", "video", 5, (240, 320), "smooth", video),
    ]
    cases = []
    for name, kind, n, (h, w), content, cfg in specs:
        paths = []
        for k in range(n):
            p = f"{name}_f{k}.png"
            Image.fromarray(make_image(rng, h, w, content)).save(os.path.join(work, p))
            paths.append(p)
        full = dict(
            cfg,
            do_resize=True,
            resample="bicubic",
            do_rescale=True,
            rescale_factor=1 / 255,
            do_normalize=True,
            image_mean=[0.48145466, 0.4578275, 0.40821073],
            image_std=[0.26862954, 0.26130258, 0.27577711],
        )
        cases.append({"name": name, "kind": kind, "frames": paths, "config": full})
    with open(os.path.join(work, "cases.json"), "w") as f:
        json.dump(cases, f)

    cmd = shlex.split(args.cargo_test) + ["preprocess::tests::dump_for_reference", "--", "--ignored", "--exact"]
    env = dict(os.environ, ROLLPLEX_PREPROCESS_CASES=os.path.abspath(work))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        print(r.stdout[-3000:], r.stderr[-3000:], sep="\n")
        sys.exit(f"rust side failed: {' '.join(cmd)}")

    print(f"transformers {transformers.__version__}, Pillow {Image.__version__}, numpy {np.__version__}")
    print(f"{'case':26} {'input':>12} {'grid_thw':>12} {'rows x cols':>14} {'max abs err':>12} {'mean abs err':>12}")
    worst, bad = 0.0, False
    for c, (_, kind, n, (h, w), _, _) in zip(cases, specs):
        paths = [os.path.join(work, p) for p in c["frames"]]
        ref, grid = hf_image(paths[0], c["config"]) if kind == "image" else hf_video(paths, c["config"])
        meta = json.load(open(os.path.join(work, c["name"] + ".rust.json")))
        ours = np.fromfile(os.path.join(work, c["name"] + ".rust.f32"), dtype="<f4")
        if meta["grid_thw"] != grid or ours.size != ref.size:
            print(f"{c['name']:26} GRID MISMATCH ours {meta['grid_thw']} vs transformers {grid}")
            bad = True
            continue
        err = np.abs(ours.reshape(ref.shape).astype(np.float64) - ref.astype(np.float64))
        mx, mean = float(err.max()), float(err.mean())
        worst = max(worst, mx)
        bad |= mx > args.tol
        inp = f"{n}x{h}x{w}" if kind == "video" else f"{h}x{w}"
        print(
            f"{c['name']:26} {inp:>12} {str(grid):>12} {str(ref.shape[0]) + ' x ' + str(ref.shape[1]):>14} "
            f"{mx:12.3g} {mean:12.3g}"
        )
    print(f"worst max abs error: {worst:.3g} (tolerance {args.tol:g})")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
