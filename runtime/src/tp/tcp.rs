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
//! unique_id}`, or `REJECT {reason}` when the group cannot form (the rendezvous then fails on
//! every rank with that reason). `unique_id` is an opaque blob chosen by rank 0: the NCCL
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

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::comm::{reduce_in_rank_order, CommError, Communicator, Elem, ReduceOp};

/// First bytes of a hello: the protocol and its version.
const MAGIC: &[u8; 8] = b"RPLXTP01";
/// Largest frame accepted (a corrupt length must not allocate the machine away).
const MAX_FRAME: u64 = 1 << 34;
/// How long rank 0 waits for the hello of a connection it accepted.
const HELLO_WAIT: Duration = Duration::from_secs(5);
/// How long a dropped rank waits for its peers to close their side (see the module doc).
const LINGER: Duration = Duration::from_secs(2);

mod kind {
    pub const HELLO: u8 = 1;
    pub const WELCOME: u8 = 2;
    pub const REJECT: u8 = 3;
    pub const HEARTBEAT: u8 = 4;
    pub const DEPOSIT: u8 = 5;
    pub const RESULT: u8 = 6;
    pub const FAIL: u8 = 7;
    pub const BYE: u8 = 8;
}

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

/// What a reader thread reports about its socket.
enum Event {
    Frame(u8, Vec<u8>),
    /// The connection ended: end of stream, a reset, or silence for `dead_after`.
    Closed(String),
}

/// One socket to a peer; `w` is shared with the heartbeat thread.
struct Link {
    peer: usize,
    w: Arc<Mutex<TcpStream>>,
}

impl Link {
    fn send(&self, kind: u8, payload: &[u8]) -> io::Result<()> {
        let mut w = self.w.lock().unwrap_or_else(|e| e.into_inner());
        write_frame(&mut *w, kind, payload)
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

fn rdv(msg: String) -> CommError {
    CommError::Rendezvous(msg)
}

fn protocol(msg: String) -> CommError {
    CommError::Invalid(format!("tensor-parallel protocol: {msg}"))
}

fn write_frame(w: &mut impl Write, kind: u8, payload: &[u8]) -> io::Result<()> {
    let mut buf = Vec::with_capacity(9 + payload.len());
    buf.extend_from_slice(&(payload.len() as u64 + 1).to_le_bytes());
    buf.push(kind);
    buf.extend_from_slice(payload);
    w.write_all(&buf)?;
    w.flush()
}

fn read_frame(r: &mut impl Read) -> io::Result<(u8, Vec<u8>)> {
    let mut len = [0u8; 8];
    r.read_exact(&mut len)?;
    let len = u64::from_le_bytes(len);
    if len == 0 || len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a frame of {len} bytes (corrupt stream, or not a rollplex rank)"),
        ));
    }
    let mut buf = vec![0u8; len as usize];
    r.read_exact(&mut buf)?;
    let kind = buf[0];
    buf.remove(0);
    Ok((kind, buf))
}

/// Builds payloads.
#[derive(Default)]
struct Put(Vec<u8>);

impl Put {
    fn u32(mut self, v: usize) -> Self {
        self.0.extend_from_slice(&(v as u32).to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(self, b: &[u8]) -> Self {
        let mut s = self.u32(b.len());
        s.0.extend_from_slice(b);
        s
    }
    fn str(self, s: &str) -> Self {
        self.bytes(s.as_bytes())
    }
    fn raw(mut self, b: &[u8]) -> Self {
        self.0.extend_from_slice(b);
        self
    }
}

/// Reads payloads; running out of bytes is a protocol error.
struct Get<'a>(&'a [u8]);

impl<'a> Get<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], CommError> {
        if self.0.len() < n {
            return Err(protocol(format!(
                "a frame ends early ({} bytes left, {n} needed)",
                self.0.len()
            )));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u32(&mut self) -> Result<usize, CommError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
    }
    fn u64(&mut self) -> Result<u64, CommError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    fn bytes(&mut self) -> Result<&'a [u8], CommError> {
        let n = self.u32()?;
        self.take(n)
    }
    fn str(&mut self) -> Result<String, CommError> {
        Ok(String::from_utf8_lossy(self.bytes()?).into_owned())
    }
    fn rest(self) -> &'a [u8] {
        self.0
    }
}

/// A [`CommError`] as a `FAIL` payload.
fn encode_error(e: &CommError) -> Vec<u8> {
    match e {
        CommError::PeerFailed { rank, reason } => Put::default().raw(&[0]).u32(*rank).str(reason),
        CommError::PeerExited { rank, seq, op } => {
            Put::default().raw(&[1]).u32(*rank).u64(*seq).str(op)
        }
        CommError::Mismatch {
            seq,
            rank_a,
            a,
            rank_b,
            b,
        } => Put::default()
            .raw(&[2])
            .u64(*seq)
            .u32(*rank_a)
            .str(a)
            .u32(*rank_b)
            .str(b),
        CommError::Invalid(m) => Put::default().raw(&[3]).str(m),
        CommError::Timeout {
            seq,
            op,
            missing,
            timeout,
        } => {
            let mut p = Put::default()
                .raw(&[4])
                .u64(*seq)
                .str(op)
                .u32(missing.len());
            for &m in missing {
                p = p.u32(m);
            }
            p.u64(timeout.as_millis() as u64)
        }
        CommError::Rendezvous(m) => Put::default().raw(&[5]).str(m),
    }
    .0
}

