//! Multi-process launch: `rollplex-run` as its own launcher on one node, or one rank of a job
//! started by torchrun/slurm-style launchers (the `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT` convention), and the rendezvous that forms the [`TcpComm`]
//! group (docs/tp.md, "Launch and rendezvous").
//!
//! What it knows: processes, environment variables, exit statuses, the rendezvous address. It
//! knows nothing of models; what a rank runs is the caller's.
//!
//! The launcher ([`launch`]) starts `ranks` children of the same executable with the same
//! arguments and the rank variables set, rank 0 first: rank 0 binds `MASTER_PORT` (port 0 when
//! the launcher was given none: the kernel picks a free one, and rank 0 reports it on stderr in
//! a line starting with [`LISTEN_PREFIX`], which the launcher reads before starting the others, so
//! no port is guessed). It forwards every child's output line by line prefixed `[rank K]`, and
//! polls their exit. When a child fails (a non-zero status or a signal) it gives the others up
//! to [`PEER_REPORT_GRACE`] to notice and say so themselves, kills those still running, and
//! returns [`LaunchError::RankFailed`] naming the rank; among several failures it names one that
//! did not exit with [`EXIT_PEER_FAILED`] (the status of a rank that only stopped because
//! another failed), waiting up to [`ROOT_CAUSE_GRACE`] for it. A child's stdin is a pipe from
//! the launcher: when the launcher dies, the children read end of file and exit
//! ([`watch_launcher`]), so no orphan rank lingers.
//!
//! Invariant: a rank never waits on another without a bound (the communicator's heartbeats and
//! time-outs), and the launcher never waits on a rank that has failed.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, ToSocketAddrs};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::comm::CommError;
use super::tcp::{TcpComm, TcpOptions};

/// The line rank 0 prints on stderr once it listens: this prefix, then `host:port`.
pub const LISTEN_PREFIX: &str = "rollplex-tp: rank 0 listening on ";
/// Set (to `1`) on the children of the launcher: their stdin is the launcher's pipe.
pub const ENV_LAUNCHED: &str = "ROLLPLEX_TP_LAUNCHED";
/// Exit status of a rank that stopped because another rank failed (not the root cause).
pub const EXIT_PEER_FAILED: u8 = 3;
/// How long the launcher waits for the root cause when the first failures it sees are ranks
/// that exited with [`EXIT_PEER_FAILED`].
pub const ROOT_CAUSE_GRACE: Duration = Duration::from_secs(2);
/// How long the other ranks may run after a rank failed, to see the failure (a closed
/// connection) and report it before they are killed.
pub const PEER_REPORT_GRACE: Duration = Duration::from_millis(500);

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The rank variables are missing, malformed or inconsistent.
    #[error("launch environment: {0}")]
    Env(String),
    /// Starting or watching a child failed.
    #[error("launcher: {0}")]
    Spawn(String),
    /// A rank failed: `how` is "exited with status 2" or "was killed by signal 9 (SIGKILL)".
    #[error("rank {rank} {how}; the other ranks were stopped")]
    RankFailed { rank: usize, how: String, code: u8 },
    #[error(transparent)]
    Comm(#[from] CommError),
}

impl LaunchError {
    /// The exit status the launcher's process should end with.
    pub fn exit_code(&self) -> u8 {
        match self {
            LaunchError::RankFailed { code, .. } => *code,
            _ => 1,
        }
    }
}

/// This process's place in a job, from the launcher variables.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankEnv {
    pub rank: usize,
    pub world: usize,
    /// Rank on this node (the GPU index on the CUDA path).
    pub local_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
}

