//! Collectives for tensor parallelism: the [`Communicator`] trait and [`ThreadComm`], its
//! in-process implementation for N ranks running as threads of one process.
//!
//! What this module knows: ranks `0..world`, buffers of [`Elem`] values, and the order in which a
//! rank issues its collectives. It knows nothing of models.
//!
//! Semantics every implementation must keep:
//! - Every rank calls the same collectives in the same order with the same lengths (and root).
//!   A mismatch is an error (ThreadComm detects it and names both ranks).
//! - `all_reduce(Sum)` adds the ranks' buffers **in rank order**, `((b0 + b1) + b2) + ...`,
//!   element by element, and every rank receives the same bits. So a TP run is bitwise
//!   reproducible, and its result depends on the degree only (not on thread timing).
//!   `Max` is order-free (NaN never wins; all NaN gives NaN).
//! - `all_gather` concatenates equal-length buffers in rank order.
//! - A rank that fails calls [`Communicator::abort`] (ThreadComm also does it for a rank whose
//!   handle is dropped while panicking); every collective pending or issued later on any other
//!   rank returns [`CommError::PeerFailed`] naming that rank, never hangs. A rank that returns
//!   normally while others still wait for it makes them fail with [`CommError::PeerExited`].
//!
//! An NCCL implementation (one process or thread per GPU, `cudarc::nccl`) fits the same trait:
//! `Elem::DTYPE` maps to `ncclFloat32`/`ncclFloat64`, `all_gather`/`broadcast`/`barrier` map to
//! `ncclAllGather`/`ncclBroadcast`/a 1-element all-reduce on the rank's stream. NCCL's own
//! all-reduce sums in an order set by its algorithm (ring/tree chunks), not in rank order; an
//! implementation that must keep the bitwise contract runs `all_reduce(Sum)` as an all-gather
//! followed by a local rank-order sum (T times the bytes; fine for the small activations TP
//! reduces at decode), and may offer `ncclAllReduce` as an opt-in fast path whose results are
//! reproducible for a fixed algorithm and topology only. `abort` maps to `ncclCommAbort`, and
//! a watchdog polling `ncclCommGetAsyncError` turns a dead peer into `PeerFailed`.

use std::any::Any;
use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Element types the collectives move. Sealed: f32 (activations) and f64 (the vocab-parallel
/// softmax statistics, which the single-rank reference sums in f64).
pub trait Elem: Copy + Send + Sync + fmt::Debug + 'static + private::Sealed {
    /// The name an NCCL implementation maps to its data type (`"f32"` -> `ncclFloat32`).
    const DTYPE: &'static str;
    /// Bytes of one element on the wire (little-endian, bit-exact: NaN payloads survive).
    const BYTES: usize;
    fn add(self, o: Self) -> Self;
    /// The larger of two values; NaN never wins over a number.
    fn max(self, o: Self) -> Self;
    /// Appends the element's little-endian bytes.
    fn put_le(self, out: &mut Vec<u8>);
    /// The element from `BYTES` little-endian bytes.
    fn get_le(b: &[u8]) -> Self;
}

mod private {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
}

impl Elem for f32 {
    const DTYPE: &'static str = "f32";
    const BYTES: usize = 4;
    fn add(self, o: Self) -> Self {
        self + o
    }
    fn max(self, o: Self) -> Self {
        f32::max(self, o)
    }
    fn put_le(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_bits().to_le_bytes());
    }
    fn get_le(b: &[u8]) -> Self {
        let mut a = [0u8; 4];
        a.copy_from_slice(&b[..4]);
        f32::from_bits(u32::from_le_bytes(a))
    }
}

impl Elem for f64 {
    const DTYPE: &'static str = "f64";
    const BYTES: usize = 8;
    fn add(self, o: Self) -> Self {
        self + o
    }
    fn max(self, o: Self) -> Self {
        f64::max(self, o)
    }
    fn put_le(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_bits().to_le_bytes());
    }
    fn get_le(b: &[u8]) -> Self {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[..8]);
        f64::from_bits(u64::from_le_bytes(a))
    }
}

/// Reduction of [`Communicator::all_reduce`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum in rank order.
    Sum,
    Max,
}

