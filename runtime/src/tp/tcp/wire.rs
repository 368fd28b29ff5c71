//! The wire format of [`super::TcpComm`]: frames (`u64 length (LE) | u8 kind | payload`), the
//! payloads' integers, strings and error values, and buffers as their elements' little-endian
//! bytes (bit-exact).

use std::io::{self, Read, Write};
use std::time::Duration;

use crate::tp::comm::{CommError, Elem};

/// First bytes of a hello: the protocol and its version.
pub(super) const MAGIC: &[u8; 8] = b"RPLXTP01";
/// Largest frame accepted (a corrupt length must not allocate the machine away).
pub(super) const MAX_FRAME: u64 = 1 << 34;

pub(super) mod kind {
    pub const HELLO: u8 = 1;
    pub const WELCOME: u8 = 2;
    pub const REJECT: u8 = 3;
    pub const HEARTBEAT: u8 = 4;
    pub const DEPOSIT: u8 = 5;
    pub const RESULT: u8 = 6;
    pub const FAIL: u8 = 7;
    pub const BYE: u8 = 8;
}

pub(super) fn rdv(msg: String) -> CommError {
    CommError::Rendezvous(msg)
}

pub(super) fn protocol(msg: String) -> CommError {
    CommError::Invalid(format!("tensor-parallel protocol: {msg}"))
}

pub(super) fn write_frame(w: &mut impl Write, kind: u8, payload: &[u8]) -> io::Result<()> {
    let mut buf = Vec::with_capacity(9 + payload.len());
    buf.extend_from_slice(&(payload.len() as u64 + 1).to_le_bytes());
    buf.push(kind);
    buf.extend_from_slice(payload);
    w.write_all(&buf)?;
    w.flush()
}

pub(super) fn read_frame(r: &mut impl Read) -> io::Result<(u8, Vec<u8>)> {
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
pub(super) struct Put(pub(super) Vec<u8>);

impl Put {
    pub(super) fn u32(mut self, v: usize) -> Self {
        self.0.extend_from_slice(&(v as u32).to_le_bytes());
        self
    }
    pub(super) fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(super) fn bytes(self, b: &[u8]) -> Self {
        let mut s = self.u32(b.len());
        s.0.extend_from_slice(b);
        s
    }
    pub(super) fn str(self, s: &str) -> Self {
        self.bytes(s.as_bytes())
    }
    pub(super) fn raw(mut self, b: &[u8]) -> Self {
        self.0.extend_from_slice(b);
        self
    }
}

/// Reads payloads; running out of bytes is a protocol error.
pub(super) struct Get<'a>(pub(super) &'a [u8]);

impl<'a> Get<'a> {
    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8], CommError> {
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
    pub(super) fn u32(&mut self) -> Result<usize, CommError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
    }
    pub(super) fn u64(&mut self) -> Result<u64, CommError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    pub(super) fn bytes(&mut self) -> Result<&'a [u8], CommError> {
        let n = self.u32()?;
        self.take(n)
    }
    pub(super) fn str(&mut self) -> Result<String, CommError> {
        Ok(String::from_utf8_lossy(self.bytes()?).into_owned())
    }
    pub(super) fn rest(self) -> &'a [u8] {
        self.0
    }
}

/// A [`CommError`] as a `FAIL` payload.
pub(super) fn encode_error(e: &CommError) -> Vec<u8> {
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

pub(super) fn decode_error(b: &[u8]) -> Result<CommError, CommError> {
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

pub(super) fn encode<T: Elem>(v: &[T]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * T::BYTES);
    for &x in v {
        x.put_le(&mut out);
    }
    out
}

pub(super) fn decode_into<T: Elem>(b: &[u8], out: &mut [T]) -> Result<(), CommError> {
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

pub(super) fn decode<T: Elem>(b: &[u8], n: usize) -> Result<Vec<T>, CommError> {
    if b.len() != n * T::BYTES {
        return Err(protocol(format!(
            "{} bytes for {n} {} elements",
            b.len(),
            T::DTYPE
        )));
    }
    Ok(b.chunks_exact(T::BYTES).map(T::get_le).collect())
}
