//! [`TcpComm`]: the [`Communicator`] between processes, over TCP, for ranks that do not share an
//! address space (one process per GPU; `tp::launch` starts them or joins a torchrun/slurm job).
//!
//! What this module knows: sockets, the rendezvous and the wire format of the collectives. It
//! knows nothing of models or plans; the job fingerprint and the unique-id blob are opaque.
//!
//! **Topology.** A star: rank 0 listens on `MASTER_ADDR:MASTER_PORT`, every other rank connects
//! to it. A collective is one round trip: each rank `r > 0` sends its buffer to rank 0 (a
//! *deposit*), rank 0 combines the `world` buffers exactly as [`super::ThreadComm`] does (the
//! same function, [`super::comm::reduce_in_rank_order`]: `((b0 + b1) + b2) + ...`) and sends the
//! result back to every rank. So results are bitwise those of the thread communicator, and every
//! rank receives the same bits. The bytes through rank 0 grow with the world size; that is fine
//! for the CPU backend's small models (the NCCL path moves the heavy traffic on GPUs).
//!
//! **Rendezvous** (documented for users in `docs/tp.md`). Rank `r > 0` connects (retrying until
//! `connect_timeout`: rank 0 may start later) and sends `HELLO {magic, rank, world, job}`;
//! rank 0 accepts until every rank has said hello, checks each (same world size, same job
//! fingerprint, rank in range, no duplicate) and answers all of them `WELCOME {world,
//! unique_id}`. A connection whose hello fails a check gets `REJECT {reason}` alone and is
//! dropped with a warning: one stranger on the port (another job, a stale process) must not
//! abort the group, whose real ranks may still come. When the ranks are not all there by
//! `connect_timeout`, every connected rank gets `REJECT` naming the missing ranks and the
//! refused connections, and the rendezvous fails on every rank with that reason. `unique_id` is an opaque blob chosen by rank 0: the NCCL
//! unique id (`ncclGetUniqueId`, 128 bytes) for the CUDA path, so the TCP group is also how NCCL
//! ranks find each other.
//!
//! **Liveness.** Every socket carries a heartbeat frame every `heartbeat`; a reader thread per
//! socket turns frames into events, and end of stream, a reset, or `dead_after` without a single
//! byte into "rank K's connection dropped". A process that is killed closes its sockets, so its
//! peers learn it at once; a frozen or unreachable one is declared dead after `dead_after`.
//! Rank 0 forwards every failure to the other ranks as a `FAIL` frame carrying the
//! [`CommError`], so every rank reports the same root cause, naming the rank. Writes have the
//! same time-out, so a peer that stops reading cannot block a writer either. An optional
//! `collective_timeout` bounds how long rank 0 waits for ranks that are alive but never arrive
//! ([`CommError::Timeout`] naming them).
//!
//! **Wire format.** Frames: `u64 length (LE) | u8 kind | payload`; integers little-endian;
//! strings `u32 length | UTF-8`; buffers the elements' little-endian bytes ([`Elem::put_le`],
//! bit-exact). A normal end sends `BYE`; a rank that waits for one that said goodbye gets
//! [`CommError::PeerExited`]. On drop a rank sends `BYE` (or `FAIL` when panicking), closes its
//! sending side and waits briefly for its peers to close theirs, so that no unread byte makes
//! the kernel reset a connection whose last result a peer has not read yet.
//!
//! Invariants: collectives of one rank are issued by one thread at a time (the state lock is
//! held for a whole collective); rank 0 handles exactly one collective at a time, and a rank
//! `r > 0` sends the deposit of collective `s + 1` only after the result of `s`, so the only
//! frames rank 0 can receive in collective `s` are deposits of `s`, failures and goodbyes.

use std::net::{Shutdown, TcpListener};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::comm::{reduce_in_rank_order, CommError, Communicator, Elem, ReduceOp};

mod links;
mod rendezvous;
mod wire;

use links::{Event, Link};
use wire::{
    decode, decode_error, decode_into, encode, encode_error, kind, protocol, rdv, Get, Put,
};

