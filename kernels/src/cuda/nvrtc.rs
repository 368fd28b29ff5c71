//! Run-time compilation of the kernel sources (`kernels/cuda/*.cu`, embedded in the binary) with
//! NVRTC, straight to CUBIN for the device's architecture, cached on disk.
//!
//! Cache: `$ROLLPLEX_KERNEL_CACHE`, else `$XDG_CACHE_HOME/rollplex/kernels`, else
//! `~/.cache/rollplex/kernels`; one file `<module>-<key>.cubin` per compiled variant, the key a
//! 64-bit FNV-1a hash of (NVRTC version, architecture, options, full source). Files are written
//! to a temporary name and renamed, so concurrent processes never read a half-written file. A
//! cache that cannot be read or written only costs a recompile (the error is not fatal).

use std::ffi::{c_char, CStr, CString};
use std::path::PathBuf;

use cudarc::nvrtc::sys;

use super::{CudaError, Result};

/// One kernel source file: its name (for messages and cache files) and its text.
#[derive(Clone, Copy, Debug)]
pub struct KernelModule {
    pub name: &'static str,
    pub source: &'static str,
}

/// Helpers shared by every module, prepended to each source.
pub const COMMON: &str = include_str!("../../cuda/common.cuh");

pub const NORM: KernelModule = KernelModule {
    name: "norm",
    source: include_str!("../../cuda/norm.cu"),
};
pub const POINTWISE: KernelModule = KernelModule {
    name: "pointwise",
    source: include_str!("../../cuda/pointwise.cu"),
};
pub const ATTENTION: KernelModule = KernelModule {
    name: "attention",
    source: include_str!("../../cuda/attention.cu"),
};
pub const LOGPROBS: KernelModule = KernelModule {
    name: "logprobs",
    source: include_str!("../../cuda/logprobs.cu"),
};
pub const SAMPLING: KernelModule = KernelModule {
    name: "sampling",
    source: include_str!("../../cuda/sampling.cu"),
};
pub const ADAMW: KernelModule = KernelModule {
    name: "adamw",
    source: include_str!("../../cuda/adamw.cu"),
};
pub const DECODE_LOOP: KernelModule = KernelModule {
    name: "decode_loop",
    source: include_str!("../../cuda/decode_loop.cu"),
};

/// Every module, for tools that compile them all (the compile check, the workbench).
pub const ALL: [KernelModule; 7] = [
    NORM,
    POINTWISE,
    ATTENTION,
    LOGPROBS,
    SAMPLING,
    ADAMW,
    DECODE_LOOP,
];

/// A compiled variant: CUBIN bytes and what NVRTC said (ptxas register/spill report included).
#[derive(Clone, Debug)]
pub struct Compiled {
    pub cubin: Vec<u8>,
    pub log: String,
    pub from_cache: bool,
}

/// The NVRTC version as (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    // SAFETY: nvrtc_present() guards the library load (cudarc panics when it is missing).
    if !nvrtc_present() {
        return Err(CudaError::Unavailable(
            "libnvrtc (NVIDIA's run-time compiler) was not found".into(),
        ));
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| CudaError::Nvrtc(format!("nvrtcVersion: {e:?}")))?;
    Ok((major, minor))
}

/// Whether libnvrtc can be loaded (checked without panicking).
pub fn nvrtc_present() -> bool {
    // SAFETY: only probes whether the shared library can be opened.
    unsafe { sys::is_culib_present() }
}

/// For tests that compile kernels without a device: whether libnvrtc loads here; `false` after
/// printing `skipped: libnvrtc not found`, a panic with `ROLLPLEX_REQUIRE_GPU=1` (a GPU host has
/// it), as [`super::test_gpu`] does for devices.
#[cfg(test)]
pub(crate) fn nvrtc_or_skip() -> bool {
    if nvrtc_present() {
        return true;
    }
    if std::env::var(super::REQUIRE_GPU_VAR).is_ok_and(|v| v == "1") {
        panic!("{}=1 but libnvrtc was not found", super::REQUIRE_GPU_VAR);
    }
    println!("skipped: libnvrtc not found");
    false
}

