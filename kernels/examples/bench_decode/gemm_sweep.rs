//! `--gemm-sweep`: each GEMM kind of the decode step alone, every way it can run.

use super::*;

/// How a GEMM kind runs: cuBLASLt with its heuristic's answer of that rank (0: the first, what
/// the library runs), or the skinny kernel with that cut.
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum GemmBy {
    Lt(usize),
    Skinny(SkinnyPlan),
}

/// `--gemm-sweep`: every GEMM kind of the 3B and 7B steps alone (all layers in one graph) at
/// m = 128..8: cuBLASLt (each of its heuristic's answers) against the skinny kernel's default
/// plan and its other cuts.
pub(crate) fn gemm_sweep(g: &Gpu, s: &Arc<CudaStream>, ceiling: f64, rows: &[usize]) -> Res<()> {
    for d in [D3B, D7B] {
        for &batch in rows {
            let mut m = build(g, s, d, batch, 16, None)?;
            s.synchronize()?;
            println!("== gemm sweep {} m{batch}", d.name);
            let (mut ours, mut theirs, mut best_total) = (0.0, 0.0, 0.0);
            for kind in 0..5 {
                let (k, n, wb) = m.gemm_shape(kind);
                let def = skinny_plan(batch, k, n);
                let mut cands: Vec<(String, GemmBy)> = vec![
                    ("cublasLt".into(), GemmBy::Lt(0)),
                    ("default".into(), GemmBy::Skinny(def)),
                ];
                // cuBLASLt's other heuristic answers (not every shape has all of them)
                cands.extend((1..LT_RANKS).map(|r| (format!("lt#{r}"), GemmBy::Lt(r))));
                for rt in [1, 2] {
                    for sp in [1, 2, 3, 4, 8] {
                        let p = skinny_plan_with(batch, k, n, rt, sp);
                        let mut forms = vec![p];
                        if batch > 8 && batch <= 32 {
                            forms.push(p.with_form(batch, false));
                        }
                        if p.wgmma {
                            // two consumer warpgroups sharing each x tile, and shallower pipelines
                            let two = p.with_warpgroups(2);
                            forms.extend(two);
                            for q in std::iter::once(p).chain(two) {
                                forms.extend([2, 3, 4].iter().filter_map(|&st| q.with_stages(st)));
                            }
                        }
                        for p in forms {
                            if p != def && !cands.iter().any(|(_, c)| *c == GemmBy::Skinny(p)) {
                                let form = if p.wgmma { "wg" } else { "sync" };
                                cands.push((
                                    format!(
                                        "{form}{} rt{} s{} st{}",
                                        p.warpgroups, p.row_tiles, p.splits, p.stages
                                    ),
                                    GemmBy::Skinny(p),
                                ));
                            }
                        }
                    }
                }
                let kname = ["qkv", "o", "gate_up", "down", "lm_head"][kind];
                let reps = if kind == 4 { 1.0 } else { d.layers as f64 };
                let mut line = Vec::new();
                let mut best = (f64::MAX, String::new());
                let mut timed = Vec::new();
                for (name, how) in &cands {
                    let gr = match capture(s, || m.gemm_kind(g, s, kind, *how)) {
                        Ok(gr) => gr,
                        // a rank the heuristic does not have for this shape
                        Err(_) if matches!(how, GemmBy::Lt(r) if *r > 0) => continue,
                        Err(e) => return Err(e),
                    };
                    let t = time_graph(g, s, &gr, 10)?;
                    drop(gr);
                    let tbs = wb / (t * 1e-3) / 1e12;
                    line.push(format!(
                        "{name} {:.1}us {:.0}%",
                        t * 1e3 / reps,
                        100.0 * tbs / ceiling
                    ));
                    timed.push((t, name.clone()));
                    if name == "cublasLt" {
                        theirs += t;
                    } else if name == "default" {
                        ours += t;
                    }
                    if t < best.0 {
                        best = (t, name.clone());
                    }
                }
                timed.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap());
                let top: Vec<String> = timed
                    .iter()
                    .take(8)
                    .map(|(t, n)| format!("{n} {:.1}us", t * 1e3 / reps))
                    .collect();
                // our 3 fastest cuts, whether or not cuBLASLt's answers fill the top
                let ours_top: Vec<String> = timed
                    .iter()
                    .filter(|(_, n)| !n.starts_with("lt#") && n != "cublasLt")
                    .take(3)
                    .map(|(t, n)| format!("{n} {:.1}us", t * 1e3 / reps))
                    .collect();
                println!(
                    "  {kname} k{k} n{n}: {} | {} | top: {} | ours: {} [default wg{} rt{} s{} st{}]",
                    line[0],
                    line[1],
                    top.join(", "),
                    ours_top.join(", "),
                    def.warpgroups,
                    def.row_tiles,
                    def.splits,
                    def.stages
                );
                best_total += best.0;
            }
            println!(
                "  all kinds: default skinny {ours:.3} ms vs cuBLASLt {theirs:.3} ms ({:.2}x); best of each kind {best_total:.3} ms ({:.2}x)",
                theirs / ours,
                theirs / best_total
            );
        }
    }
    Ok(())
}