/// How long a dropped rank waits for its peers to close their side (see the module doc).
const LINGER: Duration = Duration::from_secs(2);

/// How rank 0 turns every rank's bytes (in rank order) into the collective's result.
type Combine<'a> = dyn Fn(&[Vec<u8>]) -> Result<Vec<u8>, CommError> + 'a;

/// Time limits of a TCP group.
#[derive(Clone, Debug)]
pub struct TcpOptions {
    /// How long rank 0 waits for every rank to connect, and a rank for rank 0 to answer.
    pub connect_timeout: Duration,
    /// Interval of the heartbeat frames every rank sends on every socket.
    pub heartbeat: Duration,
    /// A connection that carries no byte (not even a heartbeat) for this long is dead; also the
    /// time-out of every write.
    pub dead_after: Duration,
    /// How long rank 0 waits in one collective for live ranks that do not arrive (None: no limit;
    /// dead ranks end the wait regardless). Ranks `r > 0` wait twice as long plus `dead_after`
    /// for rank 0's answer.
    pub collective_timeout: Option<Duration>,
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            connect_timeout: Duration::from_secs(120),
            heartbeat: Duration::from_secs(1),
            dead_after: Duration::from_secs(20),
            collective_timeout: None,
        }
    }
}

struct State {
    /// Number of the next collective (the same on every rank).
    seq: u64,
    /// Events of every link: `(peer rank, event)`.
    rx: Receiver<(usize, Event)>,
    /// The error that ended the group; every later collective returns it.
    failed: Option<CommError>,
    /// Peers that said goodbye (indexed by rank).
    exited: Vec<bool>,
    /// Peers whose connection has ended (indexed by rank).
    closed: Vec<bool>,
}

/// One rank's handle on a group of processes connected over TCP (see the module doc).
pub struct TcpComm {
    rank: usize,
    world: usize,
    job: String,
    unique_id: Vec<u8>,
    /// Rank 0: one link per other rank, in rank order; rank `r > 0`: the link to rank 0.
    links: Vec<Link>,
    st: Mutex<State>,
    /// Set by [`Communicator::abort`] (kept apart from `st`, which a collective holds).
    aborted: Mutex<Option<CommError>>,
    opts: TcpOptions,
    /// Dropping it stops the heartbeat thread.
    heartbeat_stop: Option<Sender<()>>,
}

impl std::fmt::Debug for TcpComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TcpComm(rank {} of {}, job {})",
            self.rank, self.world, self.job
        )
    }
}

impl TcpComm {
    /// The blob rank 0 handed out at the rendezvous (the NCCL unique id on the CUDA path).
    pub fn unique_id(&self) -> &[u8] {
        &self.unique_id
    }

    /// The job fingerprint every rank presented.
    pub fn job(&self) -> &str {
        &self.job
    }

