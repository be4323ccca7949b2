//! torch.export packages load side by side: instances of one package loading on several
//! threads at once (each model's instances load so, and `make bench` loads CPU ones so)
//! each get a working model with the same scores. libtorch's loader is not safe to run
//! twice at once; without the shim's lock this test crashed or a load failed within ten
//! rounds.
use std::path::PathBuf;
use std::sync::{Arc, Barrier};

use visiongate::domain::{Precision, Runtime};
use visiongate::engine::{BatchInput, Engine, EngineSpec, OutputRequest, TorchEngine};

#[test]
fn instances_of_one_package_load_and_run_on_threads_at_once() {
    let models = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models");
    let spec = EngineSpec::bundled(&models, Runtime::TorchAoti, Precision::Fp32);
    assert!(
        spec.file.is_file(),
        "{}: the set-up exports it (scripts/export_model.py)",
        spec.file.display()
    );
    let data: Vec<f32> = (0..3 * 224 * 224)
        .map(|i| (i % 255) as f32 / 128.0 - 1.0)
        .collect();
    // Loads that start together, ten times over (a package's loads at once raced in
    // libtorch's loader: one saw no metadata, or the process crashed); the first
    // round's instances also run.
    let mut scores = Vec::new();
    for round in 0..10 {
        let start = Arc::new(Barrier::new(2));
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let (spec, data, start) = (spec.clone(), data.clone(), start.clone());
                std::thread::spawn(move || {
                    tch::set_num_threads(1);
                    start.wait();
                    let mut engine = TorchEngine::load(&spec, None).map_err(|e| e.to_string())?;
                    if round > 0 {
                        return Ok(None);
                    }
                    let input = BatchInput::Tensors {
                        data: &data,
                        height: 224,
                        width: 224,
                    };
                    let want = OutputRequest {
                        logits: true,
                        ..OutputRequest::default()
                    };
                    let out = engine.run(input, want).map_err(|e| e.to_string())?;
                    Ok::<_, String>(out.logits)
                })
            })
            .collect();
        for t in threads {
            let loaded = t.join().unwrap();
            if let Some(logits) = loaded.unwrap_or_else(|e| panic!("round {round}: {e}")) {
                scores.push(logits);
            }
        }
    }
    assert_eq!(scores.len(), 2);
    assert_eq!(scores[0].len(), 1000);
    assert!(
        scores.iter().all(|s| s == &scores[0]),
        "the instances' scores differ"
    );
}
