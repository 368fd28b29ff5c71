//! Upper bounds of the language's counts, checked where a count is read ([`crate::table`]), so a
//! pipeline asking for more is a located error (file:line:col, the limit, the value) before the
//! compiler allocates anything for it. They keep compiling any accepted pipeline within seconds
//! and a few hundred MiB; docs/language.md lists them.

/// `(path, largest value)` of every bounded count; the path is the key as written
/// (`rollout.prompts`), as diagnostics and spans name it.
pub const LIMITS: &[(&str, u32)] = &[
    ("gpu.count", 4096),
    ("gpu.gpus_per_node", 64),
    ("rollout.tp", 64),
    ("train.tp", 64),
    ("rollout.prompts", 4096),
    ("rollout.group", 1024),
    ("rollout.text_tokens", 1 << 20),
    ("rollout.max_new_tokens", 1 << 20),
    ("rollout.media.frames", 4096),
    ("rollout.media.count", 256),
    ("train.micro_batch", MAX_SAMPLES),
    ("train.mini_batch", MAX_SAMPLES),
    ("train.epochs", 64),
];

/// The most samples (prompts x group) one iteration may hold: 4096 prompts of 16 compile in
/// about 8 s (2 cores) and 80 MiB.
pub const MAX_SAMPLES: u32 = 65_536;

/// The most training micro-batch steps (micro-batches x epochs) of one iteration: 8192 compile
/// in about 4 s.
pub const MAX_MICRO_STEPS: u32 = 8192;

/// The largest value allowed at `path`, if it is bounded.
pub fn max_of(path: &str) -> Option<u32> {
    LIMITS.iter().find(|(p, _)| *p == path).map(|&(_, m)| m)
}

/// The help line of a limit error.
pub const HELP: &str =
    "the language bounds this count to keep compile time and memory in check (docs/language.md, \"Limits\")";