/// Why a collective did not complete.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CommError {
    /// A rank aborted (an error or a panic); `reason` is what it reported.
    #[error("tensor-parallel rank {rank} failed: {reason}")]
    PeerFailed { rank: usize, reason: String },
    /// A rank finished its work while another still waited for it in a collective.
    #[error("tensor-parallel rank {rank} exited before joining collective #{seq} ({op})")]
    PeerExited { rank: usize, seq: u64, op: String },
    /// Ranks issued different collectives at the same point.
    #[error("collective #{seq} mismatch: rank {rank_a} called {a}, rank {rank_b} called {b}")]
    Mismatch {
        seq: u64,
        rank_a: usize,
        a: String,
        rank_b: usize,
        b: String,
    },
    /// A bad argument (wrong buffer length, root outside the group).
    #[error("{0}")]
    Invalid(String),
    /// Forming a group across processes failed (address, time-out, a rank of another job).
    #[error("tensor-parallel rendezvous: {0}")]
    Rendezvous(String),
    /// Some ranks did not reach a collective in time.
    #[error("collective #{seq} ({op}): ranks {missing:?} did not arrive within {timeout:?}")]
    Timeout {
        seq: u64,
        op: String,
        missing: Vec<usize>,
        timeout: Duration,
    },
}

/// The collectives tensor parallelism needs, seen from one rank.
pub trait Communicator: Send + Sync {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// In place: every rank's `buf` becomes the element-wise reduction over ranks (Sum in rank
    /// order, bitwise equal on every rank).
    fn all_reduce<T: Elem>(&self, buf: &mut [T], op: ReduceOp) -> Result<(), CommError>;
    /// `recv` (`world * send.len()`) gets every rank's `send`, in rank order.
    fn all_gather<T: Elem>(&self, send: &[T], recv: &mut [T]) -> Result<(), CommError>;
    /// Every rank's `buf` becomes `root`'s.
    fn broadcast<T: Elem>(&self, buf: &mut [T], root: usize) -> Result<(), CommError>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<(), CommError>;
    /// Marks this rank failed: every pending and later collective of the group fails with
    /// [`CommError::PeerFailed`] naming this rank.
    fn abort(&self, reason: &str);

    /// `all_reduce(buf, Sum)`.
    fn all_reduce_sum<T: Elem>(&self, buf: &mut [T]) -> Result<(), CommError> {
        self.all_reduce(buf, ReduceOp::Sum)
    }
}

/// The group of one: rank 0 of a world of 1. Every collective is the identity (an all-reduce
/// touches nothing, a gather copies the one part), so the model run over it is the single-rank
/// model at no cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SoloComm;

impl Communicator for SoloComm {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn all_reduce<T: Elem>(&self, _buf: &mut [T], _op: ReduceOp) -> Result<(), CommError> {
        Ok(())
    }
    fn all_gather<T: Elem>(&self, send: &[T], recv: &mut [T]) -> Result<(), CommError> {
        if recv.len() != send.len() {
            return Err(CommError::Invalid(format!(
                "all_gather: {} elements received for {} sent in a group of one",
                recv.len(),
                send.len()
            )));
        }
        recv.copy_from_slice(send);
        Ok(())
    }
    fn broadcast<T: Elem>(&self, _buf: &mut [T], root: usize) -> Result<(), CommError> {
        if root != 0 {
            return Err(CommError::Invalid(format!(
                "broadcast from rank {root} in a group of one"
            )));
        }
        Ok(())
    }
    fn barrier(&self) -> Result<(), CommError> {
        Ok(())
    }
    fn abort(&self, _reason: &str) {}
}

/// Gathers buffers of different lengths (`counts[r]` elements from rank `r`) into their rank
/// order concatenation: pads each to the largest count, gathers, trims (what an NCCL
/// implementation does too, as `ncclAllGather` moves equal counts).
pub fn all_gather_uneven<C: Communicator, T: Elem + Default>(
    comm: &C,
    send: &[T],
    counts: &[usize],
) -> Result<Vec<T>, CommError> {
    if counts.len() != comm.world() || counts[comm.rank()] != send.len() {
        return Err(CommError::Invalid(format!(
            "all_gather_uneven: rank {} sends {} elements, counts {:?} for a world of {}",
            comm.rank(),
            send.len(),
            counts,
            comm.world()
        )));
    }
    let max = counts.iter().copied().max().unwrap_or(0);
    let mut padded = send.to_vec();
    padded.resize(max, T::default());
    let mut all = vec![T::default(); max * counts.len()];
    comm.all_gather(&padded, &mut all)?;
    let mut out = Vec::with_capacity(counts.iter().sum());
    for (r, &c) in counts.iter().enumerate() {
        out.extend_from_slice(&all[r * max..r * max + c]);
    }
    Ok(out)
}