impl RankEnv {
    /// From the process environment; `None` when `RANK` is not set (then `rollplex-run` is the
    /// launcher).
    pub fn from_env() -> Result<Option<RankEnv>, LaunchError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// As [`RankEnv::from_env`], reading variables through `get`. `WORLD_SIZE` is required with
    /// `RANK`; `LOCAL_RANK` defaults to `RANK`; `MASTER_ADDR` and `MASTER_PORT` are required
    /// when `WORLD_SIZE > 1`.
    pub fn from_lookup(
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<RankEnv>, LaunchError> {
        let Some(rank) = get("RANK") else {
            return Ok(None);
        };
        let num = |name: &str, v: &str| -> Result<usize, LaunchError> {
            v.trim()
                .parse()
                .map_err(|_| LaunchError::Env(format!("{name}={v:?} is not a whole number")))
        };
        let rank = num("RANK", &rank)?;
        let world = match get("WORLD_SIZE") {
            Some(w) => num("WORLD_SIZE", &w)?,
            None => return Err(LaunchError::Env(
                "RANK is set but WORLD_SIZE is not (set both, as torchrun and slurm wrappers do)"
                    .into(),
            )),
        };
        if world == 0 || rank >= world {
            return Err(LaunchError::Env(format!(
                "RANK={rank} is not a rank of WORLD_SIZE={world}"
            )));
        }
        let local_rank = match get("LOCAL_RANK") {
            Some(l) => num("LOCAL_RANK", &l)?,
            None => rank,
        };
        let need = |name: &str| -> Result<String, LaunchError> {
            match get(name) {
                Some(v) if !v.trim().is_empty() => Ok(v.trim().to_string()),
                _ if world == 1 => Ok(String::new()),
                _ => Err(LaunchError::Env(format!(
                    "{name} is not set: ranks of a job of {world} find rank 0 at MASTER_ADDR:MASTER_PORT"
                ))),
            }
        };
        let master_addr = match need("MASTER_ADDR")? {
            a if a.is_empty() => "127.0.0.1".to_string(),
            a => a,
        };
        let port = need("MASTER_PORT")?;
        let master_port = if port.is_empty() {
            0
        } else {
            port.parse().map_err(|_| {
                LaunchError::Env(format!("MASTER_PORT={port:?} is not a port number"))
            })?
        };
        Ok(Some(RankEnv {
            rank,
            world,
            local_rank,
            master_addr,
            master_port,
        }))
    }

    /// `MASTER_ADDR:MASTER_PORT` (an IPv6 address in brackets).
    pub fn master(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }
}

/// Joins the group as `env.rank`: rank 0 binds `MASTER_ADDR:MASTER_PORT`, prints
/// [`LISTEN_PREFIX`]`host:port` on stderr and serves (handing every rank `unique_id`); the others
/// connect. Every rank presents `job` (the plan's fingerprint): a rank of another plan is refused.
pub fn join(
    env: &RankEnv,
    job: &str,
    unique_id: Vec<u8>,
    opts: TcpOptions,
) -> Result<TcpComm, LaunchError> {
    if env.rank > 0 {
        return Ok(TcpComm::connect(
            &env.master(),
            env.rank,
            env.world,
            job,
            opts,
        )?);
    }
    let addr = env
        .master()
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| {
            LaunchError::Env(format!(
                "MASTER_ADDR={} does not resolve to an address of this host",
                env.master_addr
            ))
        })?;
    let listener = TcpListener::bind(addr).map_err(|e| {
        LaunchError::Env(format!(
            "rank 0 cannot listen on {addr} (MASTER_ADDR:MASTER_PORT): {e}"
        ))
    })?;
    let bound = listener
        .local_addr()
        .map_err(|e| LaunchError::Env(format!("listening socket: {e}")))?;
    let mut err = std::io::stderr().lock();
    let _ = writeln!(
        err,
        "{LISTEN_PREFIX}{bound} for {} more rank(s) (job {job})",
        env.world - 1
    );
    let _ = err.flush();
    drop(err);
    Ok(TcpComm::serve(listener, env.world, job, unique_id, opts)?)
}

