//! torch.export packages load side by side: instances of one package loading on several
//! threads at once (GPU instances load so, and `make bench` loads CPU ones so) each get a
//! working model with the same scores.
use std::path::PathBuf;

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
    let mut scores = Vec::new();
    for _ in 0..3 {
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let (spec, data) = (spec.clone(), data.clone());
                std::thread::spawn(move || {
                    tch::set_num_threads(1);
                    let mut engine = TorchEngine::load(&spec, None).map_err(|e| e.to_string())?;
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
                    Ok::<_, String>(out.logits.unwrap_or_default())
                })
            })
            .collect();
        for t in threads {
            scores.push(t.join().unwrap().unwrap());
        }
    }
    assert_eq!(scores[0].len(), 1000);
    assert!(
        scores.iter().all(|s| s == &scores[0]),
        "the instances' scores differ"
    );
}
