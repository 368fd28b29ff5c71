//! A small pool of host threads that score rewards while the accelerator keeps decoding.
//!
//! The executors hand a group's scoring to the pool as soon as the group has finished decoding
//! and collect the result at the plan's reward task (`exec::rewards`). The pool only runs
//! closures: what they compute is the caller's business; it knows nothing of tokens or plans.
//!
//! Invariant: submitting never blocks (a full queue hands the work back, to be run by the
//! caller or submitted later), a panic inside the work comes back as an error through its
//! [`Ticket`], never as a hang; dropping the pool lets queued work finish and joins the threads.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

/// A unit of work for the pool.
pub type Work<T> = Box<dyn FnOnce() -> T + Send>;

struct Job<T> {
    work: Work<T>,
    reply: Sender<Done<Result<T, String>>>,
}

/// A finished job: its value, when it ran and on which worker.
pub struct Done<T> {
    pub value: T,
    pub start: Instant,
    pub end: Instant,
    pub worker: usize,
}

/// Where a submitted job's [`Done`] arrives.
pub struct Ticket<T>(Receiver<Done<Result<T, String>>>);

impl<T> Ticket<T> {
    /// Waits for the job. An error when the work panicked or the pool is gone before running
    /// it (both say so).
    pub fn wait(self) -> Result<Done<T>, String> {
        let done = self
            .0
            .recv()
            .map_err(|_| "the reward worker stopped before it ran this group".to_string())?;
        match done.value {
            Ok(value) => Ok(Done {
                value,
                start: done.start,
                end: done.end,
                worker: done.worker,
            }),
            Err(msg) => Err(format!("the reward worker failed: {msg}")),
        }
    }
}

/// A fixed set of worker threads fed through one bounded queue.
pub struct RewardPool<T: Send + 'static> {
    jobs: Option<SyncSender<Job<T>>>,
    workers: Vec<JoinHandle<()>>,
}

impl<T: Send + 'static> RewardPool<T> {
    /// `workers` threads (at least 1) behind a queue of `capacity` jobs (at least 1).
    pub fn new(workers: usize, capacity: usize) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::sync_channel::<Job<T>>(capacity.max(1));
        let rx = Arc::new(Mutex::new(rx));
        let mut handles = Vec::new();
        for w in 0..workers.max(1) {
            let rx = Arc::clone(&rx);
            let h = std::thread::Builder::new()
                .name(format!("reward-{w}"))
                .spawn(move || worker(w, &rx))?;
            handles.push(h);
        }
        Ok(RewardPool {
            jobs: Some(tx),
            workers: handles,
        })
    }

    /// The default size for this machine: one thread per core but one (the loop's), 1 to 4.
    pub fn default_workers() -> usize {
        std::thread::available_parallelism()
            .map_or(1, |n| n.get().saturating_sub(1))
            .clamp(1, 4)
    }

    pub fn workers(&self) -> usize {
        self.workers.len()
    }

    /// Queues `work` and returns its ticket, or gives `work` back when the queue is full or
    /// the workers are gone (never blocks).
    pub fn try_submit(&self, work: Work<T>) -> Result<Ticket<T>, Work<T>> {
        let Some(jobs) = &self.jobs else {
            return Err(work);
        };
        let (reply, rx) = mpsc::channel();
        match jobs.try_send(Job { work, reply }) {
            Ok(()) => Ok(Ticket(rx)),
            Err(TrySendError::Full(job) | TrySendError::Disconnected(job)) => Err(job.work),
        }
    }
}

fn worker<T>(index: usize, jobs: &Mutex<Receiver<Job<T>>>) {
    loop {
        // hold the lock only to take one job
        let job = match jobs.lock() {
            Ok(rx) => rx.recv(),
            Err(_) => return,
        };
        let Ok(Job { work, reply }) = job else {
            return; // the pool was dropped
        };
        let start = Instant::now();
        let value = catch_unwind(AssertUnwindSafe(work)).map_err(|p| {
            p.downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into())
        });
        let end = Instant::now();
        // the caller may have stopped waiting (an iteration that failed): nothing to do
        let _ = reply.send(Done {
            value,
            start,
            end,
            worker: index,
        });
    }
}

impl<T: Send + 'static> Drop for RewardPool<T> {
    fn drop(&mut self) {
        self.jobs = None;
        for h in self.workers.drain(..) {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    #[test]
    fn jobs_run_on_workers_and_a_full_queue_gives_work_back() {
        let pool = RewardPool::<u32>::new(1, 1).unwrap();
        let gate = Arc::new(AtomicBool::new(false));
        let g = Arc::clone(&gate);
        // the worker takes this one and spins until the gate opens
        let first = pool
            .try_submit(Box::new(move || {
                while !g.load(Ordering::Acquire) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                1
            }))
            .ok()
            .unwrap();
        // fill the queue (the worker may not have taken the first job yet: then this one is
        // handed back at once)
        let mut queued = Vec::new();
        let mut back = None;
        for k in 2..5u32 {
            match pool.try_submit(Box::new(move || k)) {
                Ok(t) => queued.push((k, t)),
                Err(w) => {
                    back = Some(w);
                    break;
                }
            }
        }
        let back = back.expect("a queue of one job is full after two submissions");
        assert_eq!(
            back(),
            queued.len() as u32 + 2,
            "the work handed back is the one given"
        );
        gate.store(true, Ordering::Release);
        let done = first.wait().unwrap();
        assert_eq!(done.value, 1);
        assert!(done.end >= done.start);
        for (k, t) in queued {
            assert_eq!(t.wait().unwrap().value, k);
        }
    }

    #[test]
    fn a_panic_is_an_error_not_a_hang_and_the_worker_lives_on() {
        let pool = RewardPool::<u32>::new(1, 4).unwrap();
        let t = pool
            .try_submit(Box::new(|| panic!("bad input")))
            .ok()
            .unwrap();
        let e = t.wait().err().unwrap();
        assert!(e.contains("bad input"), "{e}");
        let t = pool.try_submit(Box::new(|| 7)).ok().unwrap();
        assert_eq!(t.wait().unwrap().value, 7);
        assert_eq!(pool.workers(), 1);
    }
}
