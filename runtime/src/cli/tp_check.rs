//! `rollplex-run PLAN --tp-check[=ROUNDS]`: the launcher of the group check, or one rank of it
//! (`tp::check` is the check itself).

use std::path::Path;
use std::process::ExitCode;

use crate::model::philox::philox4x32_10;
use crate::tp::check::run_check;
use crate::tp::launch::{self, RankEnv};
use crate::tp::{CommError, Communicator, TcpOptions, TpError};

/// `rollplex-run PLAN --tp-check[=ROUNDS]`: without `RANK` in the environment, launches one
/// process per GPU of the plan on this node ([`launch::launch`]); as a rank (`RANK`,
/// `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` set, by the launcher or by torchrun/slurm), joins
/// the group, builds the job's actor and runs [`run_check`]. Returns the process's exit status:
/// 0 ok, 1 this rank's error, [`launch::EXIT_PEER_FAILED`] when another rank failed, a failed
/// rank's status for the launcher.
pub(super) fn main(plan_path: &Path, rounds: u32) -> ExitCode {
    let env = match RankEnv::from_env() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(1);
        }
    };
    let plan = match super::load_plan(plan_path) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(1);
        }
    };
    let world = plan.target.count as usize;
    let params = plan.spec.actor.param_count().total();
    if params > CPU_PARAM_LIMIT {
        eprintln!(
            "error: --tp-check runs the actor on the CPU; this one has {:.2} B parameters (at most {} M)",
            params as f64 / 1e9,
            CPU_PARAM_LIMIT / 1_000_000
        );
        return ExitCode::from(1);
    }
    let Some(env) = env else {
        // the launcher: one process per GPU of the plan, on this node
        let l = match launch::Launch::this_process(world) {
            Ok(l) => l,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(1);
            }
        };
        return match launch::launch(&l) {
            Ok(()) => {
                println!("rollplex-run: tp-check passed on {world} ranks");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(e.exit_code())
            }
        };
    };
    launch::watch_launcher(env.rank);
    if env.world != world {
        eprintln!(
            "error: WORLD_SIZE={} but the plan runs on {world} GPUs (one rank per GPU)",
            env.world
        );
        return ExitCode::from(1);
    }
    let job = match crate::exec::checkpoint::plan_hash(&plan) {
        Ok(h) => format!("plan-{h}"),
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(1);
        }
    };
    // rank 0's blob: what ncclGetUniqueId returns on the CUDA path; here 128 bytes of this
    // process's identity, so the check sees the blob reach every rank
    let unique_id: Vec<u8> = (0..32u32)
        .flat_map(|i| {
            philox4x32_10(
                [i, std::process::id(), 0, 0x4E43_4349],
                [env.master_port as u32, 0],
            )[0]
            .to_le_bytes()
        })
        .collect();
    // a round takes milliseconds: a rank alive (heartbeats) but absent from a collective for
    // minutes is stuck, and the group ends naming it
    let opts = TcpOptions {
        collective_timeout: Some(std::time::Duration::from_secs(300)),
        ..Default::default()
    };
    let comm = match launch::join(&env, &job, unique_id, opts) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: rank {}: {e}", env.rank);
            return ExitCode::from(e.exit_code());
        }
    };
    eprintln!(
        "rollplex-tp: rank {} joined the group of {} (local rank {})",
        env.rank, env.world, env.local_rank
    );
    // (message, whether it reports another rank's failure)
    let checked = match crate::exec::host_actor(&plan.spec) {
        Ok(actor) => run_check(&comm, &plan.spec, &actor, comm.unique_id(), rounds)
            .map_err(|e| (e.to_string(), blames_another(&e, env.rank))),
        Err(e) => Err((e.to_string(), false)),
    };
    match checked {
        Ok(r) => {
            if r.rank == 0 {
                println!(
                    "tp-check: {} ranks over TCP (job {job}): ranks agree bitwise (tokens {:?}, logits hash {:016x}); \
                     max |logit - TP=1| {:.3e}, greedy tokens {} TP=1; {} rounds in {:.3} s ({} collectives per round)",
                    r.world,
                    r.tokens,
                    r.logits_hash,
                    r.max_err_vs_tp1.unwrap_or(f32::NAN),
                    if r.tokens_equal_tp1 == Some(true) { "equal" } else { "differ from" },
                    r.rounds,
                    r.seconds,
                    r.collectives_per_round
                );
            } else {
                println!("tp-check: rank {} agrees", r.rank);
            }
            ExitCode::SUCCESS
        }
        Err((e, peer)) => {
            comm.abort(&e);
            eprintln!("error: rank {}: {e}", env.rank);
            ExitCode::from(if peer { launch::EXIT_PEER_FAILED } else { 1 })
        }
    }
}

/// The CPU check's model size limit (as the CPU backend's).
const CPU_PARAM_LIMIT: u64 = 200_000_000;

/// Whether `e` reports another rank's failure (this rank only stopped because of it).
fn blames_another(e: &TpError, me: usize) -> bool {
    match e {
        TpError::Comm(CommError::PeerFailed { rank, .. })
        | TpError::Comm(CommError::PeerExited { rank, .. }) => *rank != me,
        TpError::Comm(CommError::Timeout { missing, .. }) => !missing.contains(&me),
        _ => false,
    }
}
