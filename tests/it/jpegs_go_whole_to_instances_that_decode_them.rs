//! Where the classifier's instances have a JPEG decoder (GPU instances with nvJPEG; here
//! the fake's, which fails every JPEG, so that its instance decodes them on the CPU as a
//! GPU instance does what its decoder fails), the pipeline passes the JPEGs whose structure
//! the GPU decoder takes on whole, unless the CPU path would decode them at a DCT scale,
//! and decodes the rest on the CPU, each counted with its reason; every image gets the
//! class it gets when all are decoded on the CPU, and a JPEG that passes the header check
//! but cannot be decoded is its own file's error in `/predict` and fails a KServe ensemble
//! request, naming its row.
use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::{photo, solid_png, TestGateway};
use visiongate::engine::FakeFaults;
use visiongate::settings::Config;
use visiongate::EngineChoice;

async fn gateway(decodes_jpeg: bool) -> TestGateway {
    TestGateway::start_with(
        Config::for_tests(),
        EngineChoice::Fake {
            num_classes: 1000,
            latency: Duration::from_millis(1),
            faults: Arc::new(FakeFaults {
                decodes_jpeg,
                ..Default::default()
            }),
        },
    )
    .await
}

/// `jpeg` without its quantization tables (DQT segments): its structure is whole, but no
/// decoder can decode it.
fn without_quantization_tables(jpeg: &[u8]) -> Vec<u8> {
    let mut out = jpeg[..2].to_vec();
    let mut i = 2;
    while i + 4 <= jpeg.len() && jpeg[i] == 0xFF && jpeg[i + 1] != 0xDA {
        let end = i + 2 + u16::from_be_bytes([jpeg[i + 2], jpeg[i + 3]]) as usize;
        if jpeg[i + 1] != 0xDB {
            out.extend_from_slice(&jpeg[i..end]);
        }
        i = end;
    }
    out.extend_from_slice(&jpeg[i..]);
    out
}

/// Images decoded on the CPU for `reason`.
async fn cpu_decodes(gw: &TestGateway, reason: &str) -> f64 {
    let labels = ["path=\"cpu\"", &format!("reason=\"{reason}\"")];
    gw.metric("visiongate_decode_images_total", &labels).await
}

/// Each file's class, or its error code.
fn classes(reply: &common::Reply) -> Vec<String> {
    reply
        .results()
        .iter()
        .map(|r| match r["class_id"].as_u64() {
            Some(class) => class.to_string(),
            None => r["error"]["code"]
                .as_str()
                .expect("a class or an error")
                .to_string(),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn jpegs_go_whole_to_instances_that_decode_them_and_the_rest_are_decoded_here() {
    let (_, baseline) = photo("small", "Aqua.jpg");
    // 1600 x 1000: the CPU path decodes it at 1/2 scale (the bundled short side of 448).
    let (_, large) = photo("medium", "Path.jpg");
    let progressive = std::fs::read(common::fixtures().join("generated/progressive.jpg")).unwrap();
    let broken = without_quantization_tables(&baseline);
    assert!(
        broken.len() < baseline.len(),
        "the photo has quantization tables"
    );
    let files = vec![
        ("baseline.jpg".to_string(), baseline.clone()),
        ("progressive.jpg".to_string(), progressive),
        ("red.png".to_string(), solid_png(90)),
        ("large.jpg".to_string(), large),
    ];

    let cpu = gateway(false).await;
    let on_cpu = cpu.predict("", &files).await;
    assert_eq!(on_cpu.status, 200, "{}", on_cpu.json);
    assert_eq!(cpu_decodes(&cpu, "no_gpu_decoder").await, 4.0);
    cpu.stop().await;

    let gpu = gateway(true).await;
    let mut with_broken = files.clone();
    with_broken.insert(1, ("broken.jpg".to_string(), broken.clone()));
    let r = gpu.predict("", &with_broken).await;
    assert_eq!(r.status, 200, "{}", r.json);
    // The broken JPEG went whole to the instance, which could not decode it; the others
    // have the classes they have when decoded on the decode threads.
    let mut want = classes(&on_cpu);
    assert!(want.iter().all(|c| c.parse::<u32>().is_ok()), "{want:?}");
    want.insert(1, "invalid_image".into());
    assert_eq!(classes(&r), want, "{}", r.json);

    // The two baseline JPEGs in the instance (its "GPU" failed them), the others on the
    // decode threads, each with its reason.
    assert_eq!(cpu_decodes(&gpu, "gpu_failed").await, 2.0);
    assert_eq!(cpu_decodes(&gpu, "progressive").await, 1.0);
    assert_eq!(cpu_decodes(&gpu, "not_jpeg").await, 1.0);
    assert_eq!(cpu_decodes(&gpu, "dct_scale").await, 1.0);
    assert_eq!(cpu_decodes(&gpu, "no_gpu_decoder").await, 0.0);

    // A KServe ensemble request: the broken JPEG fails it, naming its row.
    let (status, json) = gpu.ensemble_infer(&[baseline, broken]).await;
    assert_eq!(status, 400, "{json}");
    let error = json["error"].as_str().unwrap();
    assert!(error.contains("row 1") && error.contains("JPEG"), "{error}");
    gpu.stop().await;
}
