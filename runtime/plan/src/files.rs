//! Reading the files a user names, with bounds, and writing files whole or not at all.
//!
//! Every file the compiler and the runtime read on a user's word (a pipeline, a plan, a profile,
//! a checkpoint's `config.json`, a dataset, weights) goes through [`open_regular`] and, when read
//! whole, [`read`] / [`read_to_string`] with a size cap; a streamed text file goes line by line
//! through [`read_line_capped`].
//!
//! Invariants:
//! - Only regular files are read: the path's metadata is checked before it is opened, so a FIFO
//!   (whose `open` would block until a writer comes) or a device such as `/dev/zero` (endless) is
//!   an error, never a hang or an exhausted memory.
//! - Memory stays bounded: a file over its cap is refused before it is read, and a file that
//!   grows while being read is cut at the cap and refused too. Errors say the size and the cap;
//!   callers add the path.
//! - [`write_atomic`] leaves either the old file or the whole new one, also across a crash: the
//!   bytes go to a temporary sibling, are synced, and the sibling is renamed over the target.

use std::fs::File;
use std::io::{BufRead, Read, Write};
use std::path::Path;

/// Cap on text files a user names: a pipeline, a `config.json`, a profile, a chat template.
pub const TEXT_CAP: u64 = 64 << 20;
/// Cap on a plan file, binary or YAML (the largest checked-in plan is well under 1 MiB).
pub const PLAN_CAP: u64 = 256 << 20;
/// Cap on one line of a streamed text file (a dataset record).
pub const LINE_CAP: usize = 16 << 20;
/// No cap beyond the regular-file rule (model weights: their size is the model's).
pub const NO_CAP: u64 = u64::MAX;

fn invalid(msg: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidInput, msg)
}

/// `n` bytes for people: `512 bytes`, `64 MiB`, `1.5 GiB`.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [(u64, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    for (size, unit) in UNITS {
        if n >= size {
            let v = n as f64 / size as f64;
            return if v.fract() == 0.0 {
                format!("{v:.0} {unit}")
            } else {
                format!("{v:.1} {unit}")
            };
        }
    }
    format!("{n} bytes")
}

/// What a non-regular file is, for the error.
fn file_kind(ft: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if ft.is_dir() {
        "a directory"
    } else if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_block_device() {
        "a block device"
    } else if ft.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// Opens `path` for reading if it is a regular file (symbolic links followed) of at most `cap`
/// bytes; returns the file and its size. Checked before opening, so a FIFO never blocks.
pub fn open_regular(path: &Path, cap: u64) -> std::io::Result<(File, u64)> {
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(invalid(format!(
            "{}, not a regular file; only regular files are read",
            file_kind(meta.file_type())
        )));
    }
    let file = File::open(path)?;
    // The same check on what was opened, in case the path changed in between.
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(invalid(format!(
            "{}, not a regular file; only regular files are read",
            file_kind(meta.file_type())
        )));
    }
    if meta.len() > cap {
        return Err(too_big(meta.len(), cap));
    }
    Ok((file, meta.len()))
}

fn too_big(len: u64, cap: u64) -> std::io::Error {
    invalid(format!(
        "{} ({len} bytes), over the cap of {} for this kind of file",
        human_bytes(len),
        human_bytes(cap)
    ))
}

/// The bytes of the regular file `path`, at most `cap` of them (see the module doc).
pub fn read(path: &Path, cap: u64) -> std::io::Result<Vec<u8>> {
    let (file, len) = open_regular(path, cap)?;
    let mut bytes = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    file.take(cap.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > cap {
        return Err(too_big(bytes.len() as u64, cap));
    }
    Ok(bytes)
}

/// The text of the regular file `path`, at most `cap` bytes of UTF-8 (see the module doc).
pub fn read_to_string(path: &Path, cap: u64) -> std::io::Result<String> {
    let bytes = read(path, cap)?;
    String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("not UTF-8 text (an invalid byte at offset {at})"),
        )
    })
}

