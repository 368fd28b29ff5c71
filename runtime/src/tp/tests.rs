//! Communicator tests: rank-order reduction, every collective, and failures that must end every
//! rank's wait with an error naming the culprit (each test fails instead of hanging: it runs
//! under a watchdog).

use std::sync::mpsc;
use std::time::Duration;

use super::comm::*;
use super::TpError;

/// Runs `f` on another thread and fails the test if it takes longer than 20 s (a hang).
fn within<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(20))
        .expect("collectives hung (no result within 20 s)")
}

#[test]
fn all_reduce_sums_in_rank_order_and_equal_on_every_rank() {
    // f32: (1e8 + 1) + -1e8 = 0 (1 is absorbed), any other order that adds -1e8 first gives 1
    let out = within(|| {
        run_ranks(3, |c: &ThreadComm| -> Result<Vec<f32>, TpError> {
            let mut b = match c.rank() {
                0 => vec![1e8f32, 2.0],
                1 => vec![1.0, 3.0],
                _ => vec![-1e8, 4.0],
            };
            c.all_reduce_sum(&mut b)?;
            Ok(b)
        })
    })
    .unwrap();
    for r in &out {
        assert_eq!(r, &vec![0.0, 9.0]);
    }
    let max = within(|| {
        run_ranks(4, |c: &ThreadComm| -> Result<Vec<f64>, TpError> {
            let mut b = vec![c.rank() as f64, -(c.rank() as f64), f64::NAN];
            if c.rank() == 2 {
                b[2] = 7.0;
            }
            c.all_reduce(&mut b, ReduceOp::Max)?;
            Ok(b)
        })
    })
    .unwrap();
    for r in &max {
        assert_eq!(r, &vec![3.0, 0.0, 7.0]);
    }
}

#[test]
fn gather_broadcast_barrier_and_uneven_gather() {
    let out = within(|| {
        run_ranks(3, |c: &ThreadComm| -> Result<_, TpError> {
            let r = c.rank() as f32;
            let mut g = vec![0f32; 6];
            c.all_gather(&[r, 10.0 + r], &mut g)?;
            let mut b = vec![r; 2];
            c.broadcast(&mut b, 2)?;
            c.barrier()?;
            let counts = [1, 3, 2];
            let mine: Vec<f32> = (0..counts[c.rank()])
                .map(|i| 100.0 * r + i as f32)
                .collect();
            let u = all_gather_uneven(c, &mine, &counts)?;
            Ok((g, b, u))
        })
    })
    .unwrap();
    for (g, b, u) in &out {
        assert_eq!(g, &vec![0.0, 10.0, 1.0, 11.0, 2.0, 12.0]);
        assert_eq!(b, &vec![2.0, 2.0]);
        assert_eq!(u, &vec![0.0, 100.0, 101.0, 102.0, 200.0, 201.0]);
    }
}

#[test]
fn many_collectives_in_a_row_stay_in_step() {
    // fast ranks run ahead into the next collective while slow ones still read the last
    let out = within(|| {
        run_ranks(4, |c: &ThreadComm| -> Result<f32, TpError> {
            let mut acc = 0f32;
            for i in 0..500 {
                let mut b = [(c.rank() * 1000 + i) as f32];
                c.all_reduce_sum(&mut b)?;
                acc += b[0];
            }
            Ok(acc)
        })
    })
    .unwrap();
    let want: f32 = (0..500)
        .map(|i| (0..4).map(|r| (r * 1000 + i) as f32).sum::<f32>())
        .sum();
    assert!(out.iter().all(|&a| a == want), "{out:?} vs {want}");
}

#[test]
fn a_rank_that_errors_fails_the_others_with_its_rank() {
    let res = within(|| {
        run_ranks(3, |c: &ThreadComm| -> Result<(), TpError> {
            if c.rank() == 1 {
                return Err(TpError::Config("rank one's input is bad".into()));
            }
            let mut b = [1f32];
            c.all_reduce_sum(&mut b)?;
            c.barrier()?;
            Ok(())
        })
    });
    let e = res.unwrap_err();
    assert_eq!(e.rank, 1, "{e}");
    assert!(e.to_string().contains("rank one's input is bad"), "{e}");
    // the peers' own errors name rank 1
    let comms = ThreadComm::group(2).unwrap();
    let mut it = comms.into_iter();
    let (c0, c1) = (it.next().unwrap(), it.next().unwrap());
    let h = std::thread::spawn(move || {
        let mut b = [0f32];
        c0.all_reduce_sum(&mut b)
    });
    c1.abort("out of memory");
    let err = h.join().unwrap().unwrap_err();
    assert_eq!(
        err,
        CommError::PeerFailed {
            rank: 1,
            reason: "out of memory".into()
        }
    );
    assert_eq!(
        err.to_string(),
        "tensor-parallel rank 1 failed: out of memory"
    );
}