    /// Cuts this rank's connections without a goodbye, as the death of its process does (for
    /// tests of what the peers see).
    #[cfg(test)]
    pub(crate) fn sever(&self) {
        *self.aborted.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(CommError::Invalid("severed".into()));
        for l in &self.links {
            let _ =
                l.w.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .shutdown(Shutdown::Both);
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Tells the other ranks (rank 0: all; others: rank 0, which forwards) that the group
    /// failed with `err`, except `culprit`, and returns `err`.
    fn fail_all(&self, err: CommError, culprit: Option<usize>) -> CommError {
        let p = encode_error(&err);
        for l in self.links.iter().filter(|l| Some(l.peer) != culprit) {
            let _ = l.send(kind::FAIL, &p);
        }
        err
    }

    /// One collective: deposits `mine` under signature `sig`; rank 0 `combine`s every rank's
    /// bytes (in rank order) and everyone gets the combined bytes.
    fn exchange(
        &self,
        sig: String,
        mine: Vec<u8>,
        combine: &Combine<'_>,
    ) -> Result<Vec<u8>, CommError> {
        let started = Instant::now();
        let mut st = self.lock();
        if let Some(e) = self
            .aborted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
        {
            return Err(e);
        }
        if let Some(e) = &st.failed {
            return Err(e.clone());
        }
        let seq = st.seq;
        let res = if self.rank == 0 {
            self.root_exchange(&mut st, seq, &sig, mine, combine, started)
        } else {
            self.leaf_exchange(&mut st, seq, &sig, mine, started)
        };
        match &res {
            Ok(_) => st.seq += 1,
            Err(e) => st.failed = Some(e.clone()),
        }
        res
    }

    fn root_exchange(
        &self,
        st: &mut State,
        seq: u64,
        sig: &str,
        mine: Vec<u8>,
        combine: &Combine<'_>,
        started: Instant,
    ) -> Result<Vec<u8>, CommError> {
        let w = self.world;
        let mut parts: Vec<Option<Vec<u8>>> = vec![None; w];
        parts[0] = Some(mine);
        loop {
            let missing: Vec<usize> = (1..w).filter(|&r| parts[r].is_none()).collect();
            if missing.is_empty() {
                break;
            }
            if let Some(&r) = missing.iter().find(|&&r| st.exited[r]) {
                let e = CommError::PeerExited {
                    rank: r,
                    seq,
                    op: sig.to_string(),
                };
                return Err(self.fail_all(e, Some(r)));
            }
            let wait = match self.opts.collective_timeout {
                Some(t) => {
                    let left = t.saturating_sub(started.elapsed());
                    if left.is_zero() {
                        let e = CommError::Timeout {
                            seq,
                            op: sig.to_string(),
                            missing,
                            timeout: t,
                        };
                        return Err(self.fail_all(e, None));
                    }
                    left
                }
                None => Duration::from_secs(3600),
            };
            let (r, ev) = match st.rx.recv_timeout(wait) {
                Ok(x) => x,
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(CommError::Invalid(
                        "internal: every reader thread of rank 0 is gone".into(),
                    ))
                }
            };
            match ev {
                Event::Frame(kind::DEPOSIT, p) => {
                    let mut g = Get(&p);
                    let (s, their_sig) = (g.u64()?, g.str()?);
                    if s != seq {
                        let e = protocol(format!(
                            "rank {r} sent a buffer for collective #{s} during #{seq}"
                        ));
                        return Err(self.fail_all(e, None));
                    }
                    if their_sig != sig {
                        let e = CommError::Mismatch {
                            seq,
                            rank_a: 0,
                            a: sig.to_string(),
                            rank_b: r,
                            b: their_sig,
                        };
                        return Err(self.fail_all(e, None));
                    }
                    parts[r] = Some(g.rest().to_vec());
                }
                Event::Frame(kind::FAIL, p) => {
                    let e = decode_error(&p)?;
                    return Err(self.fail_all(e, Some(r)));
                }
                Event::Frame(kind::BYE, _) => st.exited[r] = true,
                Event::Frame(k, _) => {
                    let e = protocol(format!("rank {r} sent frame kind {k} in a collective"));
                    return Err(self.fail_all(e, None));
                }
                Event::Closed(_) if st.exited[r] => st.closed[r] = true,
                Event::Closed(why) => {
                    st.closed[r] = true;
                    let e = CommError::PeerFailed {
                        rank: r,
                        reason: format!(
                            "{why} without a goodbye (the process died, was killed, or its host is unreachable)"
                        ),
                    };
                    return Err(self.fail_all(e, Some(r)));
                }
            }
        }
        let parts: Vec<Vec<u8>> = parts.into_iter().map(|p| p.unwrap_or_default()).collect();
        let out = combine(&parts)?;
        let result = Put::default().u64(seq).raw(&out).0;
        for l in &self.links {
            if let Err(e) = l.send(kind::RESULT, &result) {
                let e = CommError::PeerFailed {
                    rank: l.peer,
                    reason: format!("sending it the result of collective #{seq} failed: {e}"),
                };
                return Err(self.fail_all(e, Some(l.peer)));
            }
        }
        Ok(out)
    }

    fn leaf_exchange(
        &self,
        st: &mut State,
        seq: u64,
        sig: &str,
        mine: Vec<u8>,
        started: Instant,
    ) -> Result<Vec<u8>, CommError> {
        let root = &self.links[0];
        let deposit = Put::default().u64(seq).str(sig).raw(&mine).0;
        let lost = |why: String| CommError::PeerFailed {
            rank: 0,
            reason: format!(
                "{why} without a goodbye (the process died, was killed, or its host is unreachable)"
            ),
        };
        if let Err(e) = root.send(kind::DEPOSIT, &deposit) {
            return Err(lost(format!("sending it a buffer failed ({e})")));
        }
        let limit = self
            .opts
            .collective_timeout
            .map(|t| 2 * t + self.opts.dead_after);
        loop {
            let wait = match limit {
                Some(t) => {
                    let left = t.saturating_sub(started.elapsed());
                    if left.is_zero() {
                        let e = CommError::Timeout {
                            seq,
                            op: format!("{sig}; no answer from rank 0, which collects it"),
                            missing: vec![0],
                            timeout: t,
                        };
                        return Err(self.fail_all(e, None));
                    }
                    left
                }
                None => Duration::from_secs(3600),
            };
            let ev = match st.rx.recv_timeout(wait) {
                Ok((_, ev)) => ev,
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(lost("its reader thread ended".into()))
                }
            };
            match ev {
                Event::Frame(kind::RESULT, p) => {
                    let mut g = Get(&p);
                    let s = g.u64()?;
                    if s != seq {
                        return Err(protocol(format!(
                            "rank 0 sent the result of collective #{s} during #{seq}"
                        )));
                    }
                    return Ok(g.rest().to_vec());
                }
                Event::Frame(kind::FAIL, p) => return Err(decode_error(&p)?),
                Event::Frame(kind::BYE, _) => {
                    st.exited[0] = true;
                    return Err(CommError::PeerExited {
                        rank: 0,
                        seq,
                        op: sig.to_string(),
                    });
                }
                Event::Frame(k, _) => {
                    return Err(protocol(format!(
                        "rank 0 sent frame kind {k} in a collective"
                    )))
                }
                Event::Closed(why) => {
                    st.closed[0] = true;
                    return Err(lost(why));
                }
            }
        }
    }
}

