//! The runtimes this build has, by the runtime a model's platform (or backend) names. Each
//! runtime is a module of `engine/` under its own Cargo feature exposing one [`Backend`]
//! (`libtorch`: TorchScript and torch.export packages; `onnx`: ONNX Runtime; `openvino`:
//! OpenVINO); a model whose
//! runtime the build lacks fails its own load, naming the runtime and the feature.
use std::collections::HashMap;

use super::{repository_relative, EngineError, EngineSpec, Stages};
use crate::domain::{InstanceId, Runtime};

/// A runtime, started: it loads what each instance of the models it runs runs (its
/// engine, and the decoder of its JPEG rows where its device has one), on that instance's
/// own thread.
pub trait Backend: Send + Sync {
    fn load(&self, spec: &EngineSpec, instance: InstanceId) -> Result<Stages, EngineError>;
}

/// The libraries models run on, each a Cargo feature of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RuntimeKind {
    Libtorch,
    OnnxRuntime,
    OpenVino,
}

impl RuntimeKind {
    /// The library that runs `runtime`'s model files.
    pub fn of(runtime: &Runtime) -> RuntimeKind {
        match runtime {
            Runtime::TorchScript | Runtime::TorchAoti => RuntimeKind::Libtorch,
            Runtime::Onnx(_) => RuntimeKind::OnnxRuntime,
            Runtime::OpenVino(_) => RuntimeKind::OpenVino,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            RuntimeKind::Libtorch => "libtorch",
            RuntimeKind::OnnxRuntime => "ONNX Runtime",
            RuntimeKind::OpenVino => "OpenVINO",
        }
    }

    /// The Cargo feature that builds it in.
    pub fn feature(self) -> &'static str {
        match self {
            RuntimeKind::Libtorch => "torch",
            RuntimeKind::OnnxRuntime => "onnx",
            RuntimeKind::OpenVino => "openvino",
        }
    }
}

/// The started runtimes of this process.
#[derive(Default)]
pub struct Registry {
    backends: HashMap<RuntimeKind, Box<dyn Backend>>,
}

impl Registry {
    pub fn add(&mut self, kind: RuntimeKind, backend: impl Backend + 'static) {
        self.backends.insert(kind, Box::new(backend));
    }

    /// The runtimes it has, by name, sorted.
    pub fn names(&self) -> Vec<&'static str> {
        let mut names: Vec<_> = self.backends.keys().map(|k| k.name()).collect();
        names.sort_unstable();
        names
    }

    /// What one instance of `spec`'s model runs, from the runtime its file needs.
    pub fn load(&self, spec: &EngineSpec, instance: InstanceId) -> Result<Stages, EngineError> {
        let kind = RuntimeKind::of(&spec.runtime);
        match self.backends.get(&kind) {
            Some(backend) => backend.load(spec, instance),
            None => Err(EngineError::Load {
                path: repository_relative(&spec.file),
                message: format!(
                    "{} runs on {}, which this build of visiongate leaves out (built without \
                     the Cargo feature `{}`)",
                    spec.runtime.format(),
                    kind.name(),
                    kind.feature()
                ),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{OnnxOptions, Precision};
    use crate::engine::FakeFaults;
    use std::sync::Arc;
    use std::time::Duration;

    struct Fake(Arc<FakeFaults>);

    impl Backend for Fake {
        fn load(&self, spec: &EngineSpec, _: InstanceId) -> Result<Stages, EngineError> {
            Ok(Stages::engine(self.0.load(
                &spec.file,
                10,
                Duration::ZERO,
            )?))
        }
    }

    #[test]
    fn a_model_whose_runtime_the_build_lacks_fails_naming_the_runtime_and_feature() {
        let repository = std::path::Path::new("/models");
        let onnx = EngineSpec::bundled(
            repository,
            Runtime::Onnx(OnnxOptions::default()),
            Precision::Fp32,
        );
        let torch = EngineSpec::bundled(repository, Runtime::TorchScript, Precision::Fp32);
        let instance = InstanceId {
            gpu: None,
            index: 0,
        };
        let mut registry = Registry::default();
        registry.add(RuntimeKind::Libtorch, Fake(Arc::default()));
        assert!(registry.load(&torch, instance).is_ok());
        let Err(EngineError::Load { path, message }) = registry.load(&onnx, instance) else {
            panic!("an ONNX model loaded without ONNX Runtime");
        };
        assert_eq!(path, "classifier/1/model.onnx");
        assert_eq!(
            message,
            "an ONNX file runs on ONNX Runtime, which this build of visiongate leaves out \
             (built without the Cargo feature `onnx`)"
        );
    }
}
