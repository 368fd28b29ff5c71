//! SIGINT and SIGTERM during a training run: the run stops at the next iteration boundary, after
//! saving a checkpoint there (when the run can save one), instead of dying mid-step and losing
//! every iteration since the last `--save-every`. A second signal is not caught: it ends the
//! process at once, as without this.

use std::sync::atomic::{AtomicBool, Ordering};

static REQUESTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(sig: libc::c_int) {
    REQUESTED.store(true, Ordering::SeqCst);
    // SAFETY: signal(2) is async-signal-safe; restoring the default makes a second signal fatal.
    unsafe {
        libc::signal(sig, libc::SIG_DFL);
    }
}

/// Catches SIGINT and SIGTERM for the rest of the process (see the module doc).
pub(super) fn install() {
    let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handler only stores to an atomic and calls signal(2), both async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
    }
}

/// Whether a stop was asked for since [`install`].
pub(super) fn requested() -> bool {
    REQUESTED.load(Ordering::SeqCst)
}
