//! torch.export packages load side by side: instances of one package loading on several
//! threads at once (each model's instances load so, and `make bench` loads CPU ones so)
//! each get a working model with the same scores, from tensors or from images the engine
//! normalizes. libtorch's loader is not safe to run
//! twice at once; without the shim's lock this test crashed or a load failed within ten
//! rounds.
use std::path::PathBuf;
use std::sync::{Arc, Barrier};

use visiongate::domain::{Normalize, Precision, Runtime};
use visiongate::engine::{
    normalize_on_cpu, BatchInput, Engine, EngineSpec, OutputRequest, TorchEngine,
};

const NORMALIZE: Normalize = Normalize {
    mean: [0.485, 0.456, 0.406],
    std: [0.229, 0.224, 0.225],
};

fn bits(logits: &Option<Vec<f32>>) -> Vec<u32> {
    logits.iter().flatten().map(|v| v.to_bits()).collect()
}

#[test]
fn instances_of_one_package_load_and_run_on_threads_at_once() {
    let models = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models");
    let spec = EngineSpec::bundled(&models, Runtime::TorchAoti, Precision::Fp32);
    assert!(
        spec.file.is_file(),
        "{}: the set-up exports it (scripts/export_model.py)",
        spec.file.display()
    );
    // One image's pixels, and what the host normalization makes of them.
    let pixels: Vec<u8> = (0..224 * 224 * 3).map(|i| (i * 7 % 256) as u8).collect();
    let data = normalize_on_cpu(&pixels, 224, 224, NORMALIZE);
    // Loads that start together, ten times over (a package's loads at once raced in
    // libtorch's loader: one saw no metadata, or the process crashed); the first
    // round's instances also run.
    let mut scores = Vec::new();
    for round in 0..10 {
        let start = Arc::new(Barrier::new(2));
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let (spec, data, start) = (spec.clone(), data.clone(), start.clone());
                let pixels = pixels.clone();
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
                    // The same rows as u8 images, normalized by the engine on the host
                    // (NCHW for a package): the same logits, bit for bit.
                    let images = BatchInput::Images {
                        data: &pixels,
                        height: 224,
                        width: 224,
                        normalize: NORMALIZE,
                    };
                    let from_images = engine.run(images, want).map_err(|e| e.to_string())?;
                    assert_eq!(bits(&from_images.logits), bits(&out.logits));
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
