#!/usr/bin/env python3
"""Reference gradients for Rollplex's training engine: PyTorch autograd of the transformers
Qwen2.5-VL model under the GRPO loss, on the tiny random checkpoints of make_tiny.py.

For every case of make_tiny.CASES, OUT/<case>/ gets:
  model/                  the checkpoint (transformers' save_pretrained)
  grad_inputs.safetensors prompt (input_ids, pixels, grids, second_per_grid_ts) and one GRPO
                          group of G responses, flat: resp_tokens [N] i64, resp_offsets [G+1]
                          i64, old_logp / ref_logp / advantages [N] f32, mask [N] i64 (0/1)
  grad_ref.safetensors    torch_logp [N] f32, torch_loss [1] f64, and the gradient of every
                          parameter under its transformers name (f32)
  grad_case.json          the loss configuration and the numbers above in words

The loss is the one runtime/src/train/loss.rs implements (veRL's definitions): ratio
exp(clamp(logp - old, -20, 20)), clipped surrogate with clip_low/clip_high and dual clip,
k3 KL to the reference (clamped at +-10), aggregation over the response mask with the group's
token / sequence counts. Response token j of a sample is scored from the full sequence
prompt + response: logits at position P-1+j divided by the temperature. Positions are those of
generation (transformers' `generate`): the prompt's from get_rope_index, response token at
sequence index n gets n + rope_delta in all three sections.

With `--dtype bfloat16` (for our CUDA trainer, `grad_compare --backend cuda`) the cases are
make_tiny_bf16.CASES (head dims the CUDA kernels take), the gradients of grad_ref.safetensors
come from the model cast to bfloat16 (`model.to(torch.bfloat16)`: bf16 weights, activations and
parameter gradients; log-softmax in f32 as above), and grad_ref_f32.safetensors holds the same
model's float32 gradients and log-probs (TF32 off) on the same inputs, for scale: the spread
between the two is PyTorch's own bf16 error. The inputs (old/ref log-probs) come from the f32
model in both modes. Two conditioning steps in bf16 mode only: tied embeddings are scaled to
1/sqrt(hidden) (at scale 1 the tied lm head gives log-probs near -180 and bf16 alone scrambles
the gradient), and old log-probs are moved so that no token's log-ratio lies within CLIP_MARGIN of a
clip boundary (bf16 rounding would otherwise decide whether that token is clipped).

Then `cargo run -p rollplex-runtime --example grad_compare -- OUT` compares.

Usage: python grad_compare.py OUT [--device cpu|cuda] [--dtype float32|bfloat16]
                              [--agg token_mean|seq_mean_token_mean|seq_mean_token_sum]
Needs torch and transformers (torch 2.11, transformers 5.17 were used).
"""
import argparse
import json
import math
import os
import shutil
import sys

import torch
import transformers
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_tiny  # noqa: E402  (the shared tiny checkpoints and prompts)
import make_tiny_bf16  # noqa: E402  (cases with head dims the CUDA kernels take)

LOSS = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_coef=0.1, kl_estimator="k3",
            temperature=0.9)
RESPONSE_LENS = [7, 1, 4, 10]
CLIP_MARGIN = 0.05  # bf16 cases: the smallest distance of a log-ratio from a clip boundary


def policy_loss(logp, old, ref, adv, mask, offsets, agg, cfg):
    """veRL's GRPO/PPO-clip loss in float64, one group = the whole mini-batch."""
    logp, old, ref, adv = (t.double() for t in (logp, old, ref, adv))
    m = mask.double()
    neg_kl = torch.clamp(logp - old, -20.0, 20.0)
    ratio = torch.exp(neg_kl)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - cfg["clip_low"], 1 + cfg["clip_high"])
    clip1 = torch.maximum(l1, l2)
    l3 = -adv * cfg["dual_clip"]
    pg = torch.where(adv < 0, torch.minimum(l3, clip1), clip1)
    kl = torch.clamp(ref - logp, -20.0, 20.0)
    kl = torch.clamp(torch.exp(kl) - kl - 1, -10.0, 10.0)

    def aggregate(x):
        n_tok = m.sum()
        seqs = len(offsets) - 1
        if agg == "token_mean":
            return (x * m).sum() / n_tok
        per_seq = []
        for s in range(seqs):
            a, b = offsets[s], offsets[s + 1]
            tot = (x[a:b] * m[a:b]).sum()
            cnt = m[a:b].sum()
            if agg == "seq_mean_token_mean":
                per_seq.append(tot / cnt if cnt > 0 else tot * 0)
            else:
                per_seq.append(tot)
        return torch.stack(per_seq).sum() / seqs

    return aggregate(pg) + cfg["kl_coef"] * aggregate(kl)