/// In a child of the launcher (`ROLLPLEX_TP_LAUNCHED=1`): a thread that ends this process with
/// [`EXIT_PEER_FAILED`] when stdin (the launcher's pipe) reaches end of file, i.e. when the
/// launcher has died. Does nothing in a process not started by the launcher.
pub fn watch_launcher(rank: usize) {
    if std::env::var(ENV_LAUNCHED).ok().as_deref() != Some("1") {
        return;
    }
    let _ = std::thread::Builder::new()
        .name("tp-launcher-watch".into())
        .spawn(move || {
            let mut sink = [0u8; 64];
            let mut stdin = std::io::stdin();
            while let Ok(n) = stdin.read(&mut sink) {
                if n == 0 {
                    break;
                }
            }
            eprintln!("rank {rank}: the launcher is gone; exiting");
            std::process::exit(EXIT_PEER_FAILED as i32);
        });
}

/// What the launcher starts.
#[derive(Clone, Debug)]
pub struct Launch {
    /// The executable every rank runs (`std::env::current_exe()` for `rollplex-run`).
    pub exe: PathBuf,
    /// Its arguments (the launcher's own, unchanged).
    pub args: Vec<OsString>,
    /// Processes to start on this node.
    pub ranks: usize,
    /// Where rank 0 listens (default `127.0.0.1`).
    pub master_addr: String,
    /// The port rank 0 listens on; `None`: a free port rank 0 picks and reports.
    pub master_port: Option<u16>,
    /// How long rank 0 may take to report its port.
    pub startup_timeout: Duration,
}

impl Launch {
    /// Starts `ranks` copies of this process (same executable, same arguments), honouring
    /// `MASTER_ADDR`/`MASTER_PORT` when they are set.
    pub fn this_process(ranks: usize) -> Result<Launch, LaunchError> {
        let exe = std::env::current_exe()
            .map_err(|e| LaunchError::Spawn(format!("cannot find this executable: {e}")))?;
        let master_port = match std::env::var("MASTER_PORT") {
            Ok(p) => Some(p.trim().parse().map_err(|_| {
                LaunchError::Env(format!("MASTER_PORT={p:?} is not a port number"))
            })?),
            Err(_) => None,
        };
        Ok(Launch {
            exe,
            args: std::env::args_os().skip(1).collect(),
            ranks,
            master_addr: std::env::var("MASTER_ADDR").unwrap_or_else(|_| "127.0.0.1".into()),
            master_port,
            startup_timeout: Duration::from_secs(120),
        })
    }
}

/// "exited with status 2", "was killed by signal 9 (SIGKILL)".
pub fn describe(status: &ExitStatus) -> String {
    if let Some(c) = status.code() {
        return format!("exited with status {c}");
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(s) = status.signal() {
            let name = match s {
                1 => " (SIGHUP)",
                2 => " (SIGINT)",
                4 => " (SIGILL)",
                6 => " (SIGABRT)",
                7 => " (SIGBUS)",
                8 => " (SIGFPE)",
                9 => " (SIGKILL)",
                11 => " (SIGSEGV)",
                13 => " (SIGPIPE)",
                15 => " (SIGTERM)",
                _ => "",
            };
            return format!("was killed by signal {s}{name}");
        }
    }
    format!("ended: {status}")
}

struct Rank {
    rank: usize,
    child: Child,
    forwarders: Vec<std::thread::JoinHandle<()>>,
}

