//! Build glue: compile the project's protobuf files, and make the binary find and keep libtorch.
use std::env;
use std::path::PathBuf;

fn main() {
    compile_protos();
    link_libtorch();
}

/// `proto/model_config.proto` becomes prost types plus a descriptor set, which the
/// repository module uses to parse `config.pbtxt` (protobuf text format).
fn compile_protos() {
    let protoc = protoc_bin_vendored::protoc_bin_path().expect("vendored protoc for this host");
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    println!("cargo:rerun-if-changed=proto");
    prost_build::Config::new()
        .protoc_executable(protoc)
        .file_descriptor_set_path(out.join("model_config_descriptor.bin"))
        .compile_protos(&["proto/model_config.proto"], &["proto"])
        .expect("proto/model_config.proto compiles");
}

/// torch-sys links libtorch but leaves two gaps (see ARCHITECTURE.md):
/// - nothing puts libtorch on the run-time search path: add an rpath to its lib dir;
/// - rustc links with `--as-needed`, which drops `libtorch_cuda.so` because no symbol
///   of it is referenced directly, so CUDA would never register. Link it on purpose.
fn link_libtorch() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    let Ok(dir) = env::var("DEP_TCH_LIBTORCH_LIB") else {
        return;
    };
    // Resolve the `.libtorch` link so the binary keeps working from any checkout.
    let dir = std::fs::canonicalize(&dir).unwrap_or_else(|_| PathBuf::from(&dir));
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
    println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
    if dir.join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-ltorch_cuda");
    }
    println!("cargo:rustc-link-arg=-ltorch");
    println!("cargo:rustc-link-arg=-Wl,--as-needed");
}