fn decode_error(b: &[u8]) -> Result<CommError, CommError> {
    let mut g = Get(b);
    Ok(match g.take(1)?[0] {
        0 => CommError::PeerFailed {
            rank: g.u32()?,
            reason: g.str()?,
        },
        1 => CommError::PeerExited {
            rank: g.u32()?,
            seq: g.u64()?,
            op: g.str()?,
        },
        2 => CommError::Mismatch {
            seq: g.u64()?,
            rank_a: g.u32()?,
            a: g.str()?,
            rank_b: g.u32()?,
            b: g.str()?,
        },
        3 => CommError::Invalid(g.str()?),
        4 => {
            let seq = g.u64()?;
            let op = g.str()?;
            let n = g.u32()?;
            let missing = (0..n).map(|_| g.u32()).collect::<Result<_, _>>()?;
            CommError::Timeout {
                seq,
                op,
                missing,
                timeout: Duration::from_millis(g.u64()?),
            }
        }
        5 => CommError::Rendezvous(g.str()?),
        t => return Err(protocol(format!("unknown error tag {t}"))),
    })
}

fn encode<T: Elem>(v: &[T]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * T::BYTES);
    for &x in v {
        x.put_le(&mut out);
    }
    out
}

fn decode_into<T: Elem>(b: &[u8], out: &mut [T]) -> Result<(), CommError> {
    if b.len() != out.len() * T::BYTES {
        return Err(protocol(format!(
            "{} bytes for {} {} elements",
            b.len(),
            out.len(),
            T::DTYPE
        )));
    }
    for (o, c) in out.iter_mut().zip(b.chunks_exact(T::BYTES)) {
        *o = T::get_le(c);
    }
    Ok(())
}

fn decode<T: Elem>(b: &[u8], n: usize) -> Result<Vec<T>, CommError> {
    if b.len() != n * T::BYTES {
        return Err(protocol(format!(
            "{} bytes for {n} {} elements",
            b.len(),
            T::DTYPE
        )));
    }
    Ok(b.chunks_exact(T::BYTES).map(T::get_le).collect())
}

/// Reads frames off `stream` into `tx` until the connection ends (reported as `Closed`).
fn spawn_reader(
    peer: usize,
    mut stream: TcpStream,
    dead_after: Duration,
    tx: Sender<(usize, Event)>,
) -> Result<(), CommError> {
    stream
        .set_read_timeout(Some(dead_after))
        .map_err(|e| rdv(format!("socket to rank {peer}: {e}")))?;
    std::thread::Builder::new()
        .name(format!("tp-tcp-rx-{peer}"))
        .spawn(move || loop {
            match read_frame(&mut stream) {
                Ok((kind::HEARTBEAT, _)) => {}
                Ok((k, p)) => {
                    if tx.send((peer, Event::Frame(k, p))).is_err() {
                        return;
                    }
                }
                Err(e) => {
                    let why = match e.kind() {
                        io::ErrorKind::UnexpectedEof => "its connection closed".to_string(),
                        io::ErrorKind::ConnectionReset
                        | io::ErrorKind::ConnectionAborted
                        | io::ErrorKind::BrokenPipe => "its connection was reset".to_string(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                            format!("no message or heartbeat for {dead_after:?}")
                        }
                        _ => format!("its connection failed: {e}"),
                    };
                    let _ = tx.send((peer, Event::Closed(why)));
                    return;
                }
            }
        })
        .map(|_| ())
        .map_err(|e| rdv(format!("cannot start a reader thread: {e}")))
}

/// Sends a heartbeat on every link each `every` until the returned sender is dropped.
fn spawn_heartbeat(
    links: Vec<Arc<Mutex<TcpStream>>>,
    every: Duration,
) -> Result<Sender<()>, CommError> {
    let (stop, rx) = mpsc::channel::<()>();
    std::thread::Builder::new()
        .name("tp-tcp-heartbeat".into())
        .spawn(move || loop {
            match rx.recv_timeout(every) {
                Err(RecvTimeoutError::Timeout) => {
                    for w in &links {
                        let mut w = w.lock().unwrap_or_else(|e| e.into_inner());
                        let _ = write_frame(&mut *w, kind::HEARTBEAT, &[]);
                    }
                }
                _ => return,
            }
        })
        .map_err(|e| rdv(format!("cannot start the heartbeat thread: {e}")))?;
    Ok(stop)
}

fn prepare(s: &TcpStream, opts: &TcpOptions) -> io::Result<()> {
    s.set_nonblocking(false)?;
    s.set_nodelay(true)?;
    s.set_write_timeout(Some(opts.dead_after))?;
    s.set_read_timeout(Some(opts.connect_timeout))
}

impl TcpComm {
    /// Rank 0 of a group of `world` processes: accepts the other ranks on `listener` (bound by
    /// the caller, possibly to port 0), checks their hellos against `job` and `world`, and sends
    /// everyone `unique_id`. Fails, naming the ranks, when some do not connect within
    /// `connect_timeout` or one belongs to another job.
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
                        let _ = write_frame(&mut s, kind::REJECT, why.as_bytes());
                        reject_all(&mut streams, &why);
                        return Err(rdv(why));
                    }
                    streams[rank] = Some(s);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if started.elapsed() >= opts.connect_timeout {
                        let missing: Vec<usize> =
                            (1..world).filter(|&r| streams[r].is_none()).collect();
                        let why = format!(
                            "ranks {missing:?} of {world} did not connect to rank 0 at {addr} within {:?}",
                            opts.connect_timeout
                        );
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