/// Copies `from` line by line to our stdout or stderr, prefixed with the rank; on rank 0's
/// stderr, also sends the address of the first listen line to `listen`.
fn forward(
    rank: usize,
    from: impl Read + Send + 'static,
    to_stderr: bool,
    listen: Option<mpsc::Sender<String>>,
) -> Result<std::thread::JoinHandle<()>, LaunchError> {
    std::thread::Builder::new()
        .name(format!("tp-forward-{rank}"))
        .spawn(move || {
            let mut r = BufReader::new(from);
            let mut line = Vec::new();
            let mut listen = listen;
            loop {
                line.clear();
                match r.read_until(b'\n', &mut line) {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
                let text = String::from_utf8_lossy(&line);
                let text = text.trim_end_matches(['\n', '\r']);
                if let Some(rest) = text.strip_prefix(LISTEN_PREFIX) {
                    if let Some(tx) = listen.take() {
                        let addr = rest.split_whitespace().next().unwrap_or("").to_string();
                        let _ = tx.send(addr);
                    }
                }
                let out = format!("[rank {rank}] {text}\n");
                if to_stderr {
                    let _ = std::io::stderr().lock().write_all(out.as_bytes());
                } else {
                    let _ = std::io::stdout().lock().write_all(out.as_bytes());
                }
            }
        })
        .map_err(|e| LaunchError::Spawn(format!("cannot start an output thread: {e}")))
}

fn spawn(
    l: &Launch,
    rank: usize,
    port: u16,
    listen: Option<mpsc::Sender<String>>,
) -> Result<Rank, LaunchError> {
    let mut child = Command::new(&l.exe)
        .args(&l.args)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", l.ranks.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("LOCAL_WORLD_SIZE", l.ranks.to_string())
        .env("MASTER_ADDR", &l.master_addr)
        .env("MASTER_PORT", port.to_string())
        .env(ENV_LAUNCHED, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            LaunchError::Spawn(format!("starting rank {rank} ({}): {e}", l.exe.display()))
        })?;
    eprintln!(
        "rollplex-run: rank {rank} of {} started, pid {}",
        l.ranks,
        child.id()
    );
    let mut forwarders = Vec::new();
    if let Some(o) = child.stdout.take() {
        forwarders.push(forward(rank, o, false, None)?);
    }
    if let Some(e) = child.stderr.take() {
        forwarders.push(forward(rank, e, true, listen)?);
    }
    Ok(Rank {
        rank,
        child,
        forwarders,
    })
}