/// The reduction every communicator runs: `buf = parts[0]`, then each later rank's part folded
/// in, element by element, in rank order (`((b0 + b1) + b2) + ...`). One function, so that
/// [`ThreadComm`] and the TCP communicator give bitwise the same results.
pub(crate) fn reduce_in_rank_order<T: Elem>(buf: &mut [T], parts: &[&[T]], op: ReduceOp) {
    buf.copy_from_slice(parts[0]);
    for p in &parts[1..] {
        for (b, x) in buf.iter_mut().zip(p.iter()) {
            *b = match op {
                ReduceOp::Sum => b.add(*x),
                ReduceOp::Max => b.max(*x),
            };
        }
    }
}

/// What a rank put in for the current collective: its signature and its data.
struct Slot {
    sig: String,
    data: Arc<dyn Any + Send + Sync>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Ranks deposit their buffers.
    Filling,
    /// Everyone has deposited; ranks read the slots and leave.
    Draining,
}

struct State {
    /// Number of the collective being run (the same on every rank).
    seq: u64,
    phase: Phase,
    arrived: usize,
    departed: usize,
    slots: Vec<Option<Slot>>,
    /// The first rank that failed, and why.
    failed: Option<(usize, String)>,
    /// Ranks whose handle was dropped normally.
    exited: Vec<bool>,
}

struct Group {
    world: usize,
    state: Mutex<State>,
    cv: Condvar,
    timeout: Option<Duration>,
}

impl Group {
    fn lock(&self) -> MutexGuard<'_, State> {
        // a panicking rank never holds the lock while user code runs; recover a poisoned lock
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One rank's handle on an in-process group of `world` ranks (one thread each).
///
/// Made by [`ThreadComm::group`]; each handle moves to its rank's thread. Dropping a handle
/// marks the rank exited, or failed when the thread is panicking, so peers never hang on it.
pub struct ThreadComm {
    rank: usize,
    g: Arc<Group>,
}

impl fmt::Debug for ThreadComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ThreadComm(rank {} of {})", self.rank, self.g.world)
    }
}

impl ThreadComm {
    /// Handles for ranks `0..world`, waiting for peers without a time limit (a failed or
    /// exited peer still ends every wait).
    pub fn group(world: usize) -> Result<Vec<ThreadComm>, CommError> {
        Self::group_with_timeout(world, None)
    }

    /// As [`ThreadComm::group`]; a collective that waits longer than `timeout` for the other
    /// ranks fails the whole group with [`CommError::Timeout`] naming the missing ranks.
    pub fn group_with_timeout(
        world: usize,
        timeout: Option<Duration>,
    ) -> Result<Vec<ThreadComm>, CommError> {
        if world == 0 {
            return Err(CommError::Invalid(
                "a communicator needs at least one rank".into(),
            ));
        }
        let g = Arc::new(Group {
            world,
            state: Mutex::new(State {
                seq: 0,
                phase: Phase::Filling,
                arrived: 0,
                departed: 0,
                slots: (0..world).map(|_| None).collect(),
                failed: None,
                exited: vec![false; world],
            }),
            cv: Condvar::new(),
            timeout,
        });
        Ok((0..world)
            .map(|rank| ThreadComm {
                rank,
                g: Arc::clone(&g),
            })
            .collect())
    }

    fn fail(&self, st: &mut State, rank: usize, reason: String) {
        if st.failed.is_none() {
            st.failed = Some((rank, reason));
        }
        self.g.cv.notify_all();
    }

