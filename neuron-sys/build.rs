//! Chooses the libnrt bindings neuron-sys compiles against.
//!
//! - Default (no `bindgen` feature): the committed `src/bindings.rs`, generated from
//!   `include/nrt_deepinfer.h`. Needs neither libclang nor libnrt nor the Neuron SDK.
//! - Feature `bindgen`, with `nrt/nrt.h` under `$NEURON_RT_INCLUDE_DIR` (default
//!   `/opt/aws/neuron/include`): bindgen reads `include/nrt_deepinfer.h` in system-header
//!   mode (the installed SDK headers replace our declarations), writes
//!   `$OUT_DIR/bindings.rs`, and the crate compiles against that (`cfg(neuron_sys_system_bindings)`),
//!   so a signature or struct that drifted in the installed runtime breaks the build instead
//!   of corrupting memory. If bindgen fails there (no libclang, headers too old to declare
//!   every function we bind), the build warns and keeps the committed bindings.
//! - Feature `bindgen` with `NEURON_SYS_BINDINGS_OUT=<file>`: bindgen regenerates the
//!   committed bindings from `include/nrt_deepinfer.h` into that file and fails the build
//!   if it cannot. `scripts/check_bindings.sh` uses this to diff against `src/bindings.rs`.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(neuron_sys_system_bindings)");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=include/nrt_deepinfer.h");
    println!("cargo:rerun-if-env-changed=NEURON_RT_INCLUDE_DIR");
    println!("cargo:rerun-if-env-changed=NEURON_SYS_BINDINGS_OUT");
    #[cfg(feature = "bindgen")]
    regenerate::run();
}

#[cfg(feature = "bindgen")]
mod regenerate {
    use std::env;
    use std::path::{Path, PathBuf};

    /// Where the Neuron SDK installs its headers (`aws-neuronx-runtime-lib`).
    const DEFAULT_INCLUDE_DIR: &str = "/opt/aws/neuron/include";

    /// Items the crate uses from the bindings; a system-header run that lacks any of them
    /// (an SDK too old for this crate) falls back to the committed bindings.
    const NEEDED: &[&str] = &[
        "pub type NRT_STATUS",
        "pub struct nrt_tensor_info ",
        "pub struct nrt_tensor_info_array ",
        "pub struct nrt_version ",
        "pub rt_major",
        "pub type nrt_init_fn",
        "pub type nrt_execute_fn",
        "pub type nrt_tensor_allocate_slice_fn",
        "pub type nrt_get_status_as_str_fn",
        "pub type nrt_get_visible_vnc_count_fn",
    ];

    pub fn run() {
        let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
        let header = manifest.join("include/nrt_deepinfer.h");

        if let Some(out) = env::var_os("NEURON_SYS_BINDINGS_OUT") {
            // Asked for explicitly (check_bindings.sh): failing loudly is the point.
            let text = generate(&header, None)
                .unwrap_or_else(|e| panic!("bindgen on {} failed: {e}", header.display()));
            std::fs::write(&out, text)
                .unwrap_or_else(|e| panic!("cannot write {}: {e}", PathBuf::from(&out).display()));
        }

        let include_dir = env::var_os("NEURON_RT_INCLUDE_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_INCLUDE_DIR));
        let nrt_h = include_dir.join("nrt/nrt.h");
        if !nrt_h.is_file() {
            return;
        }
        println!("cargo:rerun-if-changed={}", nrt_h.display());
        let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets it"));
        match generate(&header, Some(&include_dir)) {
            Ok(text) => {
                if let Some(missing) = NEEDED.iter().find(|item| !text.contains(*item)) {
                    println!(
                        "cargo:warning=neuron-sys: the headers in {} lack `{missing}`; using the committed bindings",
                        include_dir.display()
                    );
                    return;
                }
                let path = out_dir.join("bindings.rs");
                if let Err(e) = std::fs::write(&path, text) {
                    println!(
                        "cargo:warning=neuron-sys: cannot write {}: {e}; using the committed bindings",
                        path.display()
                    );
                    return;
                }
                println!("cargo:rustc-cfg=neuron_sys_system_bindings");
            }
            Err(e) => println!(
                "cargo:warning=neuron-sys: bindgen on the headers in {} failed ({e}); using the committed bindings",
                include_dir.display()
            ),
        }
    }

    /// Runs bindgen on our header; with `system_include`, in system-header mode.
    ///
    /// The options here are the single definition of how `src/bindings.rs` is produced.
    fn generate(header: &Path, system_include: Option<&Path>) -> Result<String, String> {
        let target = bindgen::RustTarget::stable(85, 0).map_err(|e| e.to_string())?;
        let mut builder = bindgen::Builder::default()
            .header(header.to_string_lossy())
            .rust_target(target)
            .allowlist_type(
                "NRT_STATUS|nrt_(model|tensor|tensor_set|tensor_placement|framework_type|\
                 tensor_usage|dtype|tensor_info|tensor_info_array|version)_t|nrt_[a-z_]+_fn",
            )
            .allowlist_var("NRT_TENSOR_NAME_MAX|RT_VERSION_DETAIL_LEN|GIT_HASH_LEN")
            .prepend_enum_name(false)
            .layout_tests(true)
            .derive_default(false)
            .generate_comments(true)
            .raw_line(
                "// @generated by bindgen from neuron-sys/include/nrt_deepinfer.h \
                 (see neuron-sys/build.rs). Do not edit: run \
                 `neuron-sys/scripts/check_bindings.sh --update`.",
            );
        if let Some(dir) = system_include {
            builder = builder
                .clang_arg("-DNRT_DEEPINFER_SYSTEM_HEADERS")
                .clang_arg(format!("-I{}", dir.display()));
        }
        let bindings = builder.generate().map_err(|e| e.to_string())?;
        Ok(bindings.to_string())
    }
}