#[test]
fn a_rank_that_panics_fails_the_others_instead_of_hanging() {
    let res = within(|| {
        run_ranks(4, |c: &ThreadComm| -> Result<(), TpError> {
            let mut b = [1f32];
            c.all_reduce_sum(&mut b)?;
            if c.rank() == 2 {
                panic!("boom on two");
            }
            c.all_reduce_sum(&mut b)?;
            Ok(())
        })
    });
    let e = res.unwrap_err();
    assert_eq!(e.rank, 2, "{e}");
    let s = e.to_string();
    assert!(s.contains("panicked: boom on two"), "{s}");
    // a handle dropped while panicking (threads spawned by hand) fails the group too
    let mut comms = ThreadComm::group(2).unwrap();
    let c1 = comms.pop().unwrap();
    let c0 = comms.pop().unwrap();
    let h = std::thread::spawn(move || {
        let _c = c1;
        panic!("worker died");
    });
    assert!(h.join().is_err());
    let err = within(move || c0.barrier()).unwrap_err();
    assert_eq!(
        err,
        CommError::PeerFailed {
            rank: 1,
            reason: "panicked".into()
        }
    );
}

#[test]
fn a_rank_that_leaves_early_or_calls_another_collective_is_named() {
    let e = within(|| {
        run_ranks(3, |c: &ThreadComm| -> Result<(), TpError> {
            if c.rank() == 0 {
                return Ok(()); // forgets the collective
            }
            c.barrier()?;
            Ok(())
        })
    })
    .unwrap_err();
    assert!(
        matches!(
            e.error,
            TpError::Comm(CommError::PeerExited { rank: 0, .. })
        ),
        "{e}"
    );
    let e = within(|| {
        run_ranks(2, |c: &ThreadComm| -> Result<(), TpError> {
            let mut b = [0f32; 4];
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_millis(50));
                let mut g = [0f32; 8];
                c.all_gather(&b, &mut g)?;
            } else {
                c.all_reduce_sum(&mut b)?;
            }
            Ok(())
        })
    })
    .unwrap_err();
    let s = e.to_string();
    assert!(
        s.contains("rank 0 called all_reduce(Sum) of 4 f32, rank 1 called all_gather of 4 f32"),
        "{s}"
    );
}

#[test]
fn a_late_rank_times_out_the_group() {
    let comms = ThreadComm::group_with_timeout(2, Some(Duration::from_millis(100))).unwrap();
    let mut it = comms.into_iter();
    let (c0, c1) = (it.next().unwrap(), it.next().unwrap());
    let late = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(400));
        c1.barrier()
    });
    let err = within(move || c0.barrier()).unwrap_err();
    assert!(
        matches!(&err, CommError::Timeout { missing, .. } if missing == &vec![1]),
        "{err}"
    );
    let late_err = late.join().unwrap().unwrap_err();
    assert!(
        matches!(late_err, CommError::PeerFailed { rank: 1, .. }),
        "{late_err}"
    );
}

#[test]
fn bad_arguments_are_errors() {
    assert!(ThreadComm::group(0).is_err());
    let c = ThreadComm::group(1).unwrap().pop().unwrap();
    let mut g = [0f32; 3];
    assert!(matches!(
        c.all_gather(&[1.0], &mut g),
        Err(CommError::Invalid(_))
    ));
    assert!(matches!(c.broadcast(&mut g, 1), Err(CommError::Invalid(_))));
    // a single rank: collectives are the identity
    let mut b = [1.5f32, -2.0];
    c.all_reduce_sum(&mut b).unwrap();
    assert_eq!(b, [1.5, -2.0]);
}
