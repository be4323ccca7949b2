//! Build glue: compile the project's protobuf files, make the binary find and keep libtorch,
//! and record where the set-up put the runtime libraries opened at run time.
use std::env;
use std::path::PathBuf;

fn main() {
    compile_protos();
    record_setup_libraries();
    // Without the `torch` feature (the fuzz targets) nothing of libtorch is built or linked.
    if env::var_os("CARGO_FEATURE_TORCH").is_some() {
        link_libtorch();
        compile_shims();
    }
}

/// Where the set-up installed the native libraries the binary opens at run time (ONNX
/// Runtime's, OpenVINO's, nvJPEG's: `scripts/env.sh` names them while building), as compile-time
/// variables: the binary looks there when no flag names them (`engines::setup_library`).
/// Empty where the build's environment names none.
fn record_setup_libraries() {
    for (variable, recorded) in [
        (
            "VISIONGATE_ONNXRUNTIME_LIBRARY",
            "VISIONGATE_SETUP_ONNXRUNTIME_LIBRARY",
        ),
        (
            "VISIONGATE_OPENVINO_LIBRARY",
            "VISIONGATE_SETUP_OPENVINO_LIBRARY",
        ),
        (
            "VISIONGATE_NVJPEG_LIBRARY",
            "VISIONGATE_SETUP_NVJPEG_LIBRARY",
        ),
    ] {
        println!("cargo:rerun-if-env-changed={variable}");
        let path = env::var(variable).unwrap_or_default();
        println!("cargo:rustc-env={recorded}={path}");
    }
}

/// `proto/model_config.proto` becomes prost types plus a descriptor set, which the
/// repository module uses to parse `config.pbtxt` (protobuf text format).
/// `proto/grpc_service.proto` becomes the tonic service (in `OUT_DIR/grpc`), reusing the
/// repository's `ModelConfig` types. protoc is the vendored binary, not the system's.
fn compile_protos() {
    let protoc = protoc_bin_vendored::protoc_bin_path().expect("vendored protoc for this host");
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    println!("cargo:rerun-if-changed=proto");
    prost_build::Config::new()
        .protoc_executable(&protoc)
        .file_descriptor_set_path(out.join("model_config_descriptor.bin"))
        .compile_protos(&["proto/model_config.proto"], &["proto"])
        .expect("proto/model_config.proto compiles");

    let grpc_out = out.join("grpc");
    std::fs::create_dir_all(&grpc_out).expect("OUT_DIR is writable");
    let mut config = prost_build::Config::new();
    config.protoc_executable(&protoc);
    // Tensor bytes stay `Bytes` (no copy out of the received message).
    config.bytes(["."]);
    // Every ModelConfig message and enum is the repository's (same package).
    for name in model_config_types() {
        config.extern_path(
            format!(".inference.{name}"),
            format!("crate::repository::pb::{name}"),
        );
    }
    tonic_prost_build::configure()
        // The client too: the tests call the server over gRPC with it.
        .build_client(true)
        // prost's codec, with a check of what a request takes decoded (src/grpc/wire.rs).
        .codec_path("crate::grpc::CheckedCodec")
        .out_dir(&grpc_out)
        .compile_with_config(config, &["proto/grpc_service.proto"], &["proto"])
        .expect("proto/grpc_service.proto compiles");
}

/// Top-level message and enum names of `proto/model_config.proto`.
fn model_config_types() -> Vec<String> {
    let text = std::fs::read_to_string("proto/model_config.proto").expect("proto file readable");
    let mut depth = 0i32;
    let mut names = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if depth == 0 {
            for kind in ["message ", "enum "] {
                if let Some(rest) = line.strip_prefix(kind) {
                    if let Some(name) = rest.split_whitespace().next() {
                        names.push(name.trim_end_matches('{').to_string());
                    }
                }
            }
        }
        if !line.starts_with("//") {
            depth += line.matches('{').count() as i32 - line.matches('}').count() as i32;
        }
    }
    names
}

/// torch-sys links libtorch but leaves a gap (see ARCHITECTURE.md): nothing puts libtorch
/// on the run-time search path, so add an rpath to its lib dir. Neither `libtorch.so`
/// nor `libtorch_cuda.so` (which `libtorch.so` names) is linked, as rustc's `--as-needed`
/// leaves them out: the binary opens `libtorch_cuda.so` at run time on hosts with the
/// NVIDIA driver (`engine::libtorch::cuda_host::cuda_support`).
fn link_libtorch() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    let Ok(dir) = env::var("DEP_TCH_LIBTORCH_LIB") else {
        return;
    };
    // Resolve the `.libtorch` link so the binary keeps working from any checkout.
    let dir = std::fs::canonicalize(&dir).unwrap_or_else(|_| PathBuf::from(&dir));
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
}

/// `src/engine/libtorch/cuda_shim.cpp` and `aoti_shim.cpp`: the few libtorch calls tch does not
/// expose (TF32, a stream per instance, CUDA events; AOTInductor packages), built against
/// the same libtorch headers as torch-sys's own wrapper (same C++ standard and ABI flags).
fn compile_shims() {
    println!("cargo:rerun-if-changed=src/engine/libtorch/cuda_shim.cpp");
    println!("cargo:rerun-if-changed=src/engine/libtorch/aoti_shim.cpp");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    let lib = PathBuf::from(
        env::var("DEP_TCH_LIBTORCH_LIB").expect("torch-sys reports libtorch's lib dir"),
    );
    let include = lib
        .parent()
        .expect("libtorch's lib dir has a parent")
        .join("include");
    let abi = env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_string());
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(&include)
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .file("src/engine/libtorch/cuda_shim.cpp")
        .file("src/engine/libtorch/aoti_shim.cpp")
        .compile("visiongate_shims");
    libtorch_stub();
}

/// `OUT_DIR/libtorch_stub.so`, which the binary embeds: an empty shared library named
/// `libtorch.so`. A torch.export package's compiled model names `libtorch.so`, whose only
/// work is to pull in libtorch_cpu (which the binary links) and libtorch_cuda (which the
/// binary opens where the NVIDIA driver is, and which costs a CPU host about 130 MiB of
/// memory for nothing): the stub meets that name (`engine/libtorch/aoti.rs`).
fn libtorch_stub() {
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let source = out.join("libtorch_stub.c");
    std::fs::write(&source, "/* libtorch.so's name, nothing else */\n")
        .expect("OUT_DIR is writable");
    let compiler = cc::Build::new().get_compiler();
    let status = compiler
        .to_command()
        .args([
            "-shared",
            "-fPIC",
            "-nostdlib",
            "-Wl,-soname,libtorch.so",
            "-o",
        ])
        .arg(out.join("libtorch_stub.so"))
        .arg(&source)
        .status()
        .expect("the C compiler runs");
    assert!(status.success(), "the libtorch.so stub did not build");
}
