//! TCP communicator tests: bitwise the thread communicator's results (collectives and a TP model
//! forward), and every failure ends every rank's wait with an error naming the culprit, in
//! well under a second or within the configured time-outs (each test runs under a watchdog).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::comm::*;
use super::tcp::*;
use super::TpError;

/// Runs `f` on another thread and fails the test if it takes longer than 30 s (a hang).
fn within<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(30))
        .expect("collectives hung (no result within 30 s)")
}

/// Connects to `addr` and sends a well-formed hand-made hello of `rank` of `world` for `job`.
fn hello(addr: std::net::SocketAddr, rank: u32, world: u32, job: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    let mut p = b"RPLXTP01".to_vec();
    p.extend_from_slice(&rank.to_le_bytes());
    p.extend_from_slice(&world.to_le_bytes());
    p.extend_from_slice(&(job.len() as u32).to_le_bytes());
    p.extend_from_slice(job.as_bytes());
    let mut f = ((p.len() + 1) as u64).to_le_bytes().to_vec();
    f.push(1);
    f.extend_from_slice(&p);
    s.write_all(&f).unwrap();
    s
}

/// The kind and payload (as text) of the next frame on a hand-made connection.
fn answer(s: &mut TcpStream) -> (u8, String) {
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut len = [0u8; 8];
    s.read_exact(&mut len).unwrap();
    let mut f = vec![0u8; u64::from_le_bytes(len) as usize];
    s.read_exact(&mut f).unwrap();
    (f[0], String::from_utf8_lossy(&f[1..]).into_owned())
}

fn fast() -> TcpOptions {
    TcpOptions {
        connect_timeout: Duration::from_secs(10),
        heartbeat: Duration::from_millis(50),
        dead_after: Duration::from_secs(5),
        collective_timeout: None,
    }
}

/// Every collective, 40 rounds, on values where the summation order shows (1e8 + 1 - 1e8), with
/// NaN for Max, uneven gathers and broadcasts from every root: what each rank ends with, as bits.
fn workload<C: Communicator>(c: &C) -> Result<Vec<u64>, TpError> {
    let (r, w) = (c.rank(), c.world());
    let mut out = Vec::new();
    for round in 0..40u32 {
        let x = |i: usize| -> f32 {
            match (r + i + round as usize) % 4 {
                0 => 1e8,
                1 => 1.0,
                2 => -1e8,
                _ => 0.1 * (r as f32 + 1.0) + i as f32,
            }
        };
        let mut a: Vec<f32> = (0..7).map(x).collect();
        c.all_reduce_sum(&mut a)?;
        out.extend(a.iter().map(|v| v.to_bits() as u64));
        let mut m: Vec<f64> = (0..3)
            .map(|i| {
                if (r + i) % 2 == 0 {
                    f64::NAN
                } else {
                    (r * 10 + i) as f64 - round as f64
                }
            })
            .collect();
        c.all_reduce(&mut m, ReduceOp::Max)?;
        out.extend(m.iter().map(|v| v.to_bits()));
        let mut g = vec![0f64; 2 * w];
        c.all_gather(&[r as f64 + 0.5, -(round as f64)], &mut g)?;
        out.extend(g.iter().map(|v| v.to_bits()));
        let counts: Vec<usize> = (0..w).map(|k| 1 + (k + round as usize) % 3).collect();
        let mine: Vec<f32> = (0..counts[r]).map(|i| (r * 100 + i) as f32 / 3.0).collect();
        let u = all_gather_uneven(c, &mine, &counts)?;
        out.extend(u.iter().map(|v| v.to_bits() as u64));
        let root = round as usize % w;
        let mut b = vec![r as f32; 5];
        c.broadcast(&mut b, root)?;
        out.extend(b.iter().map(|v| v.to_bits() as u64));
        c.barrier()?;
    }
    Ok(out)
}

#[test]
fn tcp_collectives_are_bitwise_the_thread_communicators() {
    for world in [1, 2, 3, 4] {
        let threads = within(move || run_ranks(world, workload)).unwrap();
        let tcp: Vec<Vec<u64>> = within(move || run_ranks_tcp(world, fast(), workload))
            .unwrap()
            .into_iter()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(tcp.len(), world);
        for r in 0..world {
            assert_eq!(tcp[r], threads[r], "world {world}, rank {r}");
            // replicated results are the same bits on every rank (broadcast/gather/reduce)
        }
        // the rank-order sum: rank 0's first element at round 0 is 1e8 + 1 (+ -1e8 ...)
        if world == 3 {
            assert_eq!(f32::from_bits(tcp[0][0] as u32), 0.0);
        }
    }
}

