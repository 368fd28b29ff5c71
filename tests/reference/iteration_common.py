"""What the PyTorch peers of one RL iteration of examples/h200-3b-video.rpx share.

`hf_iteration.py` (the plain PyTorch + transformers loop) and `strong_iteration.py` (a tuned
PyTorch stack) run the same job; this module holds what must not differ between them:

- the job's knobs (environment: PROMPTS, G, MAX_NEW, MB, SEED, ITERATION, MEDIAN, SIGMA; and
  `--prompts N` on the command line, which wins over PROMPTS);
- Rollplex's forced response lengths (runtime/src/model/philox.rs, runtime/src/exec/mod.rs
  `forced_length`), ported to Python and checked by runtime/tests/forced_lengths.rs through
  `--write-golden`;
- the model's dimensions (Qwen2.5-VL-3B, or the tiny stand-in for a CPU dry run) and the token
  ids the prompt layout uses;
- the seeded prompts, videos and rewards (one CPU generator, drawn in one order);
- phase timing between device synchronisations, peak memory, and the result file.

Nothing here imports torch at module level: `--lengths` and `--write-golden` run without it.
"""
import json
import math
import os
import sys
import time

ENV = os.environ
RESULTS_DIR = ENV.get("RESULTS_DIR", ".")

# token ids of the Qwen2.5-VL vocabulary the prompt layout uses
EOS_PAD = 151643
VSTART, VEND, VIDEO = 151652, 151653, 151656
SPECIAL = [151652, 151653, 151654, 151655, 151656]  # vision start/end/pad, image, video: never sampled

# the objective and the optimizer of examples/h200-3b-video.rpx
CLIP_LO, CLIP_HI, KL_COEF = 0.2, 0.2, 0.001
LR, BETAS, ADAM_EPS, WEIGHT_DECAY, GRAD_CLIP = 1e-6, (0.9, 0.999), 1e-8, 0.01, 1.0

# ---------------------------------------------------------------------------------------------
# Rollplex's forced response lengths (runtime/src/model/philox.rs, runtime/src/exec/mod.rs)

M0, M1 = 0xD2511F53, 0xCD9E8D57
W0, W1 = 0x9E3779B9, 0xBB67AE85
MASK = 0xFFFFFFFF


