//! The rendezvous of a [`TcpComm`] group: rank 0 serves, every other rank connects; hellos are
//! checked, the unique id handed out, and the group's sockets assembled (see the parent
//! module's doc).

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::links::{prepare, spawn_heartbeat, spawn_reader, Event, Link};
use super::wire::{kind, rdv, read_frame, write_frame, Get, Put, MAGIC};
use super::{State, TcpComm, TcpOptions};
use crate::tp::comm::CommError;

/// How long rank 0 waits for the hello of a connection it accepted.
const HELLO_WAIT: Duration = Duration::from_secs(5);

impl TcpComm {
    /// Rank 0 of a group of `world` processes: accepts the other ranks on `listener` (bound by
    /// the caller, possibly to port 0), checks their hellos against `job` and `world`, and sends
    /// everyone `unique_id`. A connection whose hello is not of this group (another job or
    /// world size, a rank out of range or already joined) is refused with a warning and the
    /// wait goes on. Fails, naming the missing ranks and the refused connections, when some
    /// ranks do not connect within `connect_timeout`.
    pub fn serve(
        listener: TcpListener,
        world: usize,
        job: &str,
        unique_id: Vec<u8>,
        opts: TcpOptions,
    ) -> Result<TcpComm, CommError> {
        if world == 0 {
            return Err(CommError::Invalid(
                "a communicator needs at least one rank".into(),
            ));
        }
        let addr = listener
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "?".into());
        listener
            .set_nonblocking(true)
            .map_err(|e| rdv(format!("listening on {addr}: {e}")))?;
        let started = Instant::now();
        let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        // why each connection with a well-formed hello that is not of this group was dropped:
        // named again if the group does not form, since one may be a real rank misconfigured
        let mut refused: Vec<String> = Vec::new();
        let reject_all = |streams: &mut Vec<Option<TcpStream>>, why: &str| {
            for s in streams.iter_mut().flatten() {
                let _ = write_frame(s, kind::REJECT, why.as_bytes());
            }
        };
        while streams[1..].iter().any(Option::is_none) {
            match listener.accept() {
                Ok((mut s, from)) => {
                    // a rank sends its hello as soon as it connects: a connection that stays
                    // silent (a port scan) may hold the accept loop for HELLO_WAIT at most
                    let hello_wait = HELLO_WAIT
                        .min(opts.connect_timeout.saturating_sub(started.elapsed()))
                        .max(Duration::from_millis(1));
                    if prepare(&s, &opts)
                        .and_then(|_| s.set_read_timeout(Some(hello_wait)))
                        .is_err()
                    {
                        continue;
                    }
                    // something that does not speak the protocol is ignored
                    let Ok((kind::HELLO, p)) = read_frame(&mut s) else {
                        continue;
                    };
                    let mut g = Get(&p);
                    let magic_ok = g.take(MAGIC.len()).map(|m| m == MAGIC).unwrap_or(false);
                    let (rank, their_world, their_job) = match (g.u32(), g.u32(), g.str()) {
                        (Ok(r), Ok(w), Ok(j)) if magic_ok => (r, w, j),
                        _ => {
                            let _ = write_frame(&mut s, kind::REJECT, b"not a rollplex hello");
                            continue;
                        }
                    };
                    let bad = if their_world != world {
                        Some(format!(
                            "rank {rank} (from {from}) was started with world size {their_world}, rank 0 with {world}"
                        ))
                    } else if their_job != job {
                        Some(format!(
                            "rank {rank} (from {from}) belongs to job {their_job:?}, rank 0 to {job:?} (another plan or another run)"
                        ))
                    } else if rank == 0 || rank >= world {
                        Some(format!(
                            "a process from {from} says it is rank {rank}; ranks joining rank 0 are 1..{}",
                            world - 1
                        ))
                    } else if streams[rank].is_some() {
                        Some(format!(
                            "two processes say they are rank {rank} (the second from {from})"
                        ))
                    } else {
                        None
                    };
                    if let Some(why) = bad {
                        // a stranger (another job on the same port, a stale or misconfigured
                        // process) is told why and dropped; the real ranks may still come, so
                        // the group waits for them until connect_timeout as before
                        let _ = write_frame(&mut s, kind::REJECT, why.as_bytes());
                        eprintln!("warning: rendezvous at {addr}: dropped a connection: {why}");
                        refused.push(why);
                        continue;
                    }
                    streams[rank] = Some(s);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if started.elapsed() >= opts.connect_timeout {
                        let missing: Vec<usize> =
                            (1..world).filter(|&r| streams[r].is_none()).collect();
                        let mut why = format!(
                            "ranks {missing:?} of {world} did not connect to rank 0 at {addr} within {:?}",
                            opts.connect_timeout
                        );
                        if !refused.is_empty() {
                            why +=
                                &format!("; connections refused meanwhile: {}", refused.join("; "));
                        }
                        reject_all(&mut streams, &why);
                        return Err(rdv(why));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(rdv(format!("accepting on {addr}: {e}"))),
            }
        }
        let welcome = Put::default().u32(world).bytes(&unique_id).0;
        let mut links = Vec::with_capacity(world.saturating_sub(1));
        let (tx, rx) = mpsc::channel();
        for (rank, s) in streams.into_iter().enumerate().skip(1) {
            let mut s = s.expect("every rank connected (loop condition)");
            write_frame(&mut s, kind::WELCOME, &welcome)
                .map_err(|e| rdv(format!("welcoming rank {rank}: {e}")))?;
            let rs = s
                .try_clone()
                .map_err(|e| rdv(format!("socket to rank {rank}: {e}")))?;
            spawn_reader(rank, rs, opts.dead_after, tx.clone())?;
            links.push(Link {
                peer: rank,
                w: Arc::new(Mutex::new(s)),
            });
        }
        Self::assemble(0, world, job, unique_id, links, rx, opts)
    }

    /// Rank `rank > 0` of a group of `world`: connects to rank 0 at `addr` (`host:port`),
    /// retrying until `connect_timeout`, and returns once rank 0 has welcomed every rank.
    pub fn connect(
        addr: &str,
        rank: usize,
        world: usize,
        job: &str,
        opts: TcpOptions,
    ) -> Result<TcpComm, CommError> {
        if rank == 0 || rank >= world {
            return Err(CommError::Invalid(format!(
                "TcpComm::connect is for ranks 1..{world}; rank {rank} (rank 0 serves)"
            )));
        }
        let started = Instant::now();
        let mut s = loop {
            let left = opts.connect_timeout.saturating_sub(started.elapsed());
            let attempt = addr
                .to_socket_addrs()
                .and_then(|mut a| {
                    a.next().ok_or_else(|| {
                        io::Error::new(io::ErrorKind::NotFound, "the name resolves to no address")
                    })
                })
                .and_then(|a: SocketAddr| {
                    TcpStream::connect_timeout(
                        &a,
                        left.clamp(Duration::from_millis(1), Duration::from_secs(5)),
                    )
                });
            match attempt {
                Ok(s) => break s,
                Err(e) if started.elapsed() >= opts.connect_timeout => {
                    return Err(rdv(format!(
                        "rank {rank} could not reach rank 0 at {addr} within {:?}: {e} (check MASTER_ADDR and MASTER_PORT, and that rank 0 runs)",
                        opts.connect_timeout
                    )))
                }
                // rank 0 may not listen yet
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        prepare(&s, &opts).map_err(|e| rdv(format!("socket to rank 0 at {addr}: {e}")))?;
        // rank 0 answers once every rank has said hello, or rejects the group when its own
        // connect_timeout (counted from before this rank connected) runs out: wait for that
        // plus dead_after, so that a rejection naming the missing ranks is not lost to a race
        // with the same deadline on this side
        let answer_wait = opts.connect_timeout + opts.dead_after;
        s.set_read_timeout(Some(answer_wait))
            .map_err(|e| rdv(format!("socket to rank 0 at {addr}: {e}")))?;
        let hello = Put::default().raw(MAGIC).u32(rank).u32(world).str(job).0;
        write_frame(&mut s, kind::HELLO, &hello).map_err(|e| {
            rdv(format!(
                "rank {rank}: sending hello to rank 0 at {addr}: {e}"
            ))
        })?;
        let unique_id = match read_frame(&mut s) {
            Ok((kind::WELCOME, p)) => {
                let mut g = Get(&p);
                let w = g.u32()?;
                if w != world {
                    return Err(rdv(format!(
                        "rank 0 welcomed rank {rank} into a world of {w}, expected {world}"
                    )));
                }
                g.bytes()?.to_vec()
            }
            Ok((kind::REJECT, p)) => {
                return Err(rdv(format!(
                    "rank 0 at {addr} refused the group: {}",
                    String::from_utf8_lossy(&p)
                )))
            }
            Ok((k, _)) => {
                return Err(rdv(format!(
                    "rank 0 at {addr} answered the hello of rank {rank} with frame kind {k}"
                )))
            }
            Err(e) => {
                return Err(rdv(format!(
                    "rank {rank}: no welcome from rank 0 at {addr} ({e}) within {answer_wait:?}"
                )))
            }
        };
        let (tx, rx) = mpsc::channel();
        let rs = s
            .try_clone()
            .map_err(|e| rdv(format!("socket to rank 0: {e}")))?;
        spawn_reader(0, rs, opts.dead_after, tx)?;
        let links = vec![Link {
            peer: 0,
            w: Arc::new(Mutex::new(s)),
        }];
        Self::assemble(rank, world, job, unique_id, links, rx, opts)
    }

    fn assemble(
        rank: usize,
        world: usize,
        job: &str,
        unique_id: Vec<u8>,
        links: Vec<Link>,
        rx: Receiver<(usize, Event)>,
        opts: TcpOptions,
    ) -> Result<TcpComm, CommError> {
        let heartbeat_stop = if links.is_empty() {
            None
        } else {
            Some(spawn_heartbeat(
                links.iter().map(|l| Arc::clone(&l.w)).collect(),
                opts.heartbeat,
            )?)
        };
        Ok(TcpComm {
            rank,
            world,
            job: job.to_string(),
            unique_id,
            links,
            st: Mutex::new(State {
                seq: 0,
                rx,
                failed: None,
                exited: vec![false; world],
                closed: vec![false; world],
            }),
            aborted: Mutex::new(None),
            opts,
            heartbeat_stop,
        })
    }
}