/// The tiny TP model (4 query / 2 kv heads, vocabulary 300): a text prompt's full logits at TP
/// 2 and 4 over TCP are bitwise those over threads.
#[test]
fn tp_forward_over_tcp_is_bitwise_the_threaded_forward() {
    use crate::model::{Prompt, Qwen25VL};
    let mut spec = crate::model::tests::tiny_spec(false);
    spec.vision.num_heads = 4;
    let full = Qwen25VL::random(spec, 5).unwrap();
    let ids: Vec<u32> = vec![1, 17, 45, 299, 3, 150, 7, 8];
    for t in [2usize, 4] {
        let models = super::shard_all(&full, t).unwrap();
        let (m1, i1) = (models.clone(), ids.clone());
        let threads = within(move || {
            run_ranks(t, |c: &ThreadComm| -> Result<Vec<f32>, TpError> {
                let m = &m1[c.rank()];
                let l = m.as_rank().forward_logits(
                    c,
                    Prompt {
                        ids: &i1,
                        media: &[],
                    },
                )?;
                Ok(m.as_rank().gather_logits(c, &l)?)
            })
        })
        .unwrap();
        let (m2, i2) = (models, ids.clone());
        let tcp = within(move || {
            run_ranks_tcp(t, fast(), |c: &TcpComm| -> Result<Vec<f32>, TpError> {
                let m = &m2[c.rank()];
                let l = m.as_rank().forward_logits(
                    c,
                    Prompt {
                        ids: &i2,
                        media: &[],
                    },
                )?;
                Ok(m.as_rank().gather_logits(c, &l)?)
            })
        })
        .unwrap();
        for (r, res) in tcp.into_iter().enumerate() {
            let res = res.unwrap();
            assert_eq!(res.len(), ids.len() * 300);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&res), bits(&threads[r]), "TP {t}, rank {r}");
        }
    }
}

fn errors_of<R: std::fmt::Debug>(res: Vec<Result<R, TpError>>) -> Vec<CommError> {
    res.into_iter()
        .map(|r| match r {
            Err(TpError::Comm(e)) => e,
            other => panic!("expected a communicator error, got {other:?}"),
        })
        .collect()
}

#[test]
fn a_rank_that_errors_is_named_on_every_rank() {
    let res = within(|| {
        run_ranks_tcp(3, fast(), |c: &TcpComm| -> Result<(), TpError> {
            c.barrier()?;
            if c.rank() == 2 {
                return Err(TpError::Config("rank 2 ran out of data".into()));
            }
            let mut b = vec![1f32; 4];
            c.all_reduce_sum(&mut b)?;
            Ok(())
        })
    })
    .unwrap();
    assert!(matches!(&res[2], Err(TpError::Config(_))));
    for r in [0, 1] {
        match &res[r] {
            Err(TpError::Comm(CommError::PeerFailed { rank: 2, reason })) => {
                assert!(reason.contains("ran out of data"), "{reason}")
            }
            other => panic!("rank {r}: {other:?}"),
        }
    }
}

#[test]
fn a_severed_rank_ends_the_group_at_once_naming_it() {
    // a killed process: its sockets close without a goodbye; rank 0 sees it first and tells rank 2
    for victim in [1usize, 0] {
        let t0 = Instant::now();
        let res = within(move || {
            run_ranks_tcp(3, fast(), move |c: &TcpComm| -> Result<(), TpError> {
                c.barrier()?;
                if c.rank() == victim {
                    c.sever();
                    return Ok(());
                }
                let mut b = vec![1f32; 4];
                c.all_reduce_sum(&mut b)?;
                Ok(())
            })
        })
        .unwrap();
        // well under dead_after (5 s): end of stream is seen at once
        assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());
        for (r, e) in res.into_iter().enumerate() {
            if r == victim {
                assert!(e.is_ok());
                continue;
            }
            match e {
                Err(TpError::Comm(CommError::PeerFailed { rank, reason })) => {
                    assert_eq!(rank, victim, "rank {r}: {reason}");
                    assert!(reason.contains("without a goodbye"), "{reason}");
                }
                other => panic!("rank {r}: {other:?}"),
            }
        }
    }
}