/// One line of `r` without its `\n`, at most `cap` bytes; `None` at the end of the stream. A
/// longer line is an error naming the cap, and what was read of it is dropped, so memory stays
/// bounded whatever the other side writes.
pub fn read_line_capped(r: &mut impl BufRead, cap: usize) -> std::io::Result<Option<String>> {
    let mut buf = Vec::new();
    let n = r
        .by_ref()
        .take(cap as u64 + 1)
        .read_until(b'\n', &mut buf)?;
    if n == 0 {
        return Ok(None);
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
    } else if buf.len() > cap {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "a line longer than the cap of {cap} bytes ({})",
                human_bytes(cap as u64)
            ),
        ));
    }
    String::from_utf8(buf)
        .map(Some)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// Writes `bytes` to `path` whole or not at all: a temporary sibling (`.NAME.tmp-PID`), synced to
/// disk, renamed over `path`, then the directory synced so the rename itself lasts.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let name = path
        .file_name()
        .ok_or_else(|| invalid("not a file path".into()))?;
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result?;
    // Best effort: a directory that cannot be opened for syncing still holds the renamed file.
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// A key for "the same file" that works before a file exists: the canonical path of `path`
/// when it exists, else its canonical parent joined with its name (`None` when even the
/// parent does not exist).
fn file_key(path: &Path) -> Option<std::path::PathBuf> {
    if let Ok(p) = std::fs::canonicalize(path) {
        return Some(p);
    }
    let name = path.file_name()?;
    let parent = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    Some(std::fs::canonicalize(parent).ok()?.join(name))
}

/// Whether `a` and `b` name one file: the same canonical path, or (hard links) the same device
/// and inode.
pub fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    if let (Some(ka), Some(kb)) = (file_key(a), file_key(b)) {
        if ka == kb {
            return true;
        }
    }
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(ma), Ok(mb)) => ma.dev() == mb.dev() && ma.ino() == mb.ino(),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_fifos_and_directories_are_refused_before_reading() {
        let e = read(Path::new("/dev/zero"), TEXT_CAP)
            .unwrap_err()
            .to_string();
        assert!(e.contains("a character device, not a regular file"), "{e}");
        let e = read(Path::new("/"), TEXT_CAP).unwrap_err().to_string();
        assert!(e.contains("a directory"), "{e}");
        let dir = std::env::temp_dir().join(format!("rollplex-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo");
        let _ = std::fs::remove_file(&fifo);
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if made.is_ok_and(|s| s.success()) {
            // Opening a FIFO for reading would block until a writer comes: it must not be opened.
            let e = read_to_string(&fifo, TEXT_CAP).unwrap_err().to_string();
            assert!(e.contains("a FIFO"), "{e}");
        }
        let big = dir.join("big");
        std::fs::write(&big, vec![b'x'; 3000]).unwrap();
        let e = read(&big, 2048).unwrap_err().to_string();
        assert!(
            e.contains("2.9 KiB (3000 bytes)") && e.contains("cap of 2 KiB"),
            "{e}"
        );
        assert_eq!(read(&big, 3000).unwrap().len(), 3000);
        std::fs::write(&big, b"ok\xff").unwrap();
        let e = read_to_string(&big, 10).unwrap_err().to_string();
        assert!(e.contains("offset 2"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn lines_are_capped() {
        let mut r = std::io::Cursor::new(b"ab\ncd".to_vec());
        assert_eq!(read_line_capped(&mut r, 2).unwrap().as_deref(), Some("ab"));
        assert_eq!(read_line_capped(&mut r, 2).unwrap().as_deref(), Some("cd"));
        assert_eq!(read_line_capped(&mut r, 2).unwrap(), None);
        let mut r = std::io::Cursor::new(b"abc\n".to_vec());
        let e = read_line_capped(&mut r, 2).unwrap_err().to_string();
        assert!(e.contains("cap of 2 bytes"), "{e}");
    }

    #[test]
    fn atomic_writes_and_same_file() {
        let dir = std::env::temp_dir().join(format!("rollplex-atomic-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.txt");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            1,
            "no temporary left"
        );
        assert!(same_file(&p, &dir.join(".").join("a.txt")));
        let link = dir.join("b.txt");
        std::fs::hard_link(&p, &link).unwrap();
        assert!(same_file(&p, &link), "hard links are one file");
        assert!(
            same_file(&dir.join("new"), &dir.join("./new")),
            "before they exist"
        );
        assert!(!same_file(&p, &dir.join("new")));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
