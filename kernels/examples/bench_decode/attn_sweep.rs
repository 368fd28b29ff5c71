//! `--attn-sweep`: the group-shared decode attention alone over all layers, for each block
//! target of its two passes and each chunk length.

use super::*;

/// Group-pass and per-sample-pass block targets tried (each against each).
const TARGETS: [usize; 6] = [66, 132, 198, 264, 396, 528];

/// Chunk lengths (keys a block takes) tried for each pass, each against each.
const CHUNKS: [usize; 4] = [128, 224, 256, 512];

/// `--attn-sweep`: for each case with a shared prefix (its group size; `lens`: the prefix and
/// each sample's own keys), the grouped attention of every layer in one graph under the plan
/// of each (group pass, per-sample pass) block target and of each pair of chunk lengths, with
/// its blocks, slots and achieved rate on the bytes it moves; the default plan's row is marked.
pub(crate) fn attn_sweep(
    g: &Gpu,
    s: &Arc<CudaStream>,
    ceiling: f64,
    cases: &[Case],
    (plen, own): (usize, usize),
) -> Res<()> {
    for &(d, batch, prefix) in cases {
        let Some((gsize, _)) = prefix else {
            continue;
        };
        let kv_len = plen + own;
        let mut m = build(g, s, d, batch, kv_len, Some((gsize, plen)))?;
        let dims = m.dims();
        let by_targets = TARGETS
            .iter()
            .flat_map(|&p| TARGETS.iter().map(move |&t| (p, t)))
            .map(|t| grouped_decode_plan_for_targets(batch, gsize, dims, plen, own, t));
        // a chunk of c keys: the blocks that many units need to cover the pass in chunks of c
        let units_p = group_pass_units(batch.div_ceil(gsize), gsize, &dims);
        let units_s = batch * d.nkv;
        let by_chunks = CHUNKS
            .iter()
            .flat_map(|&cp| CHUNKS.iter().map(move |&cs| (cp, cs)))
            .map(|(cp, cs)| {
                let t = (units_p * plen.div_ceil(cp), units_s * own.div_ceil(cs));
                grouped_decode_plan_for_targets(batch, gsize, dims, plen, own, t)
            });
        let plans: Vec<GroupedDecodePlan> = by_targets.chain(by_chunks).collect();
        let ws = plans.iter().map(|p| p.workspace_len()).max().unwrap_or(1);
        if ws > m.ws.len() {
            m.ws = g.alloc(s, ws)?;
        }
        m.grouped = true;
        let default = m.gplan;
        let (_, _, kv_moved, _) = m.bytes();
        println!(
            "== attention sweep {} B={batch} G{gsize} prefix {plen} own {own}: {:.3} GB moved a step",
            d.name,
            kv_moved / 1e9
        );
        let mut seen = Vec::new();
        let mut best: Option<(f64, GroupedDecodePlan)> = None;
        // FNV-1a of the last layer's output bits under each cut, and under the default cut
        // (the runtime's)
        let mut hashes: Vec<u64> = Vec::new();
        let mut default_hash: Option<u64> = None;
        for plan in plans.into_iter().chain(std::iter::once(default)) {
            if seen.contains(&plan) {
                continue;
            }
            seen.push(plan);
            m.gplan = plan;
            let layers = m.d.layers;
            let t = m.attention_ms(g, s)?;
            let out: Vec<u8> = s
                .clone_dtoh(&m.attn)?
                .iter()
                .flat_map(|x| x.to_bits().to_le_bytes())
                .collect();
            let h = nvrtc::fnv1a64(&[&out]);
            if plan == default {
                default_hash = Some(h);
            }
            hashes.push(h);
            let blocks = units_p * plan.p_splits + units_s * plan.s_splits;
            let tbs = kv_moved / (t * 1e-3) / 1e12;
            println!(
                "  group pass {:2}x{:4}, per-sample {:2}x{:4}: {blocks:5} blocks, {:2} slots: {t:.3} ms ({:.1} us a layer), {tbs:.2} TB/s ({:.0}% of copy){}",
                plan.p_splits,
                plan.p_chunk,
                plan.s_splits,
                plan.s_chunk,
                plan.p_splits + plan.s_splits,
                t * 1e3 / layers as f64,
                100.0 * tbs / ceiling,
                if plan == default { "  <- default" } else { "" }
            );
            if best.is_none_or(|(b, _)| t < b) {
                best = Some((t, plan));
            }
        }
        if let Some((t, p)) = best {
            println!(
                "  best: group pass {}x{}, per-sample {}x{}: {t:.3} ms",
                p.p_splits, p.p_chunk, p.s_splits, p.s_chunk
            );
        }
        if let Some(h) = default_hash {
            // builds whose kernels claim the same results print the same default hash; other
            // cuts split the keys elsewhere, so their partial softmax sums, and possibly the
            // rounded outputs, differ
            let other = hashes.iter().filter(|&&x| x != h).count();
            println!(
                "  default cut's output: fnv {h:016x}; {other} of {} cuts round to other bits",
                hashes.len()
            );
        }
    }
    Ok(())
}