/// Waits up to `grace` for every rank still running to exit by itself.
fn wait_for_exits(ranks: &mut [Rank], grace: Duration) {
    let t0 = Instant::now();
    while t0.elapsed() < grace
        && ranks
            .iter_mut()
            .any(|r| matches!(r.child.try_wait(), Ok(None)))
    {
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Kills every rank still running, waits for all, and drains their output.
fn stop_all(ranks: &mut [Rank]) {
    for r in ranks.iter_mut() {
        if let Ok(None) = r.child.try_wait() {
            let _ = r.child.kill();
        }
    }
    for r in ranks.iter_mut() {
        let _ = r.child.wait();
        for f in r.forwarders.drain(..) {
            let _ = f.join();
        }
    }
}

fn failed(rank: usize, status: &ExitStatus) -> LaunchError {
    LaunchError::RankFailed {
        rank,
        how: describe(status),
        code: status.code().map(|c| c.clamp(1, 255) as u8).unwrap_or(1),
    }
}

/// Runs the job on this node: starts the ranks, forwards their output and returns when all have
/// exited successfully, or, as soon as one fails, stops the others and names it.
pub fn launch(l: &Launch) -> Result<(), LaunchError> {
    if l.ranks == 0 {
        return Err(LaunchError::Spawn("a job needs at least one rank".into()));
    }
    let mut ranks: Vec<Rank> = Vec::with_capacity(l.ranks);
    let (tx, rx) = mpsc::channel();
    ranks.push(spawn(l, 0, l.master_port.unwrap_or(0), Some(tx))?);
    let port = match l.master_port {
        Some(p) => p,
        None => {
            // rank 0 reports the port it bound; meanwhile it may also fail
            let t0 = Instant::now();
            loop {
                match rx.recv_timeout(Duration::from_millis(20)) {
                    Ok(addr) => match addr.rsplit(':').next().and_then(|p| p.parse::<u16>().ok()) {
                        Some(p) => break p,
                        None => {
                            stop_all(&mut ranks);
                            return Err(LaunchError::Spawn(format!(
                                "rank 0 reported an address without a port: {addr:?}"
                            )));
                        }
                    },
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => {}
                }
                if let Ok(Some(st)) = ranks[0].child.try_wait() {
                    stop_all(&mut ranks);
                    return if st.success() {
                        // rank 0 ended before listening: it had nothing to run as a group
                        Err(LaunchError::Spawn(
                            "rank 0 exited before opening the rendezvous".into(),
                        ))
                    } else {
                        Err(failed(0, &st))
                    };
                }
                if t0.elapsed() > l.startup_timeout {
                    stop_all(&mut ranks);
                    return Err(LaunchError::Spawn(format!(
                        "rank 0 did not open the rendezvous within {:?}",
                        l.startup_timeout
                    )));
                }
            }
        }
    };
    for rank in 1..l.ranks {
        match spawn(l, rank, port, None) {
            Ok(r) => ranks.push(r),
            Err(e) => {
                stop_all(&mut ranks);
                return Err(e);
            }
        }
    }
    supervise(ranks)
}

/// Polls the ranks until all succeed or one fails (see the module doc for which one is named).
fn supervise(mut ranks: Vec<Rank>) -> Result<(), LaunchError> {
    let mut first_peer_failure: Option<(Instant, usize, ExitStatus)> = None;
    loop {
        let (mut done, mut exited) = (0, 0);
        let mut root: Option<(usize, ExitStatus)> = None;
        for r in ranks.iter_mut() {
            match r.child.try_wait() {
                Ok(Some(st)) if st.success() => {
                    done += 1;
                    exited += 1;
                }
                Ok(Some(st)) => {
                    exited += 1;
                    if st.code() == Some(EXIT_PEER_FAILED as i32) {
                        if first_peer_failure.is_none() {
                            first_peer_failure = Some((Instant::now(), r.rank, st));
                        }
                    } else if root.is_none() {
                        root = Some((r.rank, st));
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    let rank = r.rank;
                    stop_all(&mut ranks);
                    return Err(LaunchError::Spawn(format!("waiting for rank {rank}: {e}")));
                }
            }
        }
        if let Some((rank, st)) = root {
            wait_for_exits(&mut ranks, PEER_REPORT_GRACE);
            stop_all(&mut ranks);
            return Err(failed(rank, &st));
        }
        if let Some((since, rank, st)) = first_peer_failure {
            if since.elapsed() >= ROOT_CAUSE_GRACE || exited == ranks.len() {
                stop_all(&mut ranks);
                return Err(failed(rank, &st));
            }
        }
        if done == ranks.len() {
            stop_all(&mut ranks);
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(vars: &[(&str, &str)]) -> Result<Option<RankEnv>, LaunchError> {
        RankEnv::from_lookup(|k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn rank_variables_follow_the_torchrun_convention() {
        assert_eq!(env_of(&[]).unwrap(), None);
        let e = env_of(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((e.rank, e.world, e.local_rank), (3, 8, 1));
        assert_eq!(e.master(), "node0:29500");
        // one rank needs no rendezvous address; LOCAL_RANK defaults to RANK
        let e = env_of(&[("RANK", "0"), ("WORLD_SIZE", "1")])
            .unwrap()
            .unwrap();
        assert_eq!((e.local_rank, e.master_port), (0, 0));
        let v6 = env_of(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "::1"),
            ("MASTER_PORT", "7"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(v6.master(), "[::1]:7");
    }

    #[test]
    fn bad_rank_variables_name_the_variable() {
        let msg = |v: &[(&str, &str)]| env_of(v).unwrap_err().to_string();
        assert!(msg(&[("RANK", "0")]).contains("WORLD_SIZE is not"));
        assert!(msg(&[("RANK", "x"), ("WORLD_SIZE", "2")]).contains("RANK=\"x\""));
        assert!(msg(&[("RANK", "2"), ("WORLD_SIZE", "2")])
            .contains("RANK=2 is not a rank of WORLD_SIZE=2"));
        assert!(
            msg(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")])
                .contains("MASTER_ADDR is not set")
        );
        assert!(msg(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "99999")
        ])
        .contains("MASTER_PORT=\"99999\""));
    }

    #[cfg(unix)]
    #[test]
    fn exit_statuses_are_described() {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            describe(&ExitStatus::from_raw(2 << 8)),
            "exited with status 2"
        );
        assert_eq!(
            describe(&ExitStatus::from_raw(9)),
            "was killed by signal 9 (SIGKILL)"
        );
    }
}