/// 64-bit FNV-1a over several byte strings, each followed by a 0 separator.
pub fn fnv1a64(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in p.iter().chain(std::iter::once(&0u8)) {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// The cache directory, if one can be named (see the module doc).
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("ROLLPLEX_KERNEL_CACHE") {
        return Some(PathBuf::from(p));
    }
    if let Some(p) = std::env::var_os("XDG_CACHE_HOME").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p).join("rollplex").join("kernels"));
    }
    std::env::var_os("HOME").map(|h| {
        PathBuf::from(h)
            .join(".cache")
            .join("rollplex")
            .join("kernels")
    })
}

/// The options every module is compiled with, for architecture `arch` (e.g. `sm_90`), plus
/// `defines` (`("HEAD_DIM", 128)` becomes `-DHEAD_DIM=128`).
pub fn options(arch: &str, defines: &[(&str, u32)]) -> Vec<String> {
    let mut o = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "--ptxas-options=-v".to_string(),
        "-lineinfo".to_string(),
    ];
    o.extend(defines.iter().map(|(k, v)| format!("-D{k}={v}")));
    o
}

/// Compiles `module` (with [`COMMON`] prepended) for `arch`, or returns the cached CUBIN.
pub fn compile(module: &KernelModule, arch: &str, defines: &[(&str, u32)]) -> Result<Compiled> {
    let source = format!(
        "{COMMON}\n#line 1 \"{}.cu\"\n{}",
        module.name, module.source
    );
    let opts = options(arch, defines);
    let (major, minor) = nvrtc_version()?;
    let version = format!("{major}.{minor}");
    let joined = opts.join("\u{1}");
    let key = fnv1a64(&[
        version.as_bytes(),
        arch.as_bytes(),
        joined.as_bytes(),
        source.as_bytes(),
    ]);
    let file = cache_dir().map(|d| d.join(format!("{}-{key:016x}.cubin", module.name)));
    if let Some(f) = &file {
        if let Ok(cubin) = std::fs::read(f) {
            if !cubin.is_empty() {
                return Ok(Compiled {
                    cubin,
                    log: String::new(),
                    from_cache: true,
                });
            }
        }
    }
    let (cubin, log) = compile_uncached(module.name, &source, &opts)?;
    if let Some(f) = &file {
        // A cache write failure is not fatal: the next run compiles again.
        let _ = write_atomic(f, &cubin);
    }
    Ok(Compiled {
        cubin,
        log,
        from_cache: false,
    })
}