def full_inputs(kw, response):
    """Prompt kwargs extended by a response, with generation's 3D positions."""
    ids = kw["input_ids"]
    dev = ids.device
    resp = torch.tensor([response], dtype=ids.dtype, device=dev)
    full = torch.cat([ids, resp], dim=1)
    mm = torch.cat([kw["mm_token_type_ids"], torch.zeros_like(resp)], dim=1)
    return full, mm


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--agg", default="token_mean",
                    choices=["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
    args = ap.parse_args()
    # full f32: no TF32 in cuDNN convolutions (the patch embedding) or cuBLAS matmuls
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    print("transformers", transformers.__version__, "torch", torch.__version__, flush=True)
    os.makedirs(args.out, exist_ok=True)
    cfg = dict(LOSS, agg=args.agg)
    temp = cfg["temperature"]
    bf16 = args.dtype == "bfloat16"
    for case in (make_tiny_bf16.CASES if bf16 else make_tiny.CASES):
        d = os.path.join(args.out, case["name"])
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(os.path.join(d, "model"))
        model, mcfg, sp = make_tiny.build(case)
        if bf16 and case["tie"]:
            # as the lm head, embeddings of scale 1 give log-probs near -180 on these widths,
            # where bf16 alone scrambles the loss (PyTorch's own bf16 gradient was 70-124% off
            # its f32 one): scale them to 1 / sqrt(hidden), as runtime/src/gpu/train_tests.rs does
            with torch.no_grad():
                model.get_input_embeddings().weight.mul_(1.0 / math.sqrt(case["text"]["hidden_size"]))
        model.save_pretrained(os.path.join(d, "model"))
        model.to(args.device)
        model.train()  # no dropout in Qwen2.5-VL; train() only enables autograd bookkeeping
        g = torch.Generator().manual_seed(4321)
        kw = make_tiny.make_inputs(case, mcfg, sp, g)
        kw = {k: v.to(args.device) for k, v in kw.items()}
        vocab = case["text"]["vocab_size"]
        responses = [torch.randint(0, vocab - 5, (n,), generator=g).tolist() for n in RESPONSE_LENS]
        prompt_len = kw["input_ids"].shape[1]
        rope_kw = {k: kw[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if k in kw}
        with torch.no_grad():
            pos_prompt, delta = model.model.get_rope_index(
                kw["input_ids"], mm_token_type_ids=kw["mm_token_type_ids"], **rope_kw)

        def response_logp(resp):
            full, mm = full_inputs(kw, resp)
            n = len(resp)
            tail = (torch.arange(prompt_len, prompt_len + n, device=full.device) + delta[0, 0]).view(1, 1, n)
            pos = torch.cat([pos_prompt, tail.expand(3, 1, n)], dim=2)
            fkw = {k: v for k, v in kw.items() if k not in ("input_ids", "mm_token_type_ids", "attention_mask")}
            out = model(input_ids=full, attention_mask=torch.ones_like(full), mm_token_type_ids=mm,
                        position_ids=pos, **fkw)
            logits = out.logits[0, prompt_len - 1:prompt_len - 1 + n].float() / temp
            lsm = torch.log_softmax(logits, dim=-1)
            return lsm.gather(1, torch.tensor(resp, device=lsm.device).view(-1, 1)).view(-1)

        # rollout/reference log-probs: the current ones plus noise (ratios on both sides of 1)
        with torch.no_grad():
            base = torch.cat([response_logp(r) for r in responses]).cpu()
        n_tok = base.numel()
        old = base + 0.3 * (torch.rand(n_tok, generator=g) * 2 - 1)
        if bf16:
            # keep every log-ratio CLIP_MARGIN away from the clip boundaries: bf16 log-probs are
            # ~1e-2 off in absolute terms here, enough to move a token across a boundary
            # (clipped <-> not), which changes the gradient by that token's whole share (seen:
            # mixed_mha_odd, a token 0.005 from ln 1.28: 11-20% on every tensor)
            lr = base - old
            for b in (math.log(1 - cfg["clip_low"]), math.log(1 + cfg["clip_high"]), math.log(cfg["dual_clip"])):
                side = torch.where(lr >= b, 1.0, -1.0)
                lr = torch.where((lr - b).abs() < CLIP_MARGIN, b + CLIP_MARGIN * side, lr)
            old = base - lr
        ref = base + 0.5 * (torch.rand(n_tok, generator=g) * 2 - 1)
        rewards = torch.rand(len(responses), generator=g)
        adv_seq = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        offsets = [0]
        for r in responses:
            offsets.append(offsets[-1] + len(r))
        adv = torch.cat([adv_seq[i].repeat(len(r)) for i, r in enumerate(responses)]).float()
        mask = torch.tensor([int((j + i) % 5 != 3) for i, r in enumerate(responses) for j in range(len(r))])

        def backward():
            """The loss, log-probs and every parameter's gradient (f32) of the model as it is."""
            model.zero_grad(set_to_none=True)
            logp = torch.cat([response_logp(r) for r in responses])
            dv = logp.device
            loss = policy_loss(logp, old.to(dv), ref.to(dv), adv.to(dv), mask.to(dv), offsets, args.agg,
                               cfg)
            loss.backward()
            grads = {}
            for name, p in model.named_parameters():
                if p.grad is None:
                    raise SystemExit(f"{case['name']}: no gradient reached {name}")
                grads[name] = p.grad.detach().float().cpu().contiguous()
            return loss, logp, grads

        loss, logp, grads = backward()
        if bf16:
            f32 = dict(grads)
            f32["torch_logp"] = logp.detach().float().cpu().contiguous()
            f32["torch_loss"] = loss.detach().double().cpu().view(1)
            save_file(f32, os.path.join(d, "grad_ref_f32.safetensors"))
            model.to(torch.bfloat16)
            loss, logp, grads = backward()

        inputs = {
            "input_ids": kw["input_ids"][0].cpu().to(torch.int64),
            "resp_tokens": torch.tensor([t for r in responses for t in r], dtype=torch.int64),
            "resp_offsets": torch.tensor(offsets, dtype=torch.int64),
            "old_logp": old.float().contiguous(),
            "ref_logp": ref.float().contiguous(),
            "advantages": adv.contiguous(),
            "mask": mask.to(torch.int64),
        }
        if "pixel_values" in kw:
            inputs["image_pixels"] = kw["pixel_values"].cpu().contiguous()
            inputs["image_grid_thw"] = kw["image_grid_thw"].cpu().to(torch.int64)
        if "pixel_values_videos" in kw:
            inputs["video_pixels"] = kw["pixel_values_videos"].cpu().contiguous()
            inputs["video_grid_thw"] = kw["video_grid_thw"].cpu().to(torch.int64)
            inputs["second_per_grid_ts"] = kw["second_per_grid_ts"].cpu().float()
        save_file(inputs, os.path.join(d, "grad_inputs.safetensors"))
        ref_t = dict(grads)
        ref_t["torch_logp"] = logp.detach().float().cpu().contiguous()
        ref_t["torch_loss"] = loss.detach().double().cpu().view(1)
        save_file(ref_t, os.path.join(d, "grad_ref.safetensors"))
        with open(os.path.join(d, "grad_case.json"), "w") as f:
            json.dump(dict(loss=cfg, case=case["name"], prompt_len=prompt_len, responses=RESPONSE_LENS,
                           torch_loss=float(loss.detach()), device=args.device, dtype=args.dtype,
                           torch=torch.__version__,
                           transformers=transformers.__version__, params=len(grads)), f, indent=1)
        print(f"{case['name']}: prompt {prompt_len} tokens, {len(responses)} responses ({n_tok} tokens), "
              f"loss {loss.item():.6f} ({args.dtype}), {len(grads)} parameter gradients", flush=True)


if __name__ == "__main__":
    main()