    /// Waits on the condition variable; on time-out fails the group.
    fn wait<'a>(
        &self,
        st: MutexGuard<'a, State>,
        started: Instant,
        sig: &str,
    ) -> Result<MutexGuard<'a, State>, CommError> {
        match self.g.timeout {
            None => Ok(self.g.cv.wait(st).unwrap_or_else(|e| e.into_inner())),
            Some(t) => {
                let left = t.saturating_sub(started.elapsed());
                let (mut st, res) = self
                    .g
                    .cv
                    .wait_timeout(st, left)
                    .unwrap_or_else(|e| e.into_inner());
                if res.timed_out() && started.elapsed() >= t {
                    let missing: Vec<usize> = (0..self.g.world)
                        .filter(|&r| st.phase == Phase::Filling && st.slots[r].is_none())
                        .collect();
                    let err = CommError::Timeout {
                        seq: st.seq,
                        op: sig.to_string(),
                        missing: missing.clone(),
                        timeout: t,
                    };
                    let who = missing.first().copied().unwrap_or(self.rank);
                    self.fail(&mut st, who, err.to_string());
                    return Err(err);
                }
                Ok(st)
            }
        }
    }

    fn failure(st: &State) -> Option<CommError> {
        st.failed
            .as_ref()
            .map(|(rank, reason)| CommError::PeerFailed {
                rank: *rank,
                reason: reason.clone(),
            })
    }

    /// The rendezvous under every collective: deposits `data` under signature `sig`, waits for
    /// every rank, and returns all ranks' data in rank order.
    fn exchange(
        &self,
        sig: String,
        data: Arc<dyn Any + Send + Sync>,
    ) -> Result<Vec<Arc<dyn Any + Send + Sync>>, CommError> {
        let started = Instant::now();
        let mut st = self.g.lock();
        // wait for the previous collective to drain
        loop {
            if let Some(e) = Self::failure(&st) {
                return Err(e);
            }
            if st.phase == Phase::Filling {
                break;
            }
            st = self.wait(st, started, &sig)?;
        }
        let seq = st.seq;
        if let Some((r, other)) = st
            .slots
            .iter()
            .enumerate()
            .find_map(|(r, s)| s.as_ref().map(|s| (r, s)))
        {
            if other.sig != sig {
                let err = CommError::Mismatch {
                    seq,
                    rank_a: r,
                    a: other.sig.clone(),
                    rank_b: self.rank,
                    b: sig.clone(),
                };
                let rank = self.rank;
                self.fail(&mut st, rank, err.to_string());
                return Err(err);
            }
        }
        st.slots[self.rank] = Some(Slot {
            sig: sig.clone(),
            data,
        });
        st.arrived += 1;
        if st.arrived == self.g.world {
            st.phase = Phase::Draining;
            self.g.cv.notify_all();
        }
        loop {
            if st.phase == Phase::Draining && st.seq == seq {
                break;
            }
            // an exit is permanent: every waiter sees it itself (checked before failures, which
            // the ranks that saw it report next)
            if let Some(r) = (0..self.g.world).find(|&r| st.exited[r] && st.slots[r].is_none()) {
                return Err(CommError::PeerExited {
                    rank: r,
                    seq,
                    op: sig.clone(),
                });
            }
            if let Some(e) = Self::failure(&st) {
                return Err(e);
            }
            st = self.wait(st, started, &sig)?;
        }
        let all: Vec<_> = st
            .slots
            .iter()
            .map(|s| s.as_ref().map(|s| Arc::clone(&s.data)))
            .collect::<Option<_>>()
            .ok_or_else(|| CommError::Invalid("internal: a slot emptied while draining".into()))?;
        st.departed += 1;
        if st.departed == self.g.world {
            st.slots.iter_mut().for_each(|s| *s = None);
            st.arrived = 0;
            st.departed = 0;
            st.seq += 1;
            st.phase = Phase::Filling;
            self.g.cv.notify_all();
        }
        Ok(all)
    }

    fn typed<T: Elem>(all: &[Arc<dyn Any + Send + Sync>]) -> Result<Vec<&[T]>, CommError> {
        all.iter()
            .map(|a| {
                a.downcast_ref::<Vec<T>>()
                    .map(|v| v.as_slice())
                    .ok_or_else(|| CommError::Invalid("internal: element type mismatch".into()))
            })
            .collect()
    }
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.g.world
    }

    fn all_reduce<T: Elem>(&self, buf: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        let sig = format!("all_reduce({op:?}) of {} {}", buf.len(), T::DTYPE);
        let all = self.exchange(sig, Arc::new(buf.to_vec()))?;
        let parts = Self::typed::<T>(&all)?;
        reduce_in_rank_order(buf, &parts, op);
        Ok(())
    }

    fn all_gather<T: Elem>(&self, send: &[T], recv: &mut [T]) -> Result<(), CommError> {
        let n = send.len();
        if recv.len() != n * self.g.world {
            return Err(CommError::Invalid(format!(
                "all_gather on rank {}: recv has {} elements, expected {} ranks x {n}",
                self.rank,
                recv.len(),
                self.g.world
            )));
        }
        let sig = format!("all_gather of {n} {}", T::DTYPE);
        let all = self.exchange(sig, Arc::new(send.to_vec()))?;
        for (r, p) in Self::typed::<T>(&all)?.into_iter().enumerate() {
            recv[r * n..(r + 1) * n].copy_from_slice(p);
        }
        Ok(())
    }

    fn broadcast<T: Elem>(&self, buf: &mut [T], root: usize) -> Result<(), CommError> {
        if root >= self.g.world {
            return Err(CommError::Invalid(format!(
                "broadcast root {root} outside a group of {} ranks",
                self.g.world
            )));
        }
        let sig = format!("broadcast from {root} of {} {}", buf.len(), T::DTYPE);
        // only the root's data is read; the others deposit an empty vector
        let mine: Vec<T> = if self.rank == root {
            buf.to_vec()
        } else {
            Vec::new()
        };
        let all = self.exchange(sig, Arc::new(mine))?;
        let parts = Self::typed::<T>(&all)?;
        buf.copy_from_slice(parts[root]);
        Ok(())
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.exchange("barrier".into(), Arc::new(Vec::<f32>::new()))
            .map(|_| ())
    }

    fn abort(&self, reason: &str) {
        let mut st = self.g.lock();
        let rank = self.rank;
        self.fail(&mut st, rank, reason.to_string());
    }
}