impl Communicator for TcpComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce<T: Elem>(&self, buf: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        let n = buf.len();
        let sig = format!("all_reduce({op:?}) of {n} {}", T::DTYPE);
        let out = self.exchange(sig, encode(buf), &|parts| {
            let vals = parts
                .iter()
                .map(|p| decode::<T>(p, n))
                .collect::<Result<Vec<_>, _>>()?;
            let refs: Vec<&[T]> = vals.iter().map(Vec::as_slice).collect();
            let mut acc = vals[0].clone();
            reduce_in_rank_order(&mut acc, &refs, op);
            Ok(encode(&acc))
        })?;
        decode_into(&out, buf)
    }

    fn all_gather<T: Elem>(&self, send: &[T], recv: &mut [T]) -> Result<(), CommError> {
        let n = send.len();
        if recv.len() != n * self.world {
            return Err(CommError::Invalid(format!(
                "all_gather on rank {}: recv has {} elements, expected {} ranks x {n}",
                self.rank,
                recv.len(),
                self.world
            )));
        }
        let sig = format!("all_gather of {n} {}", T::DTYPE);
        let out = self.exchange(sig, encode(send), &|parts| {
            if parts.iter().any(|p| p.len() != n * T::BYTES) {
                return Err(protocol("all_gather parts of different sizes".into()));
            }
            Ok(parts.concat())
        })?;
        decode_into(&out, recv)
    }

    fn broadcast<T: Elem>(&self, buf: &mut [T], root: usize) -> Result<(), CommError> {
        if root >= self.world {
            return Err(CommError::Invalid(format!(
                "broadcast root {root} outside a group of {} ranks",
                self.world
            )));
        }
        let sig = format!("broadcast from {root} of {} {}", buf.len(), T::DTYPE);
        // only the root's data travels; the others deposit nothing
        let mine = if self.rank == root {
            encode(buf)
        } else {
            Vec::new()
        };
        let out = self.exchange(sig, mine, &|parts| Ok(parts[root].clone()))?;
        decode_into(&out, buf)
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.exchange("barrier".into(), Vec::new(), &|_| Ok(Vec::new()))
            .map(|_| ())
    }

    fn abort(&self, reason: &str) {
        let e = CommError::PeerFailed {
            rank: self.rank,
            reason: reason.to_string(),
        };
        *self.aborted.lock().unwrap_or_else(|e| e.into_inner()) = Some(e.clone());
        self.fail_all(e, None);
    }
}

