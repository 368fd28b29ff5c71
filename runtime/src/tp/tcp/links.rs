//! A [`super::TcpComm`]'s sockets: one reader thread per socket turning frames into events,
//! one heartbeat thread for all of them, and the socket options both rely on.

use std::io;
use std::net::TcpStream;
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::wire::{kind, rdv, read_frame, write_frame};
use super::TcpOptions;
use crate::tp::comm::CommError;

/// What a reader thread reports about its socket.
pub(super) enum Event {
    Frame(u8, Vec<u8>),
    /// The connection ended: end of stream, a reset, or silence for `dead_after`.
    Closed(String),
}

/// One socket to a peer; `w` is shared with the heartbeat thread.
pub(super) struct Link {
    pub(super) peer: usize,
    pub(super) w: Arc<Mutex<TcpStream>>,
}

impl Link {
    pub(super) fn send(&self, kind: u8, payload: &[u8]) -> io::Result<()> {
        let mut w = self.w.lock().unwrap_or_else(|e| e.into_inner());
        write_frame(&mut *w, kind, payload)
    }
}

/// Reads frames off `stream` into `tx` until the connection ends (reported as `Closed`).
pub(super) fn spawn_reader(
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
pub(super) fn spawn_heartbeat(
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

pub(super) fn prepare(s: &TcpStream, opts: &TcpOptions) -> io::Result<()> {
    s.set_nonblocking(false)?;
    s.set_nodelay(true)?;
    s.set_write_timeout(Some(opts.dead_after))?;
    s.set_read_timeout(Some(opts.connect_timeout))
}
