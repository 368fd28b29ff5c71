#!/usr/bin/env python3
"""Convert a veRL-layout Parquet dataset into rollplex's JSONL (needs `pip install pyarrow`).

    python3 tests/reference/verl_parquet_to_jsonl.py train.parquet OUT_DIR

veRL's layout (examples/data_preprocess/*.py there):
  prompt        list of {role, content} messages; content may hold <image>/<video> markers
  images        list of {bytes, path} (as `datasets` stores images) or list of paths
  videos        list of {video: path or [frame paths]} or list of [frame paths]; the first is used
  reward_model  {style, ground_truth}  -> answer
  extra_info    {index, ...}           -> id (else the row number)

Writes OUT_DIR/<name>.jsonl and embedded image bytes as files under OUT_DIR/<name>_media/.
Relative paths in the Parquet file are taken relative to its directory. A video given as one
video file (not frames) is refused: rollplex reads already-sampled frames.
"""

import json
import os
import sys

import pyarrow.parquet as pq


def die(msg):
    sys.exit(f"verl_parquet_to_jsonl: {msg}")


def main():
    if len(sys.argv) != 3:
        die("usage: verl_parquet_to_jsonl.py INPUT.parquet OUT_DIR")
    src, out = sys.argv[1], sys.argv[2]
    name = os.path.splitext(os.path.basename(src))[0]
    media = os.path.join(out, f"{name}_media")
    os.makedirs(media, exist_ok=True)
    base = os.path.dirname(os.path.abspath(src))
    rows = pq.read_table(src).to_pylist()

    def path_of(p):
        p = p if os.path.isabs(p) else os.path.join(base, p)
        return os.path.relpath(p, out)

    lines = []
    for n, row in enumerate(rows):
        where = f"{src}: row {n}"
        extra = row.get("extra_info") or {}
        sid = str(extra.get("index", f"row{n}"))
        prompt = row.get("prompt")
        system = None
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, list) and prompt:
            users = [m.get("content", "") for m in prompt if m.get("role") == "user"]
            systems = [m.get("content", "") for m in prompt if m.get("role") == "system"]
            if not users:
                die(f"{where}: field `prompt` has no user message")
            text, system = users[-1], (systems[0] if systems else None)
        else:
            die(f"{where}: field `prompt` must be a string or a list of messages")
        rm = row.get("reward_model") or {}
        if "ground_truth" not in rm:
            die(f"{where}: field `reward_model.ground_truth` is missing")
        gt = rm["ground_truth"]
        answer = gt if isinstance(gt, str) else json.dumps(gt)
        rec = {"id": sid, "prompt": text, "answer": answer}
        if system:
            rec["system"] = system
        images = []
        for k, im in enumerate(row.get("images") or []):
            if isinstance(im, str):
                images.append(path_of(im))
            elif isinstance(im, dict) and im.get("bytes"):
                b = im["bytes"]
                ext = ".png" if b[:8] == b"\x89PNG\r\n\x1a\n" else ".jpg"
                p = os.path.join(media, f"{sid}_{k}{ext}")
                with open(p, "wb") as f:
                    f.write(b)
                images.append(os.path.relpath(p, out))
            elif isinstance(im, dict) and im.get("path"):
                images.append(path_of(im["path"]))
            else:
                die(f"{where}: field `images`[{k}] has neither bytes nor a path")
        videos = row.get("videos") or []
        if videos:
            v = videos[0]
            frames = v.get("video") if isinstance(v, dict) else v
            if isinstance(frames, str):
                die(f"{where}: field `videos`[0] is a video file ({frames}); give its sampled frames as a list of image paths")
            if not isinstance(frames, list) or not frames:
                die(f"{where}: field `videos`[0] must be a non-empty list of frame paths")
            rec["video"] = [path_of(p) for p in frames]
        if images and videos:
            die(f"{where}: has both images and a video; rollplex samples hold one or the other")
        if images:
            rec["images"] = images
        lines.append(json.dumps(rec, ensure_ascii=False))
    dst = os.path.join(out, f"{name}.jsonl")
    with open(dst, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} samples to {dst}")


if __name__ == "__main__":
    main()