impl Drop for TcpComm {
    fn drop(&mut self) {
        drop(self.heartbeat_stop.take());
        let aborted = self
            .aborted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some();
        let (k, p) = if std::thread::panicking() {
            let e = CommError::PeerFailed {
                rank: self.rank,
                reason: "panicked".into(),
            };
            (kind::FAIL, encode_error(&e))
        } else {
            (kind::BYE, Vec::new())
        };
        for l in &self.links {
            if !aborted || k == kind::FAIL {
                let _ = l.send(k, &p);
            }
            let _ =
                l.w.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .shutdown(Shutdown::Write);
        }
        // wait (briefly) until every peer has closed its side: our reader threads have then read
        // everything, and closing cannot reset a connection a peer still reads from
        let linger = LINGER.min(self.opts.dead_after);
        let started = Instant::now();
        let mut st = self.lock();
        while self.links.iter().any(|l| !st.closed[l.peer]) {
            let left = linger.saturating_sub(started.elapsed());
            match st.rx.recv_timeout(left) {
                Ok((r, Event::Closed(_))) => st.closed[r] = true,
                Ok(_) => {}
                Err(_) => break,
            }
        }
        for l in &self.links {
            let _ =
                l.w.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .shutdown(Shutdown::Both);
        }
    }
}

/// Runs `f` on `world` ranks as threads of this process, connected by [`TcpComm`] over
/// loopback (rank 0 listens on an ephemeral port of 127.0.0.1): the TCP communicator's
/// semantics in one process, for tests. Returns every rank's result in rank order; a rank that
/// returns an error aborts the group first, as [`super::run_ranks`] does.
pub fn run_ranks_tcp<R, E, F>(
    world: usize,
    opts: TcpOptions,
    f: F,
) -> Result<Vec<Result<R, E>>, CommError>
where
    R: Send,
    E: Send + std::fmt::Display + From<CommError>,
    F: Fn(&TcpComm) -> Result<R, E> + Sync,
{
    let listener = TcpListener::bind("127.0.0.1:0")
        .map_err(|e| rdv(format!("cannot listen on 127.0.0.1: {e}")))?;
    let addr = listener
        .local_addr()
        .map_err(|e| rdv(format!("listening socket: {e}")))?
        .to_string();
    let job = format!("run_ranks_tcp-{}", std::process::id());
    let listener = Mutex::new(Some(listener));
    Ok(std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (f, opts, job, addr, listener) = (&f, opts.clone(), &job, &addr, &listener);
                s.spawn(move || -> Result<R, E> {
                    let comm = if rank == 0 {
                        let l = listener
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .take()
                            .ok_or_else(|| CommError::Invalid("listener taken".into()))?;
                        TcpComm::serve(l, world, job, b"unique-id".to_vec(), opts)?
                    } else {
                        TcpComm::connect(addr, rank, world, job, opts)?
                    };
                    let r = f(&comm);
                    if let Err(e) = &r {
                        comm.abort(&e.to_string());
                    }
                    r
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join().unwrap_or_else(|_| {
                    Err(E::from(CommError::PeerFailed {
                        rank,
                        reason: "panicked".into(),
                    }))
                })
            })
            .collect()
    }))
}