fn write_atomic(path: &PathBuf, bytes: &[u8]) -> Result<()> {
    let err = |source| CudaError::Cache {
        path: path.display().to_string(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

/// Compiles `source` with NVRTC to CUBIN. Returns the CUBIN and the compile log.
pub fn compile_uncached(name: &str, source: &str, opts: &[String]) -> Result<(Vec<u8>, String)> {
    if !nvrtc_present() {
        return Err(CudaError::Unavailable(
            "libnvrtc (NVIDIA's run-time compiler) was not found".into(),
        ));
    }
    let nv = |what: &str, e: sys::nvrtcResult| CudaError::Nvrtc(format!("{what} ({name}): {e:?}"));
    let src = CString::new(source)
        .map_err(|_| CudaError::Nvrtc(format!("{name}: source contains a NUL byte")))?;
    let cname = CString::new(format!("{name}.cu")).expect("module names hold no NUL");
    let copts: Vec<CString> = opts
        .iter()
        .map(|o| CString::new(o.as_str()).expect("options hold no NUL"))
        .collect();
    let popts: Vec<*const c_char> = copts.iter().map(|c| c.as_ptr()).collect();
    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: valid C strings that outlive the program; no headers are passed.
    let r = unsafe {
        sys::nvrtcCreateProgram(
            &mut prog,
            src.as_ptr(),
            cname.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    if r != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(nv("nvrtcCreateProgram", r));
    }
    struct Guard(sys::nvrtcProgram);
    impl Drop for Guard {
        fn drop(&mut self) {
            // SAFETY: the program was created above and is destroyed once.
            unsafe {
                sys::nvrtcDestroyProgram(&mut self.0);
            }
        }
    }
    let guard = Guard(prog);
    // SAFETY: the option pointers are valid for the duration of the call.
    let r = unsafe { sys::nvrtcCompileProgram(guard.0, popts.len() as i32, popts.as_ptr()) };
    let log = program_log(guard.0);
    if r != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(CudaError::Compile {
            name: name.to_string(),
            options: opts.to_vec(),
            log,
        });
    }
    let mut size = 0usize;
    // SAFETY: valid program and out-pointer.
    let r = unsafe { sys::nvrtcGetCUBINSize(guard.0, &mut size) };
    if r != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(nv(
            "nvrtcGetCUBINSize (the architecture must be a real sm_XX)",
            r,
        ));
    }
    let mut cubin = vec![0u8; size];
    // SAFETY: the buffer holds `size` bytes as NVRTC asked.
    let r = unsafe { sys::nvrtcGetCUBIN(guard.0, cubin.as_mut_ptr() as *mut c_char) };
    if r != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(nv("nvrtcGetCUBIN", r));
    }
    Ok((cubin, log))
}

fn program_log(prog: sys::nvrtcProgram) -> String {
    let mut size = 0usize;
    // SAFETY: valid program and out-pointer.
    if unsafe { sys::nvrtcGetProgramLogSize(prog, &mut size) } != sys::nvrtcResult::NVRTC_SUCCESS
        || size == 0
    {
        return String::new();
    }
    let mut buf = vec![0 as c_char; size];
    // SAFETY: the buffer holds `size` bytes as NVRTC asked.
    if unsafe { sys::nvrtcGetProgramLog(prog, buf.as_mut_ptr()) } != sys::nvrtcResult::NVRTC_SUCCESS
    {
        return String::new();
    }
    // SAFETY: NVRTC writes a NUL-terminated string of `size` bytes.
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv_separates_parts() {
        assert_ne!(fnv1a64(&[b"ab", b"c"]), fnv1a64(&[b"a", b"bc"]));
        assert_eq!(fnv1a64(&[b"x"]), fnv1a64(&[b"x"]));
    }

    #[test]
    fn options_carry_arch_and_defines() {
        let o = options("sm_90", &[("HEAD_DIM", 128)]);
        assert!(o.contains(&"--gpu-architecture=sm_90".to_string()));
        assert!(o.contains(&"-DHEAD_DIM=128".to_string()));
    }

    /// Compiles every kernel source for sm_90 when libnvrtc is present (no GPU needed); prints the
    /// ptxas report. Skips, saying so, where NVRTC is missing.
    #[test]
    fn all_modules_compile_for_sm90() {
        if !nvrtc_or_skip() {
            return;
        }
        type Variants = &'static [&'static [(&'static str, u32)]];
        let hd3: Variants = &[
            &[("HEAD_DIM", 128)],
            &[("HEAD_DIM", 80)],
            &[("HEAD_DIM", 64)],
        ];
        let hd_tc: Variants = &[&[("HEAD_DIM", 128)], &[("HEAD_DIM", 64)]];
        let plain: Variants = &[&[]];
        // ALL, then the backward modules (defined beside their launchers)
        let modules = ALL
            .iter()
            .map(|&m| (m, if m.name == "attention" { hd3 } else { plain }))
            .chain([
                (crate::cuda::attention_bwd::ATTENTION_BWD, plain),
                (crate::cuda::attention_bwd_tc::ATTENTION_BWD_TC, hd_tc),
                (crate::cuda::policy_loss::POLICY_LOSS, plain),
                (crate::cuda::grad::GRAD, plain),
            ]);
        for (m, variants) in modules {
            for defines in variants {
                let source = format!("{COMMON}\n#line 1 \"{}.cu\"\n{}", m.name, m.source);
                match compile_uncached(m.name, &source, &options("sm_90", defines)) {
                    Ok((cubin, log)) => {
                        assert!(!cubin.is_empty());
                        println!("== {} {defines:?} ({} bytes)\n{log}", m.name, cubin.len());
                    }
                    Err(e) => panic!("{e}"),
                }
            }
        }
    }
}