def philox4x32_10(ctr, key):
    """One Philox4x32 block with 10 rounds (same as philox.rs)."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for rnd in range(10):
        if rnd > 0:
            k0 = (k0 + W0) & MASK
            k1 = (k1 + W1) & MASK
        p0 = M0 * c0
        p1 = M1 * c2
        hi0, lo0 = p0 >> 32, p0 & MASK
        hi1, lo1 = p1 >> 32, p1 & MASK
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return [c0, c1, c2, c3]


def uniform_open01(a, b):
    bits = ((a << 20) ^ (b >> 12)) & ((1 << 52) - 1)
    return (bits + 0.5) / float(1 << 52)


def forced_length(seed, iteration, sample, max_new, median, sigma):
    """The log-normal branch of `forced_length`: Box-Muller from two Philox uniforms."""
    r = philox4x32_10([iteration, sample, 0, 0x4C454E47], [seed & MASK, (seed >> 32) & MASK])
    u1, u2 = uniform_open01(r[0], r[1]), uniform_open01(r[2], r[3])
    z = math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)
    x = median * math.exp(sigma * z)
    rounded = math.floor(x + 0.5)  # Rust's f64::round: half away from zero (x > 0 here)
    return int(min(max(rounded, 1), max(max_new, 1)))


def _philox_known_answers():
    # the Random123 known-answer vectors philox.rs tests against
    assert philox4x32_10([0] * 4, [0] * 2) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert philox4x32_10([MASK] * 4, [MASK] * 2) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    assert philox4x32_10([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0]) == [
        0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


_philox_known_answers()

# ---------------------------------------------------------------------------------------------
# the job


def prompts_arg(argv, default=None):
    """The value of `--prompts N` (or `--prompts=N`) in argv, else `default`."""
    for i, a in enumerate(argv):
        if a == "--prompts" and i + 1 < len(argv):
            return int(argv[i + 1])
        if a.startswith("--prompts="):
            return int(a.split("=", 1)[1])
    return default


class Job:
    """The job's sizes and seeds: environment knobs, `prompts` (from `--prompts`) winning over
    PROMPTS; `defaults` replaces the built-in default of a knob the environment does not set."""

    def __init__(self, prompts=None, defaults=None):
        d = {"PROMPTS": "16", "G": "8", "MAX_NEW": "512", "SEED": "42", "ITERATION": "0",
             "MEDIAN": "256", "SIGMA": "0.6"}
        d.update({k: str(v) for k, v in (defaults or {}).items()})
        get = lambda k: ENV.get(k, d[k])  # noqa: E731
        self.prompts = int(prompts) if prompts is not None else int(get("PROMPTS"))
        self.group = int(get("G"))
        self.max_new = int(get("MAX_NEW"))
        self.micro_batch = int(ENV.get("MB", str(self.group)))
        self.seed = int(get("SEED"))
        self.iteration = int(get("ITERATION"))
        self.median, self.sigma = float(get("MEDIAN")), float(get("SIGMA"))
        self.samples = self.prompts * self.group

    def lengths(self, n=None, iteration=None):
        """Forced response lengths of samples 0..n of `iteration` (default: the job's)."""
        it = self.iteration if iteration is None else iteration
        n = self.samples if n is None else n
        return [forced_length(self.seed, it, s, self.max_new, self.median, self.sigma) for s in range(n)]

    def response_len_text(self):
        return (f"lognormal(median={self.median:g}, sigma={self.sigma:g}) capped at {self.max_new}, "
                "Rollplex's forced_length")

    def handle_length_cli(self, argv, writer):
        """`--lengths N` prints the forced lengths of samples 0..N and exits; `--write-golden
        PATH` writes those of the whole job for runtime/tests/forced_lengths.rs and exits."""
        flags = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--lengths", "--write-golden")}
        if "--lengths" in flags:
            print(json.dumps(self.lengths(int(flags["--lengths"]))))
            sys.exit(0)
        if "--write-golden" in flags:
            golden = {
                "what": f"forced response lengths of examples/h200-3b-video.rpx, written by {writer}",
                "seed": self.seed, "iteration": self.iteration, "max_new_tokens": self.max_new,
                "median": self.median, "sigma": self.sigma, "lengths": self.lengths(),
            }
            with open(flags["--write-golden"], "w") as f:
                json.dump(golden, f, indent=1)
                f.write("\n")
            sys.exit(0)


class Dims:
    """Qwen2.5-VL-3B's dimensions as transformers' config keys (`vis`, `txt`), the video grid
    and the prompt layout: [vision start] [NTOK video tokens] [vision end] [TEXT text tokens].
    `small` is a tiny stand-in (2 text layers, narrow widths, a 2 x 16 x 16 grid) for dry runs."""

    def __init__(self, small=False, text_tokens=None):
        self.vis = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                        fullatt_block_indexes=[7, 15, 23, 31], in_channels=3, in_chans=3)
        self.txt = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                        num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0,
                        max_position_embeddings=128000,
                        rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}, tie_word_embeddings=True,
                        rms_norm_eps=1e-6, hidden_act="silu")
        self.T, self.GH, self.GW = 4, 32, 32  # 8 frames 448x448: temporal patch 2, 14-pixel patches
        self.TEXT = 200
        if small:
            self.vis.update(depth=4, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=128,
                            fullatt_block_indexes=[1, 3])
            self.txt.update(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2,
                            rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]})
            self.T, self.GH, self.GW = 2, 16, 16
            self.TEXT = int(ENV.get("TEXT", "20"))
        if text_tokens is not None:
            self.TEXT = text_tokens
        self.NPATCH = self.T * self.GH * self.GW
        self.NTOK = self.NPATCH // (self.vis["spatial_merge_size"] ** 2)
        self.PROMPT_LEN = 1 + self.NTOK + 1 + self.TEXT
        self.PATCH_DIM = self.vis["in_channels"] * self.vis["temporal_patch_size"] * self.vis["patch_size"] ** 2


