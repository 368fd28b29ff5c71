//! The roofline `rollplexc --stats` prints, on every shipped pipeline: no plan is predicted to
//! run faster than its work allows at the machine's ceilings, and the floors add up.
mod common;

use std::path::Path;

use rollplex_plan::roofline::{roofline, Ceilings};

struct Dir<'a>(&'a Path);

impl rollplex_dsl::Env for Dir<'_> {
    fn read_file(&self, path: &str) -> Result<String, String> {
        std::fs::read_to_string(self.0.join(path)).map_err(|e| e.to_string())
    }
}

#[test]
fn no_shipped_plan_is_predicted_below_its_roofline() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut seen = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let path = e.unwrap().path();
        if path.extension().is_none_or(|x| x != "rpx") {
            continue;
        }
        let name = path.display().to_string();
        let src = std::fs::read_to_string(&path).unwrap();
        let checked = rollplex_dsl::compile_source(&name, &src, &Dir(&dir))
            .unwrap_or_else(|d| panic!("{}", d.render(&name, &src, false)));
        let plan = rollplex_compiler::compile(&checked.spec, &Default::default())
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .plan;
        let r = roofline(&plan);
        let sum: f64 = r.phases.iter().map(|(_, p)| p.seconds).sum();
        assert!(
            (sum - r.serial_s).abs() <= 1e-9 * sum.max(1.0),
            "{name}: phases add up"
        );
        assert!(
            r.overlapped_s > 0.0 && r.overlapped_s <= r.serial_s * (1.0 + 1e-12),
            "{name}"
        );
        assert!(
            plan.predicted.iteration_s >= r.overlapped_s,
            "{name}: predicted {:.4} s below the overlapped roofline {:.4} s",
            plan.predicted.iteration_s,
            r.overlapped_s
        );
        // every task's floor is at least each of its terms
        let c = Ceilings::of(&plan.spec.cluster.gpu, plan.spec.cluster.intra_node_bw);
        for t in &plan.tasks {
            let f = c.floor(&t.work);
            assert!(f >= t.work.total_flops() / c.flops && f >= t.work.total_bytes() / c.bytes);
        }
        seen += 1;
    }
    assert!(seen >= 3, "found {seen} pipelines in examples/");
}