impl Drop for ThreadComm {
    fn drop(&mut self) {
        let mut st = self.g.lock();
        if std::thread::panicking() {
            let rank = self.rank;
            self.fail(&mut st, rank, "panicked".into());
        } else {
            st.exited[self.rank] = true;
            self.g.cv.notify_all();
        }
    }
}

/// Runs `f` on `world` ranks, one scoped thread each, with a fresh [`ThreadComm`] group, and
/// returns each rank's result in rank order.
///
/// A rank that returns an error or panics aborts the group (a panic is reported with its
/// message); the others' pending collectives then fail instead of hanging. The error returned
/// is the root cause: the error of the first rank that aborted, with its rank.
pub fn run_ranks<R, E, F>(world: usize, f: F) -> Result<Vec<R>, RankError<E>>
where
    R: Send,
    E: Send + fmt::Display + From<CommError>,
    F: Fn(&ThreadComm) -> Result<R, E> + Sync,
{
    let comms = ThreadComm::group(world).map_err(|e| RankError {
        rank: 0,
        error: E::from(e),
    })?;
    let group = Arc::clone(&comms[0].g);
    let results: Vec<Result<R, E>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let f = &f;
                s.spawn(move || {
                    let rank = comm.rank;
                    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&comm))) {
                        Ok(Ok(r)) => Ok(r),
                        Ok(Err(e)) => {
                            comm.abort(&e.to_string());
                            Err(e)
                        }
                        Err(p) => {
                            let reason = format!("panicked: {}", panic_message(p.as_ref()));
                            comm.abort(&reason);
                            Err(E::from(CommError::PeerFailed { rank, reason }))
                        }
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join().unwrap_or_else(|p| {
                    Err(E::from(CommError::PeerFailed {
                        rank,
                        reason: format!("panicked: {}", panic_message(p.as_ref())),
                    }))
                })
            })
            .collect()
    });
    // the group remembers the first rank that aborted: the root cause
    let root = group.lock().failed.as_ref().map(|(r, _)| *r);
    let mut errs: Vec<(usize, E)> = Vec::new();
    let mut out = Vec::with_capacity(world);
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(v) => out.push(v),
            Err(e) => errs.push((rank, e)),
        }
    }
    if errs.is_empty() {
        return Ok(out);
    }
    let i = errs.iter().position(|(r, _)| Some(*r) == root).unwrap_or(0);
    let (rank, error) = errs.swap_remove(i);
    Err(RankError { rank, error })
}

/// The error of [`run_ranks`]: the rank whose failure ended the group, and its error.
#[derive(Debug)]
pub struct RankError<E> {
    pub rank: usize,
    pub error: E,
}

impl<E: fmt::Display> fmt::Display for RankError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {}: {}", self.rank, self.error)
    }
}

impl<E: fmt::Debug + fmt::Display> std::error::Error for RankError<E> {}

fn panic_message(p: &(dyn Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "a non-string panic payload".into()
    }
}