def make_data(job, dims, dev):
    """The seeded job data, drawn from one CPU generator in hf_iteration.py's order: per prompt
    its text tokens then its video (NPATCH x 1176 pixels, bf16 on `dev`), then one 0/1 reward per
    sample. Returns (prompt rows, videos, rewards, the generator for later draws)."""
    import torch
    gen = torch.Generator(device="cpu").manual_seed(job.seed)
    prompt_rows, videos = [], []
    for _ in range(job.prompts):
        text = torch.randint(1000, 100000, (dims.TEXT,), generator=gen).tolist()
        prompt_rows.append([VSTART] + [VIDEO] * dims.NTOK + [VEND] + text)
        videos.append(torch.randn(dims.NPATCH, dims.PATCH_DIM, generator=gen).to(dev, torch.bfloat16))
    rewards = torch.randint(0, 2, (job.samples,), generator=gen).float()
    return prompt_rows, videos, rewards, gen


def grpo_advantages(rewards, prompts, group):
    """(r - mean_group) / (std_group + 1e-6), per sample."""
    r = rewards.view(prompts, group)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)


# ---------------------------------------------------------------------------------------------
# timing and results


class Recorder:
    """The result object (`res`), written as JSON to RESULTS_DIR/`name` after every phase so a
    run cut short still says how far it got; device synchronisation and peak memory."""

    def __init__(self, name, cuda, res=None):
        self.path = os.path.join(RESULTS_DIR, name)
        self.cuda = cuda
        self.res = {} if res is None else res

    def save(self):
        with open(self.path, "w") as f:
            json.dump(self.res, f, indent=1)

    def sync(self):
        if self.cuda:
            import torch
            torch.cuda.synchronize()

    def reset_peak(self):
        if self.cuda:
            import torch
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self):
        if not self.cuda:
            return None
        import torch
        return torch.cuda.max_memory_allocated() / 2**30

    def phase(self, name, into=None, quiet=False):
        return Phase(self, name, into, quiet)


class Phase:
    """Times a phase between two device synchronisations and records `NAME_s` and
    `NAME_peak_gib` into `into` (default: the result object)."""

    def __init__(self, rec, name, into=None, quiet=False):
        self.rec, self.name, self.quiet = rec, name, quiet
        self.into = rec.res if into is None else into

    def __enter__(self):
        self.rec.sync()
        self.rec.reset_peak()
        self.t = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.rec.sync()
        if exc[0] is None:
            self.into[f"{self.name}_s"] = time.perf_counter() - self.t
            self.into[f"{self.name}_peak_gib"] = self.rec.peak_gib()
            if not self.quiet:
                print(f"{self.name}: {self.into[f'{self.name}_s']:.3f} s, peak {self.into[f'{self.name}_peak_gib']} GiB",
                      flush=True)
            self.rec.save()
        return False


PHASES = ["rollout", "scoring_ref", "scoring_old", "scoring", "reward", "training"]


def phase_table(res, phases=PHASES):
    """The markdown table of the phases' times, shares of the iteration and peak memory."""
    lines = ["| phase | s | share | peak GiB |", "|---|---|---|---|"]
    for ph in phases:
        if f"{ph}_s" not in res:
            continue
        peak = res.get(f"{ph}_peak_gib")
        lines.append(f"| {ph} | {res[ph + '_s']:.3f} | {100 * res[ph + '_s'] / res['time_s']:.1f}% | "
                     f"{peak if peak is None else round(peak, 2)} |")
    peak = res.get("peak_gib")
    lines.append(f"| iteration | {res['time_s']:.3f} | 100% | {peak if peak is None else round(peak, 2)} |")
    return "\n".join(lines)