#[test]
fn a_rank_that_leaves_early_or_calls_another_collective_is_named() {
    let res = within(|| {
        run_ranks_tcp(3, fast(), |c: &TcpComm| -> Result<(), TpError> {
            c.barrier()?;
            if c.rank() == 1 {
                return Ok(());
            }
            c.barrier()?;
            Ok(())
        })
    })
    .unwrap();
    let errs: Vec<_> = [0, 2]
        .iter()
        .map(|&r| res[r].as_ref().unwrap_err().to_string())
        .collect();
    for e in &errs {
        assert!(
            e.contains("rank 1 exited before joining collective #1 (barrier)"),
            "{e}"
        );
    }
    let res = within(|| {
        run_ranks_tcp(2, fast(), |c: &TcpComm| -> Result<(), TpError> {
            if c.rank() == 1 {
                let mut b = vec![0f32; 3];
                c.all_reduce_sum(&mut b)?;
            } else {
                c.barrier()?;
            }
            Ok(())
        })
    })
    .unwrap();
    for e in errors_of(res) {
        match e {
            CommError::Mismatch {
                seq: 0,
                rank_a: 0,
                a,
                rank_b: 1,
                b,
            } => {
                assert_eq!(a, "barrier");
                assert_eq!(b, "all_reduce(Sum) of 3 f32");
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn a_late_rank_times_out_the_group_naming_it() {
    let opts = TcpOptions {
        collective_timeout: Some(Duration::from_millis(200)),
        ..fast()
    };
    let res = within(move || {
        run_ranks_tcp(3, opts, |c: &TcpComm| -> Result<(), TpError> {
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_millis(1500));
            }
            c.barrier()?;
            Ok(())
        })
    })
    .unwrap();
    for r in [0, 2] {
        match &res[r] {
            Err(TpError::Comm(CommError::Timeout { missing, .. })) => {
                assert_eq!(missing, &vec![1], "rank {r}")
            }
            other => panic!("rank {r}: {other:?}"),
        }
    }
    // the late rank finds the group failed when it arrives
    assert!(
        matches!(&res[1], Err(TpError::Comm(CommError::Timeout { missing, .. })) if missing == &vec![1]),
        "{:?}",
        res[1]
    );
}

/// A frozen process: its socket stays open but nothing arrives, not even heartbeats.
#[test]
fn a_silent_rank_is_declared_dead_after_the_heartbeat_limit() {
    let opts = TcpOptions {
        dead_after: Duration::from_millis(400),
        ..fast()
    };
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let t0 = Instant::now();
    let res = within(move || {
        // a hand-made hello of rank 1 of 2 for job "j", then silence
        let s = hello(addr, 1, 2, "j");
        let c = TcpComm::serve(listener, 2, "j", vec![], opts).unwrap();
        let r = c.barrier();
        drop(s);
        r
    });
    match res {
        Err(CommError::PeerFailed { rank: 1, reason }) => {
            assert!(
                reason.contains("no message or heartbeat for 400ms"),
                "{reason}"
            )
        }
        other => panic!("{other:?}"),
    }
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}

#[test]
fn rendezvous_refuses_another_job_and_names_missing_ranks() {
    // rank 1 of another job is refused, naming the rank and both jobs; rank 0 waits on for its
    // own rank 1 and, when it never comes, names it and the refused connection
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let short = TcpOptions {
        connect_timeout: Duration::from_millis(500),
        ..fast()
    };
    let (a, b) = within(move || {
        let h = std::thread::spawn(move || TcpComm::serve(listener, 2, "plan-a", vec![], short));
        let b = TcpComm::connect(&addr, 1, 2, "plan-b", fast());
        (h.join().unwrap(), b)
    });
    let a = a.unwrap_err().to_string();
    let b = b.unwrap_err().to_string();
    assert!(
        a.contains("ranks [1] of 2 did not connect")
            && a.contains("refused meanwhile: rank 1")
            && a.contains("\"plan-b\"")
            && a.contains("\"plan-a\""),
        "{a}"
    );
    assert!(
        b.contains("refused the group") && b.contains("\"plan-b\""),
        "{b}"
    );

    // ranks 2 and 3 of 4 never come: rank 0 and rank 1 both learn which
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let opts = TcpOptions {
        connect_timeout: Duration::from_millis(500),
        ..fast()
    };
    let o2 = opts.clone();
    let (a, b) = within(move || {
        let h = std::thread::spawn(move || TcpComm::serve(listener, 4, "j", vec![], o2));
        let b = TcpComm::connect(&addr, 1, 4, "j", opts);
        (h.join().unwrap(), b)
    });
    for e in [a.unwrap_err().to_string(), b.unwrap_err().to_string()] {
        assert!(e.contains("ranks [2, 3] of 4 did not connect"), "{e}");
    }

    // nobody listens: a bounded wait, then a message saying where it looked
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let opts = TcpOptions {
        connect_timeout: Duration::from_millis(300),
        ..fast()
    };
    let e = within(move || TcpComm::connect(&format!("127.0.0.1:{port}"), 1, 2, "j", opts))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("could not reach rank 0") && e.contains("MASTER_ADDR"),
        "{e}"
    );
}

#[test]
fn the_unique_id_reaches_every_rank() {
    let res = within(|| {
        run_ranks_tcp(3, fast(), |c: &TcpComm| -> Result<Vec<u8>, TpError> {
            Ok(c.unique_id().to_vec())
        })
    })
    .unwrap();
    for r in res {
        assert_eq!(r.unwrap(), b"unique-id".to_vec());
    }
}

#[test]
fn strangers_on_the_rendezvous_port_are_ignored() {
    // a connection that closes at once and one that sends garbage come before rank 1
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (a, b) = within(move || {
        drop(TcpStream::connect(addr).unwrap());
        let mut junk = TcpStream::connect(addr).unwrap();
        junk.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        let h = std::thread::spawn(move || TcpComm::serve(listener, 2, "j", vec![7], fast()));
        let b = TcpComm::connect(&addr.to_string(), 1, 2, "j", fast());
        let a = h.join().unwrap();
        drop(junk);
        (a, b)
    });
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(b.unique_id(), &[7]);
    let res = within(move || {
        let h = std::thread::spawn(move || {
            let mut x = vec![1f32, 2.0];
            a.all_reduce_sum(&mut x).map(|_| x)
        });
        let mut y = vec![10f32, 20.0];
        b.all_reduce_sum(&mut y).unwrap();
        (h.join().unwrap().unwrap(), y)
    });
    assert_eq!(res, (vec![11.0, 22.0], vec![11.0, 22.0]));
}

/// Well-formed hellos that are not of this group (another job, another world size, a rank out
/// of range, a second rank 1) are each refused, and the group still forms with its real ranks.
#[test]
fn strangers_with_a_valid_hello_do_not_abort_the_rendezvous() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let res = within(move || {
        // queued before rank 0 accepts, so they are read in this order
        let mut strangers = vec![
            hello(addr, 1, 3, "another-job"),
            hello(addr, 1, 4, "j"),
            hello(addr, 7, 3, "j"),
        ];
        let mut first = hello(addr, 1, 3, "j");
        strangers.push(hello(addr, 1, 3, "j"));
        let h = std::thread::spawn(move || TcpComm::serve(listener, 3, "j", vec![9], fast()));
        let refusals: Vec<(u8, String)> = strangers.iter_mut().map(answer).collect();
        // the real rank 2 arrives after all of them
        let two = TcpComm::connect(&addr.to_string(), 2, 3, "j", fast());
        let welcome = answer(&mut first);
        let zero = h.join().unwrap();
        (
            refusals,
            welcome.0,
            zero.map(|c| c.world()),
            two.map(|c| c.unique_id().to_vec()),
        )
    });
    let (refusals, welcome, zero, two) = res;
    let why: Vec<&str> = refusals
        .iter()
        .map(|(k, w)| {
            assert_eq!(*k, 3, "a refusal is a REJECT frame: {w}");
            w.as_str()
        })
        .collect();
    assert!(why[0].contains("\"another-job\""), "{}", why[0]);
    assert!(why[1].contains("world size 4"), "{}", why[1]);
    assert!(why[2].contains("rank 7"), "{}", why[2]);
    assert!(
        why[3].contains("two processes say they are rank 1"),
        "{}",
        why[3]
    );
    assert_eq!(welcome, 2, "the first rank 1 is welcomed");
    assert_eq!(zero.unwrap(), 3);
    assert_eq!(two.unwrap(), vec![9]);
}
