//! `--backend sim`: the plan replayed with the cost model, its summary, trace and timeline.

use std::io::Write;
use std::path::Path;

use rollplex_plan::Plan;

use super::{io_err, write_atomic, RunArgs};
use crate::exec::ExecError;

pub(super) fn run_sim(plan: &Plan, args: &RunArgs) -> Result<(), ExecError> {
    let gpu = &plan.spec.cluster.gpu;
    let profile = match &args.cost_profile {
        Some(p) => {
            let text = rollplex_plan::files::read_to_string(p, rollplex_plan::files::TEXT_CAP)
                .map_err(io_err(p))?;
            Some(
                rollplex_cost::Profile::from_yaml(&text)
                    .map_err(|e| ExecError::Data(format!("{}: {e}", p.display())))?,
            )
        }
        None if gpu.name.eq_ignore_ascii_case("h200") => Some(
            rollplex_cost::h200::shipped()
                .map_err(|e| ExecError::Plan(format!("built-in H200 profile: {e}")))?,
        ),
        None => None,
    };
    let cost = rollplex_cost::CostModel::for_cluster(&plan.spec.cluster, profile.as_ref());
    let report = crate::sim::simulate(plan, &cost).map_err(|e| ExecError::Plan(e.to_string()))?;
    let mut out = std::io::stdout().lock();
    report
        .print_summary(&mut out)
        .map_err(io_err(Path::new("stdout")))?;
    if let Some(t) = &args.trace {
        write_atomic(t, |w| report.write_chrome_trace(&mut WriteRef(w)))?;
        println!("trace: {}", t.display());
    }
    if let Some(s) = &args.svg {
        write_atomic(s, |w| report.write_svg(&mut WriteRef(w)))?;
        println!("timeline: {}", s.display());
    }
    Ok(())
}

/// Adapts `&mut dyn Write` to the `impl Write` the report writers take.
struct WriteRef<'a>(&'a mut dyn Write);
impl Write for WriteRef<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}
